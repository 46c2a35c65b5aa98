"""Tokenized training data: a tokenizer, documents streamed from files or a Hugging Face dataset, and a token cache.

A corpus of any size is tokenized once, a batch of documents at a time, into a flat file of token ids (one fixed-width
integer each) under a key that changes with the tokenizer and with any source file; peers on one host share it, and a
restart reuses it. Training then reads the rows of each batch from that file (``TokenFile``), so neither step holds
more than a batch of the corpus in memory.

Every peer of a run must tokenize the same sources with the same tokenizer: the shards and the held-out split are
token ranges of the cache, as they are byte ranges of the corpus in ``data.py``.

transformers, tokenizers, pyarrow and datasets (the ``hf`` extra) are imported only when a source or a tokenizer
needs them, so the byte-level path works without them.
"""

from __future__ import annotations

import abc
import copy
import hashlib
import importlib
import json
import logging
import os
import re
import tempfile
import weakref
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence, Union

import numpy as np
import torch
from tqdm import tqdm

from p2ptrain.config import DATA_SUFFIXES, is_hub_dataset
from p2ptrain.data import FILE_SEPARATOR, DataError

logger = logging.getLogger(__name__)

BYTES = "bytes"
SUFFIXES = DATA_SUFFIXES
HF_EXTRA = "pip install 'p2ptrain[hf]'"
DEFAULT_CACHE_DIR = "~/.cache/p2ptrain/tokens"
FORMAT_VERSION = 1
"""of the cache file and its key: bump it when either changes, so that old caches are not read as new ones"""
MIN_TOKENS = 2 * 1024
# a batch of documents goes through the tokenizer at once: large enough to keep it busy, small enough that the batch,
# its token ids and the tokenizer's per-token bookkeeping stay a few hundred MB at most
BATCH_DOCUMENTS = 1000
BATCH_CHARS = 4 << 20
ROWS_PER_READ = 1024  # rows of a Parquet or Arrow file turned into Python strings at a time
# "owner/name" (a Hugging Face dataset), as opposed to a path that does not exist
Source = Union[Path, str]
"""a file to read (a Path), or the name of a Hugging Face dataset (a str)"""


def _require(module: str, needed_for: str):
    """``module``, imported now; DataError naming the pip command if the ``hf`` extra is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{needed_for} needs the {module.split('.')[0]} package, which is not installed; "
                        f"{HF_EXTRA}") from None


# --- tokenizers ----------------------------------------------------------------------------------------------------


class Tokenizer(abc.ABC):
    """Text to token ids, and the ids that separate two documents in the token stream."""

    name: str
    """what the user passed: "bytes", a folder or a hub id"""
    vocab_size: int
    """every id is below it: the model's embedding needs at least this many rows"""
    separator: list[int]
    """written between two documents, so that the model sees where one ends"""
    digest: str
    """identifies the tokenizer by content (not by name), for cache keys: same digest, same tokens"""

    @abc.abstractmethod
    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        """The ids of each text as a 1-D integer array, no special tokens added: what the cache writer uses, as it
        needs no Python int per token."""

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """The ids of each text, no special tokens added."""
        return [ids.tolist() for ids in self.encode_arrays(texts)]

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``."""


class ByteTokenizer(Tokenizer):
    """The UTF-8 bytes of the text, as the built-in byte-level models read it; documents are separated by a blank line,
    as ``load_corpus`` separates files, so .txt files give the same tokens on both paths."""

    name = BYTES
    vocab_size = 256
    separator = list(FILE_SEPARATOR)
    digest = BYTES

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        # "replace": a lone surrogate (JSON allows "\ud800") has no UTF-8 bytes
        return [np.frombuffer(text.encode("utf-8", errors="replace"), dtype=np.uint8) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer(Tokenizer):
    """A Hugging Face fast tokenizer (``transformers.AutoTokenizer``): a folder saved with ``save_pretrained``, or a
    hub id. Documents are separated by its end-of-text token (or, without one, its separator token)."""

    def __init__(self, name: str, tokenizer):
        self.name = name
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend_tokenizer
        # the Rust tokenizer as saved may truncate or pad (transformers turns that off per call): documents are whole
        self._backend.no_truncation()
        self._backend.no_padding()
        self.vocab_size = len(tokenizer)  # with the added tokens
        if tokenizer.eos_token_id is not None:
            self.separator = [tokenizer.eos_token_id]
        elif tokenizer.sep_token_id is not None:
            self.separator = [tokenizer.sep_token_id]
        else:
            self.separator = []
            logger.warning(f"--tokenizer {name} has no end-of-text or separator token: documents follow one another "
                           "in the token stream with nothing between them")
        content = self._backend.to_str() + json.dumps(self.separator)
        self.digest = hashlib.blake2b(content.encode(), digest_size=16).hexdigest()

    def encode_arrays(self, texts: list[str]) -> list[np.ndarray]:
        encodings = self._backend.encode_batch(texts, add_special_tokens=False)
        return [np.array(encoding.ids, dtype=np.int64) for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids))

    def save(self, folder: str | Path) -> None:
        """Write it into ``folder`` as ``save_pretrained`` does, so ``AutoTokenizer.from_pretrained(folder)`` loads it
        (export puts it beside the model)."""
        self._tokenizer.save_pretrained(str(folder))


def _causes(error: BaseException) -> Iterator[BaseException]:
    """``error`` and the exceptions it was raised from or while handling."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def load_tokenizer(name: Optional[str]) -> Tokenizer:
    """The tokenizer ``name`` names: None or "bytes" for bytes, else a local folder or a Hugging Face hub id.

    Raises DataError (one line, with the fix) if it cannot be loaded, or if transformers is not installed.
    """
    if name is None or name == BYTES:
        return ByteTokenizer()
    transformers = _require("transformers", f"--tokenizer {name}")
    hub_errors = _require("huggingface_hub.errors", f"--tokenizer {name}")
    folder = Path(name).expanduser()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder) if folder.is_dir() else name)
    except (OSError, ValueError) as e:
        if folder.is_dir():
            fix = "pass a folder saved with save_pretrained() that holds a tokenizer.json"
            raise DataError(f"--tokenizer {name}: cannot load a tokenizer from this folder ({_first_line(e)}); "
                            f"{fix}") from None
        offline = (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, ConnectionError)
        if any(isinstance(cause, offline) for cause in _causes(e)):
            raise DataError(f"--tokenizer {name}: not a folder here and the Hugging Face hub cannot be reached to "
                            "fetch it (offline, or HF_HUB_OFFLINE is set); pass a local tokenizer folder") from None
        raise DataError(f"--tokenizer {name}: not a folder here nor a tokenizer on the Hugging Face hub "
                        f"({_first_line(e)}); pass a local tokenizer folder or a hub id such as "
                        "openai-community/gpt2") from None
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"--tokenizer {name}: has no fast (Rust) tokenizer, which tokenizing a large corpus needs; "
                        "pass a tokenizer that has a tokenizer.json")
    return HFTokenizer(name, tokenizer)


