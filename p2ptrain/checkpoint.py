"""Atomic checkpoints of a worker's full state: write to a temporary file, fsync, rename over the old one.

A crash at any moment leaves either the previous checkpoint or the new one under the final name, never a
half-written file: ``os.replace`` is atomic on POSIX file systems. In ``--checkpoint-dir`` a 1-rank peer writes
``<run-id>.pt``; a peer of several ranks writes ``<run-id>-sharded/step-<outer>-<local>/`` folders and a ``latest``
file naming the complete one (``hsdp.ShardedDiLoCo.save_checkpoint``). ``resume_state`` picks between the two.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from p2ptrain.config import ConfigError

FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file and what to do."""


def checkpoint_path(directory: str | Path, run_id: str) -> Path:
    """A 1-rank peer's checkpoint file."""
    return Path(directory) / f"{run_id}.pt"


def sharded_checkpoint_dir(directory: str | Path, run_id: str) -> Path:
    """Where a peer of several ranks keeps its sharded checkpoints."""
    return Path(directory) / f"{run_id}-sharded"


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


def latest_sharded(directory: str | Path) -> Optional[Path]:
    """The checkpoint folder ``directory/latest`` names, or None."""
    pointer = Path(directory) / "latest"
    if not pointer.is_file():
        return None
    target = Path(directory) / pointer.read_text().strip()
    return target if target.is_dir() else None


def latest_sharded_or_raise(directory: str | Path) -> Path:
    target = latest_sharded(directory)
    if target is None:
        raise CheckpointError(f"no sharded checkpoint in {directory} (no 'latest' file); drop --resume to start fresh")
    return target


def point_latest_at(directory: str | Path, target: Path) -> None:
    """Make ``directory/latest`` name ``target`` (atomically) and remove the checkpoint it named before."""
    directory = Path(directory)
    previous = latest_sharded(directory)
    tmp = directory / f".latest.tmp-{os.getpid()}"
    tmp.write_text(target.name)
    os.replace(tmp, directory / "latest")
    if previous is not None and previous != target:
        shutil.rmtree(previous, ignore_errors=True)


def read_sharded_meta(directory: str | Path) -> dict:
    """What ``ShardedDiLoCo.save_checkpoint(extra=...)`` stored with the latest sharded checkpoint in ``directory``
    (plus "ranks" and the counters): readable before any process group exists, to check a resume against the
    config."""
    state = load_checkpoint(latest_sharded_or_raise(directory) / "diloco.pt")
    diloco = state.pop("diloco", {})
    return {**state, "outer_step": diloco.get("outer_step"), "local_step": diloco.get("local_step")}


def resume_state(directory: Optional[str], run_id: str, *, model: str, num_shards: int, sharded_peer: bool) -> dict:
    """The checkpoint ``--resume`` continues from: the latest of either kind, since a peer may come back with another
    number of ranks (between two of the same age, the kind this peer writes: ``sharded_peer``). Its "sharded" says
    which kind it is; a full one is loaded, of a sharded one only the meta. Refuses one of another run, model or
    number of data shards."""
    if not directory:
        raise ConfigError("--resume needs --checkpoint-dir: the folder the previous run wrote its checkpoint to")
    full_path, sharded_dir = checkpoint_path(directory, run_id), sharded_checkpoint_dir(directory, run_id)
    candidates = []
    if full_path.exists():
        full = load_checkpoint(full_path)
        candidates.append({**full, "sharded": False, "outer_step": full["optimizer"]["outer_step"],
                           "local_step": full["optimizer"]["local_step"]})
    if (sharded_dir / "latest").exists():
        candidates.append({**read_sharded_meta(sharded_dir), "sharded": True})
    if not candidates:
        raise CheckpointError(f"no checkpoint at {full_path} or in {sharded_dir}; drop --resume to start fresh, or "
                              "check --checkpoint-dir")
    state = max(candidates, key=lambda c: (c["outer_step"], c["local_step"], c["sharded"] == sharded_peer))
    for key, expected in (("run_id", run_id), ("model", model), ("num_shards", num_shards)):
        if state.get(key) != expected:
            raise ConfigError(
                f"the checkpoint was written with {key}={state.get(key)!r} but this run has {expected!r}; "
                f"use the same {key} to resume"
            )
    return state
