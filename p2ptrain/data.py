"""Training text: load the corpus, hold out a validation split, cut the rest into per-peer shards.

The built-in models read raw bytes, so their corpus is just the bytes of the files, joined, in memory. Any other
tokenizer's tokens are in a cache file on disk (``tokens.TokenFile``, made by ``tokens/cache.py``), read a batch's
rows at a time; the split, the shards and the batches below work on either, a byte being a token. Every peer of a run
must load the same corpus (same files, same order, same tokenizer): the shards and the validation split are token ranges
of it, and peers that disagree on it would overlap their shards and report eval losses that cannot be compared.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Callable, Iterable, Optional, Protocol, Sequence, Union

import torch

CORPUS_DIR = Path(__file__).parent / "corpus"
FILE_SEPARATOR = b"\n\n"

Batch = tuple[torch.Tensor, torch.Tensor]


class TokenSource(Protocol):
    """Tokens in a cache file that batches read rows from (``tokens.TokenFile``): what this module needs of them
    (p2ptrain/tokens builds on this module, not the other way round)."""

    def __len__(self) -> int: ...

    def view(self, start: int, end: int) -> "TokenSource": ...

    def rows(self, starts: torch.Tensor, length: int) -> torch.Tensor: ...


Tokens = Union[bytes, TokenSource]
"""training text: its bytes in memory (the byte-level path), or a token cache file"""


class DataError(ValueError):
    """The training data cannot be used as given; the message names the problem and the fix."""


def builtin_corpus_paths() -> list[Path]:
    """The built-in corpus: the ``*.txt`` files shipped in ``p2ptrain/corpus/``, sorted by name."""
    paths = sorted(p for p in CORPUS_DIR.glob("*.txt") if p.is_file())
    if not paths:
        raise DataError(
            f"the built-in corpus {CORPUS_DIR} has no .txt files; reinstall p2ptrain, "
            "or point --data at a UTF-8 text file or a folder of .txt files"
        )
    return paths


def _text_files(path: Path) -> list[Path]:
    """``path`` itself if it is a file; for a folder, its ``*.txt`` files at any depth, sorted, empty ones left out."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(
            f"--data {path}: no such file or folder; point --data at a UTF-8 text file or a folder of .txt files"
        )
    files = sorted(p for p in path.rglob("*.txt") if p.is_file() and p.stat().st_size > 0)
    if not files:
        raise DataError(
            f"--data {path}: no .txt files with text found; point --data at a UTF-8 text file or a folder of .txt files"
        )
    return files


def load_corpus(paths: Sequence[str | Path] | None = None, min_bytes: int = 1024) -> bytes:
    """The raw bytes of the given files and folders (folders: every ``*.txt`` inside, recursively, sorted), joined
    with a blank line between files. ``None`` or an empty sequence loads the built-in corpus.

    Raises DataError for a missing path, a folder without text, or fewer than ``min_bytes`` bytes in all.
    """
    if isinstance(paths, (str, Path)):
        paths = [paths]  # a lone path, not a sequence of one-character paths
    if paths:
        files = [f for p in paths for f in _text_files(Path(p).expanduser())]
        source = "--data " + " ".join(str(p) for p in paths)
    else:
        files = builtin_corpus_paths()
        source = f"the built-in corpus {CORPUS_DIR}"
    texts = []
    for f in files:
        try:
            texts.append(f.read_bytes())
        except OSError as e:
            raise DataError(f"--data {f}: cannot read it ({e.strerror}); check the file's permissions") from None
    # empty files are dropped so that they do not leave a double separator behind
    data = FILE_SEPARATOR.join(t for t in texts if t)
    if len(data) < min_bytes:
        raise DataError(
            f"{source}: only {len(data)} bytes of text, fewer than the {min_bytes} needed to train; "
            "point --data at more text"
        )
    return data


def token_unit(data: Tokens) -> str:
    """What one of ``data``'s tokens is, for messages: "byte" or "token"."""
    return "byte" if isinstance(data, bytes) else "token"


