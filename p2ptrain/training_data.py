"""A worker's training and held-out data for its model: text files as raw bytes (the built-in byte-level models),
or anything else tokenized into a cached token file (``tokens/cache.py``).

Bytes stay the fast path they were: .txt files (or folders of them, or the built-in corpus) with the byte
"tokenizer" are read into memory as before, and their shards, cursors and held-out split are unchanged. Any other
source (.jsonl, .parquet, .arrow, a Hugging Face dataset) or any real tokenizer goes through the token cache, read
from disk a batch at a time, so a corpus larger than memory trains in bounded memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Union

from p2ptrain.config import TrainConfig
from p2ptrain.data import DataError, builtin_corpus_paths, load_corpus, split_train_val
from p2ptrain.model_source import ModelSpec
from p2ptrain.tokens import BYTES, SUFFIXES, TokenFile, load_tokenizer, tokenize_to_cache

RECORD_SUFFIXES = tuple(suffix for suffix in SUFFIXES if suffix != ".txt")


@dataclass
class TrainingData:
    train: Union[bytes, TokenFile]
    held_out: Union[bytes, TokenFile]
    tokenizer: str
    """the tokenizer's name: "bytes", or the folder or hub id it was loaded from"""


def tokenizer_name(train: TrainConfig, spec: ModelSpec) -> str:
    """--tokenizer, else the model's own, else bytes."""
    return train.tokenizer or spec.default_tokenizer or BYTES


def _plain_text(sources: list) -> bool:
    """Every source is a .txt file, or a folder without record files: the byte path reads them as it always did."""
    for source in sources:
        path = Path(source).expanduser()
        if path.is_file() and path.suffix != ".txt":
            return False
        if path.is_dir() and any(p.suffix in RECORD_SUFFIXES for p in path.rglob("*") if p.is_file()):
            return False
        if not path.exists():
            return False  # a Hugging Face dataset name
    return True


def load_training_data(train: TrainConfig, spec: ModelSpec, *, show_progress: bool = False,
                       val_fraction: float = 0.1) -> TrainingData:
    """The data ``train`` names, tokenized for ``spec``'s model, split into training and held-out parts. Raises
    DataError (one line, with the fix) for data or a tokenizer that cannot be used with this model."""
    name = tokenizer_name(train, spec)
    tokenizer = load_tokenizer(name)  # bytes: ByteTokenizer, 256 ids, no Hugging Face import
    if tokenizer.vocab_size > spec.vocab_size:
        raise DataError(f"--tokenizer {name} has {tokenizer.vocab_size} tokens, more than the {spec.vocab_size} rows "
                        f"of --model {spec.source}'s embedding; use the model's own tokenizer or a model with "
                        f"vocab_size >= {tokenizer.vocab_size}")
    if name == BYTES and _plain_text(train.data):
        return TrainingData(*split_train_val(load_corpus(train.data or None), val_fraction), tokenizer=BYTES)
    sources = list(train.data) or [str(p) for p in builtin_corpus_paths()]
    tokens = tokenize_to_cache(sources, tokenizer, train.text_field, train.data_cache, show_progress=show_progress)
    return TrainingData(*split_train_val(tokens, val_fraction), tokenizer=name)

