"""Hugging Face models, tokenizers and data made on the spot (no hub here): a tiny Llama-style config, a BPE
tokenizer trained on the test's own text, jsonl documents."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="the Hugging Face extra: pip install 'p2ptrain[hf]'")

WORDS = ("river stone bread market violin harbor lamp garden clock ferry cloud letter window mountain sailor "
         "baker sister village train morning evening quiet bright cold warm small large old new").split()


def documents(count: int, seed: int = 0) -> list:
    """``count`` short documents of a small, repetitive language (so a tiny model learns it in a few steps)."""
    rng = random.Random(seed)
    return [" ".join(f"the {rng.choice(WORDS)} and the {rng.choice(WORDS)}." for _ in range(rng.randint(3, 8)))
            for _ in range(count)]


def write_jsonl(path: Path, docs: list, field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def train_tokenizer(folder: Path, texts: list, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer trained on ``texts``, saved as a transformers tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)
    return folder


def make_llama(folder: Path, vocab_size: int = 320, layers: int = 2, hidden: int = 64, context: int = 128,
               tokenizer_texts: list | None = None) -> Path:
    """A fresh tiny Llama config (no weights) in ``folder``, with a tokenizer beside it if texts are given."""
    from transformers import LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=context,
                tie_word_embeddings=False).save_pretrained(folder)
    if tokenizer_texts is not None:
        train_tokenizer(folder, tokenizer_texts, vocab_size=min(vocab_size, 300))
    return folder
