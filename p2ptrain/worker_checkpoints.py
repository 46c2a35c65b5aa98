"""A worker's checkpoints: the state of a checkpoint restored at start (``--resume``), and ``<run_id>.pt`` written every
``checkpoint_every`` outer steps and at exit. Its context is explicit: the config, this peer's ranks (which read and
write either kind of checkpoint, one process's or a sharded peer's) and the report (peer id, step counters)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Optional

import torch

from p2ptrain.config import RunConfig
from p2ptrain.data import ShardedBatches
from p2ptrain.worker_report import WorkerReport

if TYPE_CHECKING:
    from p2ptrain.ranks import PeerRanks

logger = logging.getLogger(__name__)


class WorkerCheckpoints:
    """Restores and writes a worker's checkpoints through its ranks."""

    def __init__(self, config: RunConfig, ranks: PeerRanks, report: WorkerReport):
        self.config = config
        self.ranks = ranks
        self.report = report
        self.parts: Optional[tuple] = None
        """(model, batches, model spec, tokenizer) once training can begin: a checkpoint is written only then"""

    def restore(self, state: dict, model: torch.nn.Module, batches: ShardedBatches) -> None:
        """Take the model, optimizer and data position of a checkpoint read at start (``resume_state``)."""
        opt = self.ranks.optimizer
        self.ranks.restore(model, state, self.config.train.checkpoint_dir, self.config.run_id)
        batches.load_state_dict(state["data"])
        batches.left_shards = dict(state.get("left_shards", {}))
        self.report.outer_steps = opt.outer_step
        self.report.local_steps = opt.local_step
        logger.info(
            f"[{self.report.peer_id}] resumed from the checkpoint at outer step {opt.outer_step}, "
            f"local step {opt.local_step}"
        )

    def save(self, why: str) -> None:
        """Write ``<run_id>.pt`` into --checkpoint-dir, once training can begin (``parts`` set); ``why`` goes in the
        log line. A write that fails is logged, not raised."""
        directory = self.config.train.checkpoint_dir
        if not directory or self.parts is None:
            return
        model, batches, spec, tokenizer = self.parts
        meta = {
            "run_id": self.config.run_id,
            "model": spec.identity,
            # what export and generate need to rebuild the model without the run's config
            "model_source": spec.source,
            "hf_config": spec.hf_config,
            "seq_len": spec.seq_len,
            "tokenizer": tokenizer,
            "num_shards": self.config.train.num_shards,
            "shard_index": batches.shard_index,
            "data": batches.state_dict(),
            # data shards left since the last committed round: their cursors are published after the next one
            "left_shards": dict(batches.left_shards),
        }
        try:
            path = self.ranks.save_checkpoint(model, directory, self.config.run_id, meta)
            logger.info(f"[{self.report.peer_id}] checkpoint written to {path} ({why})")
        except OSError as e:  # a full disk must not kill training: the previous checkpoint stays valid
            place = self.ranks.checkpoint_location(directory, self.config.run_id)
            logger.error(f"[{self.report.peer_id}] could not write the checkpoint {place}: {e}")
