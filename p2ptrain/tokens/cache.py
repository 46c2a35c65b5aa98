"""The token cache: a corpus of any size tokenized once, a batch of documents at a time, into a flat file of token ids
(one fixed-width integer each) under a key that changes with the tokenizer and with any source file; peers on one host
share it, and a restart reuses it. ``TokenFile`` reads the rows of each batch from it, so neither step holds more than
a batch of the corpus in memory."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import tempfile
import weakref
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
from tqdm import tqdm

from p2ptrain.data import DataError
from p2ptrain.tokens.documents import Source, documents_of, resolve_sources
from p2ptrain.tokens.tokenizers import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_CACHE_DIR = "~/.cache/p2ptrain/tokens"
FORMAT_VERSION = 1
"""of the cache file and its key: bump it when either changes, so that old caches are not read as new ones"""
MIN_TOKENS = 2 * 1024
# a batch of documents goes through the tokenizer at once: large enough to keep it busy, small enough that the batch,
# its token ids and the tokenizer's per-token bookkeeping stay a few hundred MB at most
BATCH_DOCUMENTS = 1000
BATCH_CHARS = 4 << 20


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest little-endian unsigned integer that holds every id below ``vocab_size``."""
    for dtype in ("u1", "<u2", "<u4"):
        if vocab_size <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise DataError(f"a vocabulary of {vocab_size} tokens does not fit the token cache's 32-bit ids")


class _Descriptor:
    """A file opened read-only, closed when the last object holding it goes (a TokenFile and its views share one)."""

    def __init__(self, path: Path):
        self.fd = os.open(path, os.O_RDONLY)
        weakref.finalize(self, os.close, self.fd)


class TokenFile:
    """A read-only view of a token cache file: ``len()`` tokens, read a few rows at a time.

    Reads are ``os.pread`` calls into fresh buffers rather than a memory map: the pages a map touches count towards
    the process's resident memory, so training through a corpus larger than memory would look (to an OOM killer or
    a container's limit) as if it held all of it, while what pread leaves behind sits in the page cache, which the
    kernel reclaims at will. The file stays open while a view of it lives: if another peer on the host replaces the
    cache file meanwhile, this one goes on reading the (identical) file it opened.
    """

    def __init__(self, path: Union[str, Path], dtype: Union[str, np.dtype]):
        self.path = Path(path)
        self.dtype = np.dtype(dtype)
        self._file = _Descriptor(self.path)
        size = os.fstat(self._file.fd).st_size
        if size % self.dtype.itemsize:
            raise DataError(f"token cache {self.path}: {size} bytes is not a whole number of {self.dtype} tokens; "
                            "delete it to tokenize again")
        self._start, self._end = 0, size // self.dtype.itemsize

    def __len__(self) -> int:
        return self._end - self._start

    def view(self, start: int, end: int) -> TokenFile:
        """Tokens ``[start, end)`` of this view, sharing its open file."""
        if not 0 <= start <= end <= len(self):
            raise IndexError(f"view [{start}, {end}) outside a token file of {len(self)} tokens")
        view = copy.copy(self)
        view._start, view._end = self._start + start, self._start + end
        return view

    def _pread(self, start: int, n: int) -> np.ndarray:
        itemsize = self.dtype.itemsize
        data = os.pread(self._file.fd, n * itemsize, (self._start + start) * itemsize)
        if len(data) != n * itemsize:
            raise DataError(f"token cache {self.path} is shorter than when it was opened; delete it to tokenize again")
        return np.frombuffer(data, dtype=self.dtype)

    def _check(self, start: int, end: int) -> None:
        if start < 0 or end > len(self):
            raise IndexError(f"tokens [{start}, {end}) outside a token file of {len(self)} tokens")

    def read(self, start: int, n: int) -> torch.Tensor:
        """Tokens ``[start, start + n)``: (n,) int64."""
        self._check(start, start + n)
        return torch.from_numpy(self._pread(start, n).astype(np.int64))

    def rows(self, starts: torch.Tensor, length: int) -> torch.Tensor:
        """``length`` tokens from each of ``starts``: (len(starts), length) int64."""
        out = np.empty((len(starts), length), dtype=np.int64)
        if len(starts):
            self._check(int(starts.min()), int(starts.max()) + length)
        for row, start in enumerate(starts.tolist()):
            out[row] = self._pread(start, length)
        return torch.from_numpy(out)


def _identity(source: Source) -> list:
    """What the cache key knows of a source: a file's absolute path, size and modification time; a dataset's name."""
    if isinstance(source, str):
        return ["hf-dataset", source]
    stat = source.stat()
    return [str(source.resolve()), stat.st_size, stat.st_mtime_ns]