class _InMemory:
    """Bytes as tokens, in memory: the rows of a batch are gathered from a tensor of them."""

    def __init__(self, data: bytes):
        self._tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)  # a copy: torch wants a writable buffer

    def rows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        """``length`` tokens from each of ``starts``: (len(starts), length) int64."""
        return self._tokens[starts[:, None] + torch.arange(length)].long()


def _token_range(data: Tokens, start: int, end: int) -> Union[_InMemory, TokenSource]:
    """Tokens ``[start, end)`` of ``data``, to read rows from: a copy of that range of bytes, or a view of the file
    (nothing read until a batch needs it)."""
    return _InMemory(data[start:end]) if isinstance(data, bytes) else data.view(start, end)


def split_train_val(data: Tokens, val_fraction: float = 0.1) -> tuple[Tokens, Tokens]:
    """(train, validation): the last ``val_fraction`` of the tokens (bytes, or a token file's: then two views of it)
    is held out, the rest is for training.

    A plain tail split of the whole corpus, not of each file: with several files the held-out text is the end of
    the last one(s). It depends only on the tokens, so every peer holds out the same text.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    num_tokens = len(data)
    num_val = int(num_tokens * val_fraction)
    if num_val < 1 or num_val == num_tokens:
        raise DataError(f"{num_tokens} {token_unit(data)}s of text cannot be split into training and held-out text; "
                        "use more data")
    if isinstance(data, bytes):
        return data[: num_tokens - num_val], data[num_tokens - num_val :]
    return data.view(0, num_tokens - num_val), data.view(num_tokens - num_val, num_tokens)


def _epoch_seed(seed: int, epoch: int) -> int:
    # a hash rather than seed + epoch, so that (seed=0, epoch=1) and (seed=1, epoch=0) shuffle differently
    digest = hashlib.blake2b(f"p2ptrain-data/{seed}/{epoch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def shard_layout(num_tokens: int, num_shards: int, shard_index: int, block_size: int) -> tuple[int, int, int]:
    """(start, end, samples_per_epoch) of shard ``shard_index`` of ``num_tokens`` training tokens (or bytes) cut into
    ``num_shards`` contiguous ranges: its tokens are ``data[start:end]``, and it holds that many non-overlapping
    samples."""
    start, end = num_tokens * shard_index // num_shards, num_tokens * (shard_index + 1) // num_shards
    # a sample needs block_size + 1 tokens: y's last token is one past x's
    return start, end, max(0, end - start - 1) // block_size


def phase_shortfall(num_tokens: int, num_shards: int, block_size: int, local_steps: int, batch_size: int,
                    shard_index: Optional[int] = None, unit: str = "byte") -> Optional[str]:
    """A warning (or None) when a shard holds fewer samples than one inner phase trains on (``local_steps *
    batch_size``): a peer then goes through the whole shard, and on to other shards, within one phase (or, if it is
    pinned to the shard or every other shard is taken, trains on the same samples several times per phase).

    :param unit: what ``num_tokens`` counts, for the message: ``token_unit(data)``
    """
    index = 0 if shard_index is None else shard_index
    _, _, samples = shard_layout(num_tokens, num_shards, index, block_size)
    phase = local_steps * batch_size
    if samples >= phase:
        return None
    total = sum(shard_layout(num_tokens, num_shards, i, block_size)[2] for i in range(num_shards))
    fewer = max(1, min(num_shards - 1, total // phase))
    if total < phase:
        fix = (f"the whole training text ({total} samples) is less than one phase: use more data, or fewer samples "
               f"per phase (--local-steps, --batch-size)")
    else:
        fix = (f"use fewer shards (--num-shards {fewer}, the same on every peer), more data, or fewer samples per "
               "phase (--local-steps, --batch-size)")
    return (f"data shard {index} holds {samples} samples ({num_tokens} {unit}s of training text in {num_shards} "
            f"shards, {block_size}-{unit} samples), fewer than one inner phase trains on (local_steps {local_steps} x "
            f"batch_size {batch_size} = {phase} samples); {fix}")


class ShardedBatches:
    """Endless (x, y) batches from shards of the training tokens (bytes, or a token file); y is x shifted by one token.

    The tokens are cut into ``num_shards`` contiguous ranges, and every sample of a shard lies inside its range, so
    peers on different shards never train on the same text. A sample starts at a multiple of ``block_size`` from the
    start of the shard (non-overlapping windows); one epoch visits each of them once, in an order shuffled by
    (seed, epoch).

    The iterator is on one shard at a time (``shard_index``, ``epoch``, ``position``). Each time it completes an
    epoch of it, it asks ``on_epoch_end`` (if set) where to go on: given the finished shard's state (``epoch`` one
    more, ``position`` 0), it returns a state (``state_for()``, or a published cursor) to continue from, on any
    shard, or None to start the next epoch of the same one. A batch runs on across the boundary either way. A shard
    it leaves is recorded in ``left_shards`` (shard -> its state then) until the caller takes them.

    ``state_dict()`` records the shard and the position; an iterator given it with ``load_state_dict()`` (on any
    shard) yields exactly the batches this one would have yielded next.
    """

    def __init__(
        self, data: Tokens, block_size: int, batch_size: int, shard_index: int, num_shards: int, seed: int = 0,
        on_epoch_end: Optional[Callable[[dict], Optional[dict]]] = None,
    ):
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if num_shards < 1:
            raise ValueError(f"num_shards must be at least 1, got {num_shards}")
        if not 0 <= shard_index < num_shards:
            raise ValueError(f"shard_index {shard_index} must be in [0, {num_shards})")
        self.block_size = block_size
        self.batch_size = batch_size
        self.num_shards = num_shards
        self.seed = seed
        self.on_epoch_end = on_epoch_end
        self._data = data  # bytes are immutable, a token file read-only: a reference, not a copy
        self.left_shards: dict[int, dict] = {}
        """shard -> its state when this iterator left it, since the caller last cleared this"""
        self.epoch = 0  # epochs of the current shard completed
        self.position = 0  # samples of the current epoch already yielded
        self._order_epoch, self._order = -1, torch.empty(0, dtype=torch.long)
        self._set_shard(shard_index)

    def _set_shard(self, shard_index: int) -> None:
        start, end, samples = shard_layout(len(self._data), self.num_shards, shard_index, self.block_size)
        if samples == 0:
            unit = token_unit(self._data)
            raise DataError(
                f"{len(self._data)} {unit}s of training text in {self.num_shards} shards leave {end - start} {unit}s "
                f"per shard, fewer than the {self.block_size + 1} one sample needs; use fewer shards "
                "(train.num_shards) or more data"
            )
        self.shard_index = shard_index
        self.shard_range = (start, end)  # the tokens of ``data`` that this shard's samples lie in
        self.samples_per_epoch = samples
        self._shard = _token_range(self._data, start, end)
        self._order_epoch = -1  # the order is per (seed, epoch) and shard size: make it again

    def _epoch_order(self, epoch: int) -> torch.Tensor:
        """Sample starts relative to the shard, in the order ``epoch`` visits them: (samples_per_epoch,) int64."""
        if epoch != self._order_epoch:
            generator = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            self._order = torch.randperm(self.samples_per_epoch, generator=generator) * self.block_size
            self._order_epoch = epoch
        return self._order

    def window_offsets(self, epoch: int) -> torch.Tensor:
        """Where epoch ``epoch``'s samples start, as token offsets into ``data``, in visiting order."""
        return self._epoch_order(epoch) + self.shard_range[0]

    def __iter__(self) -> ShardedBatches:
        return self

    def __next__(self) -> Batch:
        rows = []
        needed = self.batch_size
        while needed:
            take = self._epoch_order(self.epoch)[self.position : self.position + needed]
            rows.append(self._shard.rows(take, self.block_size + 1))  # (b, T+1) of the shard it came from
            needed -= len(take)
            self.position += len(take)
            if self.position == self.samples_per_epoch:
                self.epoch, self.position = self.epoch + 1, 0
                if self.on_epoch_end is not None:
                    nxt = self.on_epoch_end(self.state_dict())
                    if nxt is not None and nxt["shard_index"] != self.shard_index:
                        self.load_state_dict(nxt)
        chunk = torch.cat(rows)  # (B, T+1)
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()  # (B, T), (B, T)

    def state_for(self, shard_index: int, epoch: int = 0, position: int = 0) -> dict:
        """The state of shard ``shard_index`` at (epoch, position) in this iterator's layout."""
        samples = shard_layout(len(self._data), self.num_shards, shard_index, self.block_size)[2]
        return {
            "epoch": epoch,
            "position": position,
            "seed": self.seed,
            "shard_index": shard_index,
            "num_shards": self.num_shards,
            "block_size": self.block_size,
            "samples_per_epoch": samples,
        }

    def state_dict(self) -> dict:
        return self.state_for(self.shard_index, self.epoch, self.position)

    def reader(self) -> ShardedBatches:
        """Another iterator over the same data in the same layout, on this one's shard, that stays on a shard."""
        return ShardedBatches(self._data, self.block_size, self.batch_size, self.shard_index, self.num_shards,
                              self.seed)

    def load_state_dict(self, state: dict) -> None:
        """Go to the shard and position in ``state``. A ValueError if it was saved by an iterator over different
        data: a position in another model, corpus or shard layout means nothing here."""
        shard_index = state["shard_index"]
        if not isinstance(shard_index, int) or not 0 <= shard_index < self.num_shards:
            raise ValueError(f"the saved data position is in shard {shard_index}, outside [0, {self.num_shards})")
        expected = self.state_for(shard_index)
        for key in ("seed", "num_shards", "block_size", "samples_per_epoch"):
            if state[key] != expected[key]:
                raise ValueError(
                    f"the saved data position has {key}={state[key]}, this iterator {key}={expected[key]}; "
                    "resume with the same corpus, model, seed and number of shards"
                )
        if not 0 <= state["position"] < expected["samples_per_epoch"] or state["epoch"] < 0:
            raise ValueError(f"the saved data position (epoch {state['epoch']}, sample {state['position']}) is invalid")
        if shard_index != self.shard_index:
            self.left_shards[self.shard_index] = self.state_dict()
            self._set_shard(shard_index)
        self.epoch, self.position = state["epoch"], state["position"]


