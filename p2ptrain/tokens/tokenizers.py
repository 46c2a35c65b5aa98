"""Tokenizers: text to token ids, and the ids written between two documents. Bytes (the built-in models' own), or a
Hugging Face fast tokenizer (a folder or a hub id), loaded only when one is named."""

from __future__ import annotations

import abc
import hashlib
import json
import logging
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np

from p2ptrain.data import FILE_SEPARATOR, DataError
from p2ptrain.tokens.hf_extra import first_line, require_package

logger = logging.getLogger(__name__)

BYTES = "bytes"


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


def load_tokenizer(name: Optional[str]) -> Tokenizer:
    """The tokenizer ``name`` names: None or "bytes" for bytes, else a local folder or a Hugging Face hub id.

    Raises DataError (one line, with the fix) if it cannot be loaded, or if transformers is not installed.
    """
    if name is None or name == BYTES:
        return ByteTokenizer()
    transformers = require_package("transformers", f"--tokenizer {name}")
    hub_errors = require_package("huggingface_hub.errors", f"--tokenizer {name}")
    folder = Path(name).expanduser()
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder) if folder.is_dir() else name)
    except (OSError, ValueError) as e:
        if folder.is_dir():
            fix = "pass a folder saved with save_pretrained() that holds a tokenizer.json"
            raise DataError(f"--tokenizer {name}: cannot load a tokenizer from this folder ({first_line(e)}); "
                            f"{fix}") from None
        offline = (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled, ConnectionError)
        if any(isinstance(cause, offline) for cause in _causes(e)):
            raise DataError(f"--tokenizer {name}: not a folder here and the Hugging Face hub cannot be reached to "
                            "fetch it (offline, or HF_HUB_OFFLINE is set); pass a local tokenizer folder") from None
        raise DataError(f"--tokenizer {name}: not a folder here nor a tokenizer on the Hugging Face hub "
                        f"({first_line(e)}); pass a local tokenizer folder or a hub id such as "
                        "openai-community/gpt2") from None
    if not getattr(tokenizer, "is_fast", False):
        raise DataError(f"--tokenizer {name}: has no fast (Rust) tokenizer, which tokenizing a large corpus needs; "
                        "pass a tokenizer that has a tokenizer.json")
    return HFTokenizer(name, tokenizer)
