"""Atomic checkpoints of a worker's full state: write to a temporary file, fsync, rename over the old one.

A crash at any moment leaves either the previous checkpoint or the new one under the final name, never a
half-written file: ``os.replace`` is atomic on POSIX file systems.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict

import torch

FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what to do."""


def checkpoint_path(directory: str | Path, run_id: str) -> Path:
    return Path(directory) / f"{run_id}.pt"


def save_checkpoint(path: str | Path, state: Dict[str, Any]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save({"format_version": FORMAT_VERSION, **state}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        # make the rename itself durable: fsync the directory entry
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path: str | Path) -> Dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}; drop --resume to start fresh, or check --checkpoint-dir")
    try:
        # mmap: tensors are read when used, so looking at a checkpoint's counters (a resume that compares the
        # kinds of checkpoint, on every rank) costs no copy of the model
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({type(e).__name__}); move it aside and start without --resume"
        ) from None
    if not isinstance(state, dict) or state.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} is not a p2ptrain v{FORMAT_VERSION} checkpoint; move it aside")
    return state