def eval_batches(data: Tokens, block_size: int, batch_size: int, max_batches: int) -> list[Batch]:
    """Held-out batches: up to ``max_batches * batch_size`` samples at evenly spaced offsets over ``data`` (bytes, or
    a token file).

    Deterministic, so every peer evaluates on the same samples and their losses can be compared. A short ``data``
    gives fewer samples (no more than fit side by side), and the last batch may be smaller than ``batch_size``.
    """
    if block_size < 1 or batch_size < 1 or max_batches < 1:
        raise ValueError(
            f"block_size, batch_size and max_batches must be at least 1, got {block_size}, {batch_size}, {max_batches}"
        )
    last_start = len(data) - block_size - 1
    if last_start < 0:
        raise DataError(
            f"the held-out text has {len(data)} {token_unit(data)}s, fewer than the {block_size + 1} one eval sample "
            "needs; use more data or a smaller model"
        )
    num_samples = min(max_batches * batch_size, (len(data) - 1) // block_size)
    # integer spacing: exact for any corpus size, unlike a float linspace
    starts = torch.tensor([i * last_start // max(1, num_samples - 1) for i in range(num_samples)], dtype=torch.long)
    chunk = _token_range(data, 0, len(data)).rows(starts, block_size + 1)  # (num_samples, T+1)
    x, y = chunk[:, :-1], chunk[:, 1:]
    return [(xb.contiguous(), yb.contiguous()) for xb, yb in zip(x.split(batch_size), y.split(batch_size))]


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[Batch]) -> float:
    """The mean loss per sample over ``batches``, in eval mode; the model goes back to the mode it was in."""
    was_training = model.training
    model.eval()
    try:
        total, num_samples = None, 0
        for x, y in batches:
            _, loss = model(x, y)
            # summed on the device, one .item() at the end: each .item() is a CPU-GPU sync point
            weighted = loss.float() * x.shape[0]  # weighted by samples: the last batch can be smaller
            total = weighted if total is None else total + weighted
            num_samples += x.shape[0]
    finally:
        model.train(was_training)
    if total is None:
        raise ValueError("evaluate() got no batches")
    return total.item() / num_samples
