"""The built-in model's shapes by name, without torch: the config checks a --model name at start-up, before any
heavy import (a wrong flag is reported in a fraction of a second)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class GPTConfig:
    """The shape of a GPT."""

    block_size: int
    """the longest sequence the model sees (positions in the position embedding)"""
    vocab_size: int = 256
    """256: one token per byte"""
    n_layer: int = 2
    """transformer blocks"""
    n_head: int = 4
    """attention heads per block; must divide n_embd"""
    n_embd: int = 128
    """width of the residual stream"""
    dropout: float = 0.0
    """dropout probability in training; 0.0 builds no dropout at all"""
    bias: bool = True
    """biases in the linear layers and LayerNorms (GPT-2 has them)"""

    def __post_init__(self) -> None:
        for name in ("block_size", "vocab_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be at least 1, got {getattr(self, name)}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd ({self.n_embd}) must be a multiple of n_head ({self.n_head})")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


MODEL_SIZES: dict[str, GPTConfig] = {
    # ~0.44M parameters: a few steps per second on 2 CPU cores, for demos and tests
    "tiny": GPTConfig(block_size=64, n_layer=2, n_head=4, n_embd=128),
    # ~25.5M parameters: a laptop or a small GPU
    "small": GPTConfig(block_size=256, n_layer=8, n_head=8, n_embd=512),
    # ~121.5M parameters, GPT-2 width for GPU peers. A 256-byte vocabulary has 38M fewer embedding parameters than
    # GPT-2's 50257 tokens, so 17 blocks instead of 12 bring the count back near 124M.
    "124m": GPTConfig(block_size=1024, n_layer=17, n_head=12, n_embd=768),
}


def model_config(size: str) -> GPTConfig:
    """The config of a named size; a ValueError that lists the valid names for any other."""
    if size not in MODEL_SIZES:
        raise ValueError(f"unknown model size {size!r}; use one of: {', '.join(MODEL_SIZES)}")
    return MODEL_SIZES[size]