# --- documents -----------------------------------------------------------------------------------------------------


def _accepted() -> str:
    return ", ".join(SUFFIXES[:-1]) + " or " + SUFFIXES[-1]


def resolve_sources(sources: Sequence[Union[str, Path]]) -> list[Source]:
    """The files (sorted, at any depth, for a folder) and Hugging Face datasets that ``sources`` name, in order.

    Raises DataError for a path that is neither here nor a dataset name, a file of an unknown type, or a folder
    without data files.
    """
    resolved: list[Source] = []
    for source in sources:
        path = Path(source).expanduser()
        if path.is_file():
            if path.suffix not in SUFFIXES:
                raise DataError(f"--data {source}: unknown file type {path.suffix or '(none)'!r}; use {_accepted()} "
                                "files, or a folder of them")
            resolved.append(path)
        elif path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.suffix in SUFFIXES and p.is_file())
            if not files:
                raise DataError(f"--data {source}: no {_accepted()} files found in this folder; point --data at one")
            resolved.extend(files)
        elif is_hub_dataset(str(source)):
            resolved.append(str(source))
        else:
            raise DataError(f"--data {source}: no such file or folder; point --data at {_accepted()} files, a folder "
                            "of them, or a Hugging Face dataset name (owner/name)")
    return resolved


def _text_of(record, text_field: str, where: str) -> str:
    """The text of one record (a dict); ``where`` names it in errors ("--data x.jsonl: line 3")."""
    if not isinstance(record, dict):
        raise DataError(f"{where} is a JSON {type(record).__name__}, not an object; write one JSON object per line")
    if text_field not in record:
        raise DataError(f"{where} has no field {text_field!r} (its fields: {', '.join(map(str, record)) or 'none'}); "
                        "pass --text-field NAME")
    text = record[text_field]
    if not isinstance(text, str):
        raise DataError(f"{where} has a {type(text).__name__} in field {text_field!r}, not a string; pass "
                        "--text-field naming a text field")
    return text


def _txt_documents(path: Path) -> Iterator[str]:
    """The whole file, one document (so memory bounds the size of one .txt file: split a larger one, or use .jsonl)."""
    try:
        yield path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"--data {path}: not UTF-8 text (byte {e.start}); convert it to UTF-8") from None


def _jsonl_documents(path: Path, text_field: str) -> Iterator[str]:
    with open(path, "rb") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:  # also bad UTF-8
                raise DataError(f"--data {path}: line {number} is not valid JSON ({e}); write one JSON object per "
                                "line") from None
            yield _text_of(record, text_field, f"--data {path}: line {number}")


