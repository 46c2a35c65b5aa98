"""Checkpoints are atomic: a crash mid-write leaves the previous one intact; a bad file is a clear error."""

from __future__ import annotations

import pytest
import torch

from p2ptrain import checkpoint
from p2ptrain.checkpoint import CheckpointError, load_checkpoint, save_checkpoint


def test_round_trip(tmp_path):
    path = tmp_path / "run.pt"
    save_checkpoint(path, {"x": torch.arange(3), "outer_step": 4})
    state = load_checkpoint(path)
    assert torch.equal(state["x"], torch.arange(3)) and state["outer_step"] == 4


def test_crash_mid_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "run.pt"
    save_checkpoint(path, {"outer_step": 1})

    def dying_save(obj, f):
        f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", dying_save)
    with pytest.raises(OSError):
        save_checkpoint(path, {"outer_step": 2})
    monkeypatch.undo()
    assert load_checkpoint(path)["outer_step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["run.pt"], "the temporary file must not be left behind"


@pytest.mark.parametrize("content", [b"", b"not a checkpoint at all"])
def test_corrupt_or_missing_file_is_a_clear_error(tmp_path, content):
    path = tmp_path / "run.pt"
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        load_checkpoint(path)
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="cannot be read"):
        load_checkpoint(path)
