"""Models for ``--model tests.models.factories:NAME``: the factory contract of docs/MODELS.md, and ways to break it."""

from __future__ import annotations

import torch
import torch.nn as nn

VOCAB, SEQ_LEN, WIDTH = 256, 32, 48


class TinyRecurrentLM(nn.Module):
    """A model that is not a transformer at all: embedding, a GRU, a head. What matters is the contract:
    ``vocab_size``, ``max_seq_len`` and ``forward(input_ids) -> logits``."""

    def __init__(self):
        super().__init__()
        self.vocab_size, self.max_seq_len = VOCAB, SEQ_LEN
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList([nn.GRU(WIDTH, WIDTH, batch_first=True) for _ in range(2)])
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = x + layer(x)[0]
        return self.head(x)


def tiny_recurrent_lm() -> nn.Module:
    return TinyRecurrentLM()


def not_a_module():
    return {"weights": torch.zeros(3)}


def without_vocab_size() -> nn.Module:
    return nn.Linear(4, 4)