def _check_text_column(path: Path, schema, text_field: str) -> None:
    """A DataError, before the first record is read, if a Parquet or Arrow file has no text column ``text_field``."""
    pa = _require("pyarrow", f"--data {path}")
    if text_field not in schema.names:
        raise DataError(f"--data {path}: record 1 has no field {text_field!r} (its fields: {', '.join(schema.names)}); "
                        "pass --text-field NAME")
    kind = schema.field(text_field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise DataError(f"--data {path}: field {text_field!r} holds {kind}, not text; pass --text-field naming a text "
                        "field")


def _column_documents(path: Path, batches: Iterable, text_field: str) -> Iterator[str]:
    """The ``text_field`` column of Arrow record batches, ``ROWS_PER_READ`` Python strings at a time."""
    record = 0
    for batch in batches:
        column = batch.column(batch.schema.get_field_index(text_field))
        for offset in range(0, len(column), ROWS_PER_READ):
            rows = column.slice(offset, ROWS_PER_READ)
            texts = rows.to_pylist()
            if rows.null_count:
                raise DataError(f"--data {path}: record {record + texts.index(None) + 1} has no value (null) in field "
                                f"{text_field!r}; fill it or leave the record out")
            record += len(texts)
            yield from texts


def _parquet_documents(path: Path, text_field: str) -> Iterator[str]:
    pa, pq = _require("pyarrow", f"--data {path}"), _require("pyarrow.parquet", f"--data {path}")
    try:
        parquet = pq.ParquetFile(path)
    except pa.ArrowException as e:
        raise DataError(f"--data {path}: not a Parquet file ({_first_line(e)}); check the file") from None
    _check_text_column(path, parquet.schema_arrow, text_field)
    yield from _column_documents(path, parquet.iter_batches(columns=[text_field], batch_size=ROWS_PER_READ),
                                 text_field)


def _arrow_documents(path: Path, text_field: str) -> Iterator[str]:
    """An Arrow IPC stream (what Hugging Face ``datasets`` writes) or file. Read through plain file reads rather than a
    memory map: the mapped pages a pass touches would count towards the process's resident memory."""
    pa = _require("pyarrow", f"--data {path}")
    with pa.OSFile(str(path)) as source:
        try:
            reader = pa.ipc.open_stream(source)
            batches: Iterable = reader
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                reader = pa.ipc.open_file(source)
            except pa.ArrowInvalid as e:
                raise DataError(f"--data {path}: not an Arrow IPC stream or file ({_first_line(e)}); check the "
                                "file") from None
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        _check_text_column(path, reader.schema, text_field)
        yield from _column_documents(path, batches, text_field)


def _hub_documents(name: str, text_field: str) -> Iterator[str]:
    datasets = _require("datasets", f"--data {name}")
    try:
        dataset = datasets.load_dataset(name, split="train", streaming=True)
    except ConnectionError:
        raise DataError(f"--data {name}: not a file or folder here, and the Hugging Face hub cannot be reached to "
                        "stream it as a dataset (offline, or HF_HUB_OFFLINE is set); pass local files") from None
    except (OSError, ValueError) as e:
        raise DataError(f"--data {name}: not a file or folder here, and no dataset on the Hugging Face hub "
                        f"({_first_line(e)}); pass local files or a dataset name (owner/name)") from None
    for number, record in enumerate(dataset, 1):
        yield _text_of(record, text_field, f"--data {name}: record {number}")


def _documents(sources: list[Source], text_field: str) -> Iterator[str]:
    for source in sources:
        if isinstance(source, str):
            yield from _hub_documents(source, text_field)
        elif source.suffix == ".txt":
            yield from _txt_documents(source)
        elif source.suffix == ".jsonl":
            yield from _jsonl_documents(source, text_field)
        elif source.suffix == ".parquet":
            yield from _parquet_documents(source, text_field)
        else:
            yield from _arrow_documents(source, text_field)


def iter_documents(sources: Sequence[Union[str, Path]], text_field: str) -> Iterator[str]:
    """The text of every document of ``sources``, streamed, in a deterministic order: the sources in the given order,
    a folder's files sorted by path, each file's records in file order.

    A .txt file is one document; a .jsonl line, or a row of a .parquet or .arrow file or of a Hugging Face dataset
    (``owner/name``, its "train" split, streamed) is one document, its field ``text_field``. Raises DataError, one line
    with the fix, for a source or record that cannot be read as such, as soon as it comes to it.
    """
    return _documents(resolve_sources(sources), text_field)


# --- the token cache -----------------------------------------------------------------------------------------------


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
            num_tokens, num_documents = _write_tokens(_documents(resolved, text_field), tokenizer, out, progress)
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
