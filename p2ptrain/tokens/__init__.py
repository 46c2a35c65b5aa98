"""Tokenized training data: a tokenizer, documents streamed from files or a Hugging Face dataset, and a token cache.

A corpus of any size is tokenized once, a batch of documents at a time, into a flat file of token ids (one fixed-width
integer each) under a key that changes with the tokenizer and with any source file; peers on one host share it, and a
restart reuses it. Training then reads the rows of each batch from that file (``TokenFile``), so neither step holds
more than a batch of the corpus in memory.

Every peer of a run must tokenize the same sources with the same tokenizer: the shards and the held-out split are
token ranges of the cache, as they are byte ranges of the corpus in ``data.py``.

transformers, tokenizers, pyarrow and datasets (the ``hf`` extra) are imported only when a source or a tokenizer
needs them, so the byte-level path works without them.

The parts: tokenizers.py (bytes or a Hugging Face fast tokenizer), documents.py (the readers of each source format),
cache.py (tokenize_to_cache and TokenFile), hf_extra.py (the optional packages' imports); their names are here too.
"""

from p2ptrain.tokens.cache import (
    BATCH_CHARS,
    BATCH_DOCUMENTS,
    DEFAULT_CACHE_DIR,
    FORMAT_VERSION,
    MIN_TOKENS,
    TokenFile,
    token_dtype,
    tokenize_to_cache,
)
from p2ptrain.tokens.documents import ROWS_PER_READ, SUFFIXES, Source, iter_documents, resolve_sources
from p2ptrain.tokens.hf_extra import HF_EXTRA
from p2ptrain.tokens.tokenizers import BYTES, ByteTokenizer, HFTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "BATCH_CHARS", "BATCH_DOCUMENTS", "BYTES", "DEFAULT_CACHE_DIR", "FORMAT_VERSION", "HF_EXTRA", "MIN_TOKENS",
    "ROWS_PER_READ", "SUFFIXES", "ByteTokenizer", "HFTokenizer", "Source", "TokenFile", "Tokenizer", "iter_documents",
    "load_tokenizer", "resolve_sources", "token_dtype", "tokenize_to_cache",
]
