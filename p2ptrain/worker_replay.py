"""The replay check in a ``join`` worker (``diloco.replay_rate``): the ``Replayer`` that redoes another sender's
phase the way this worker trains its own (``diloco/replay.py`` tells the check).

A claim is the data iterator's state (shard, epoch, position, seed, layout) before the batch of a phase's first inner
step: the trainer iterates ``track(batches)``, which notes it before each batch. A replay
loads it into an iterator of its own over the same tokens and trains a replica of the model (built from the same
spec) with ``train_step``: the same micro-batches, precision and gradient clipping as the trainer. What it cannot
replay it says so (``NotReplayable``: the sender is then not judged): a phase that runs past the end of an epoch of
a peer that moves between shards (the next shard is chosen then, through the DHT). A position this worker's data
cannot hold is the sender's fault: its claim names no data of the run.
"""

from __future__ import annotations

from typing import Iterator, Tuple

import torch

from p2ptrain.data import ShardedBatches
from p2ptrain.diloco.replay import NotReplayable
from p2ptrain.train_loop import train_step


_CROSSED = "the phase ran past the end of its shard's epoch, where the sender chose its next shard"


class WorkerReplayer:
    """``diloco.replay.Replayer`` of a one-process worker training ``batches`` (its iterator: the claims are its
    state) with ``cfg`` (``TrainConfig``); ``replica``: a model of the same spec, on ``device``."""

    def __init__(self, batches: ShardedBatches, replica: torch.nn.Module, cfg, device: torch.device,
                 pinned: bool) -> None:
        self.batches, self.replica, self.cfg, self.device, self.pinned = batches, replica, cfg, device, pinned
        self._reader = batches.reader()
        self._micro_batches = min(cfg.batch_size // (cfg.micro_batch_size or cfg.batch_size), cfg.batch_size)
        self._crossed = False
        self._last = batches.state_dict()

    def track(self, batches: ShardedBatches) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        """``batches``' batches, each one's position noted first (the trainer iterates this)."""
        while True:
            self._last = batches.state_dict()
            yield next(batches)

    def claim(self) -> dict:
        return self._last

    def parameters(self):
        return list(self.replica.parameters())

    def step(self, claim: dict, step: int, optimizer) -> None:
        if step == 0:
            try:
                self._reader.load_state_dict(claim)
            except (KeyError, TypeError) as e:  # a position of another data layout: a ValueError, and the sender's
                raise ValueError(f"a data position this worker cannot read ({e!r})") from None
        elif self._crossed:
            raise NotReplayable(_CROSSED)
        epoch = self._reader.epoch
        x, y = next(self._reader)
        # a sender that moves between shards chose its next one at the epoch's end: the rows after it are unknown
        self._crossed = self._reader.epoch != epoch and not self.pinned
        if self._crossed and self._reader.position:
            raise NotReplayable(_CROSSED)
        self.replica.train()
        train_step(self.replica, optimizer, x.to(self.device), y.to(self.device), micro_batches=self._micro_batches,
                   scaler=None, grad_clip=self.cfg.grad_clip, device=self.device, precision=self.cfg.precision,
                   batch_size=self.cfg.batch_size)