def _batched(documents: Iterable[str]) -> Iterator[list[str]]:
    batch, chars = [], 0
    for text in documents:
        batch.append(text)
        chars += len(text)
        if len(batch) >= BATCH_DOCUMENTS or chars >= BATCH_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _write_tokens(documents: Iterable[str], tokenizer: Tokenizer, out, progress) -> tuple[int, int]:
    """Writes each document's tokens to ``out``, the separator between two documents; (tokens, documents) written."""
    dtype = token_dtype(tokenizer.vocab_size)
    separator = np.array(tokenizer.separator, dtype=dtype)
    num_tokens = num_documents = 0
    for texts in _batched(documents):
        pieces = []
        for ids in tokenizer.encode_arrays(texts):
            if not len(ids):
                continue  # as load_corpus drops empty files: it would leave a double separator behind
            if num_documents:
                pieces.append(separator)
            pieces.append(ids)
            num_documents += 1
        progress.update(len(texts))
        if not pieces:
            continue
        chunk = np.concatenate(pieces)
        if chunk.max() >= tokenizer.vocab_size:
            raise DataError(f"--tokenizer {tokenizer.name} gave token id {chunk.max()}, not below its vocab_size "
                            f"{tokenizer.vocab_size}; use another tokenizer")
        out.write(chunk.astype(dtype, copy=False))
        num_tokens += len(chunk)
        progress.set_postfix(tokens=f"{num_tokens:,}", refresh=False)
    return num_tokens, num_documents


def _reuse(path: Path, sidecar: Path) -> Optional[TokenFile]:
    """The cache file at ``path`` if it is there and as long as its sidecar says."""
    try:
        meta = json.loads(sidecar.read_text())
        tokens = TokenFile(path, meta["dtype"])
    except (OSError, ValueError, KeyError, TypeError):  # not there, or not whole: tokenize again
        return None
    return tokens if len(tokens) == meta["num_tokens"] else None


def _write_atomically(path: Path, data: bytes) -> None:
    """``data`` in ``path``, whole or not at all: a temporary file beside it, fsync, rename."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with open(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def tokenize_to_cache(sources: Sequence[Union[str, Path]], tokenizer: Tokenizer, text_field: str,
                      cache_dir: Optional[str], *, show_progress: bool = False) -> TokenFile:
    """The tokens of ``sources`` (see ``iter_documents``), each document followed by ``tokenizer.separator`` but the
    last, in a cache file under ``cache_dir`` (default ~/.cache/p2ptrain/tokens), made now unless it is there already.

    The cache key covers the tokenizer's content, ``text_field``, and each source file's path, size and modification
    time (a Hugging Face dataset's name only: a new revision of it upstream is not noticed; clear the cache for it).
    Memory stays bounded whatever the corpus size: documents are streamed through the tokenizer a batch at a time.
    Raises DataError for data that cannot be read, and for fewer than ``MIN_TOKENS`` tokens in all.
    """
    resolved = resolve_sources(sources)
    identities = [_identity(source) for source in resolved]
    key = hashlib.blake2b(json.dumps([FORMAT_VERSION, tokenizer.digest, text_field, identities]).encode(),
                          digest_size=16).hexdigest()
    directory = Path(cache_dir or DEFAULT_CACHE_DIR).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"--data-cache {directory}: cannot create it ({e.strerror}); pass a writable folder") from None
    path, sidecar = directory / f"{key}.tokens", directory / f"{key}.json"
    named = "--data " + " ".join(map(str, sources))
    cached = _reuse(path, sidecar)
    if cached is not None:
        logger.info(f"{named}: reusing {len(cached):,} tokens ({tokenizer.name}) from {path}")
        return cached

    dtype = token_dtype(tokenizer.vocab_size)
    logger.info(f"{named}: tokenizing {len(resolved)} source(s) ({tokenizer.name}) into {directory}, once: later runs "
                "on the same data reuse it")
    # Written to a temporary file and renamed into place, its sidecar first: a data file under the key is whole and
    # has its sidecar. Peers on one host that tokenize the same sources at once each write their own temporary file;
    # the last rename wins, and either result is the same.
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".tmp")
    try:
        with open(fd, "wb") as out, \
                tqdm(desc=f"tokenizing ({tokenizer.name})", unit=" docs", disable=not show_progress) as progress:
            num_tokens, num_documents = _write_tokens(documents_of(resolved, text_field), tokenizer, out, progress)
            if num_tokens < MIN_TOKENS:
                raise DataError(f"{named}: only {num_tokens} tokens of text ({tokenizer.name}), fewer than the "
                                f"{MIN_TOKENS} needed to train; point --data at more text")
            out.flush()
            os.fsync(out.fileno())
        meta = {"format": FORMAT_VERSION, "dtype": dtype.str, "num_tokens": num_tokens, "documents": num_documents,
                "sources": identities, "tokenizer": tokenizer.name, "text_field": text_field}
        _write_atomically(sidecar, json.dumps(meta, indent=1).encode())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    logger.info(f"{named}: {num_documents:,} documents, {num_tokens:,} tokens ({tokenizer.name}) cached in {path}")
    return TokenFile(path, dtype)
