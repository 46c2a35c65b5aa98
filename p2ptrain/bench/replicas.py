"""The K replicas of the one-process experiments (bench/convergence*.py): their setup, data and inner steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from p2ptrain.config import DiLoCoConfig
from p2ptrain.data import ShardedBatches, eval_batches, load_corpus, split_train_val
from p2ptrain.model import build_model


@dataclass(frozen=True)
class Setup:
    model: str = "tiny"
    peers: int = 4
    batch_size: int = 16
    steps: int = 600
    seed: int = 0
    eval_batches: int = 8  # held-out batches; the swarm's workers are given the same


def inner_optimizer(params, cfg: DiLoCoConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.inner_lr, weight_decay=cfg.inner_weight_decay,
                             betas=tuple(cfg.inner_betas))


def replica_data(setup: Setup):
    train, val = split_train_val(load_corpus(None))
    block = build_model(setup.model).config.block_size
    shards = [ShardedBatches(train, block_size=block, batch_size=setup.batch_size, shard_index=i,
                             num_shards=setup.peers, seed=setup.seed) for i in range(setup.peers)]
    return shards, eval_batches(val, block, setup.batch_size, setup.eval_batches)


def inner_step(models, inners, shards) -> None:
    """One inner step of every replica, each on the next batch of its own shard."""
    for model, inner, shard in zip(models, inners, shards):
        x, y = next(shard)
        model(x, y)[1].backward()
        inner.step()
        inner.zero_grad()
