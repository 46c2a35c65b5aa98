"""Document readers: the text of every document of --data, streamed in a deterministic order, from .txt, .jsonl,
.parquet and .arrow files, folders of them, and Hugging Face datasets (owner/name). Each bad source or record is a
DataError, one line with the fix, as soon as the reader comes to it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator, Sequence, Union

from p2ptrain.config_checks import DATA_SUFFIXES, is_hub_dataset
from p2ptrain.data import DataError
from p2ptrain.tokens.hf_extra import first_line, require_package

SUFFIXES = DATA_SUFFIXES
ROWS_PER_READ = 1024  # rows of a Parquet or Arrow file turned into Python strings at a time
Source = Union[Path, str]
"""a file to read (a Path), or the name of a Hugging Face dataset (a str)"""


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
    pa = require_package("pyarrow", f"--data {path}")
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
    pa, pq = require_package("pyarrow", f"--data {path}"), require_package("pyarrow.parquet", f"--data {path}")
    try:
        parquet = pq.ParquetFile(path)
    except pa.ArrowException as e:
        raise DataError(f"--data {path}: not a Parquet file ({first_line(e)}); check the file") from None
    _check_text_column(path, parquet.schema_arrow, text_field)
    yield from _column_documents(path, parquet.iter_batches(columns=[text_field], batch_size=ROWS_PER_READ),
                                 text_field)


def _arrow_documents(path: Path, text_field: str) -> Iterator[str]:
    """An Arrow IPC stream (what Hugging Face ``datasets`` writes) or file. Read through plain file reads rather than a
    memory map: the mapped pages a pass touches would count towards the process's resident memory."""
    pa = require_package("pyarrow", f"--data {path}")
    with pa.OSFile(str(path)) as source:
        try:
            reader = pa.ipc.open_stream(source)
            batches: Iterable = reader
        except pa.ArrowInvalid:
            source.seek(0)
            try:
                reader = pa.ipc.open_file(source)
            except pa.ArrowInvalid as e:
                raise DataError(f"--data {path}: not an Arrow IPC stream or file ({first_line(e)}); check the "
                                "file") from None
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        _check_text_column(path, reader.schema, text_field)
        yield from _column_documents(path, batches, text_field)


def _hub_documents(name: str, text_field: str) -> Iterator[str]:
    datasets = require_package("datasets", f"--data {name}")
    try:
        dataset = datasets.load_dataset(name, split="train", streaming=True)
    except ConnectionError:
        raise DataError(f"--data {name}: not a file or folder here, and the Hugging Face hub cannot be reached to "
                        "stream it as a dataset (offline, or HF_HUB_OFFLINE is set); pass local files") from None
    except (OSError, ValueError) as e:
        raise DataError(f"--data {name}: not a file or folder here, and no dataset on the Hugging Face hub "
                        f"({first_line(e)}); pass local files or a dataset name (owner/name)") from None
    for number, record in enumerate(dataset, 1):
        yield _text_of(record, text_field, f"--data {name}: record {number}")


def documents_of(sources: list[Source], text_field: str) -> Iterator[str]:
    """The documents of ``sources`` as ``resolve_sources`` gives them, in order (see ``iter_documents``)."""
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
    return documents_of(resolve_sources(sources), text_field)
