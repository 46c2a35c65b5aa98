"""This peer's ranks: one process, or several (torchrun) that shard the model over an HSDP mesh.

Both kinds are one ``PeerRanks``: the worker makes the same calls on every rank, in the same order, and never asks
which kind it has. What differs lives here: where the swarm's ``DiLoCoOptimizer`` is (the process's own, or the
leader's over a full proxy of the model, ``hsdp.ShardedDiLoCo``), how the leader's choices reach the other ranks,
how the peer takes the swarm's state, and which kind of checkpoint it writes and how it reads either kind.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
import torch.distributed as dist

from p2ptrain.checkpoint import (checkpoint_path, latest_sharded_or_raise, load_checkpoint, save_checkpoint,
                                 sharded_checkpoint_dir)
from p2ptrain.config import ConfigError
from p2ptrain.config_checks import multi_rank_problem
from p2ptrain.diloco import DiLoCoOptimizer, DiLoCoOptions
from p2ptrain.hsdp import ShardedDiLoCo, broadcast_object, init_ranks, load_shards, shard_model
from p2ptrain.outer import make_outer_optimizer
from p2ptrain.schedules import inner_lr_schedule, outer_lr_schedule

if TYPE_CHECKING:
    from p2ptrain.config import RunConfig, TrainConfig
    from p2ptrain.swarm.progress import ProgressPublisher

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalRanks:
    """This process's place in its peer, from torchrun's environment (one rank when there is none)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls) -> "LocalRanks":
        return cls(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                   int(os.environ.get("LOCAL_RANK", 0)))

    @property
    def leader(self) -> bool:
        return self.rank == 0


class PeerRanks(ABC):
    """The ranks of one peer. Call every method on every rank, in the same order: with several ranks most of them
    are collectives. ``optimizer`` is what the training loop steps once ``build_optimizer`` made it."""

    def __init__(self, position: LocalRanks):
        self.position = position
        self.optimizer: Optional[Union[DiLoCoOptimizer, ShardedDiLoCo]] = None

    @property
    def leader(self) -> bool:
        """The rank that speaks for the peer: its DHT identity, its reports, its logs."""
        return self.position.leader

    @property
    def world(self) -> int:
        return self.position.world

    def batch_rows(self, batch_size: int) -> slice:
        """This rank's rows of a batch: each rank trains on its slice, FSDP averages their gradients."""
        rank, world = self.position.rank, self.position.world
        return slice(rank * batch_size // world, (rank + 1) * batch_size // world)

    @property
    @abstractmethod
    def diloco(self) -> Optional[DiLoCoOptimizer]:
        """The peer's member of the swarm (its counters are the peer's of record); None on the other ranks."""

    @abstractmethod
    def build_optimizer(self, model: torch.nn.Module, cfg: RunConfig, dht, publisher: Optional[ProgressPublisher],
                        replayer: Any = None) -> None:
        """Make ``optimizer`` for ``model`` from the run's config (``dht`` and ``publisher``: the leader's;
        ``replayer``: the replay check's, ``worker_replay.py``)."""

    @abstractmethod
    def broadcast(self, obj: Any) -> Any:
        """The leader's ``obj`` on every rank."""

    @abstractmethod
    def any_rank(self, flag: bool) -> bool:
        """True on every rank if it is True on any (e.g. one rank got the stop signal)."""

    @abstractmethod
    def catch_up(self, peer_id: str) -> bool:
        """If the swarm is at a later outer step, take its state from live peers (every rank its part of it).
        True if the peer caught up."""

    @abstractmethod
    def checkpoint_location(self, directory: str | Path, run_id: str) -> Path:
        """The file or folder in ``directory`` that this kind of peer writes its checkpoints to."""

    @abstractmethod
    def save_checkpoint(self, model: torch.nn.Module, directory: str | Path, run_id: str, meta: dict) -> Path:
        """Write the model's and the optimizer's state with ``meta`` (run, data position) beside; returns the path."""

    @abstractmethod
    def restore(self, model: torch.nn.Module, state: dict, directory: str | Path, run_id: str) -> None:
        """Load the model's and the optimizer's state from ``state`` (``checkpoint.resume_state``), which either kind
        of peer may have written."""

    def end(self) -> None:
        """After the optimizer and the DHT are closed: let go of what connects the ranks."""


def start_ranks(position: LocalRanks, device: torch.device, train: TrainConfig) -> PeerRanks:
    """This peer's ranks; for several: check the config, then start the process group and the HSDP mesh."""
    if position.world == 1:
        return OneProcess(position)
    problem = multi_rank_problem(train, position.world)  # the CLI checked it before starting torchrun
    if problem:
        raise ConfigError(problem)
    if not position.leader:
        logging.getLogger("p2ptrain").setLevel(logging.WARNING)  # the leader speaks for the peer
    return HsdpMesh(position, device, init_ranks(position.world, position.local_rank, device, train.shard_size))


def _optimizer_factories(cfg: RunConfig, dht, publisher: Optional[ProgressPublisher], replayer: Any = None):
    """(inner optimizer, DiLoCoOptimizer) factories from the config; each still needs its parameters."""
    diloco_cfg = cfg.diloco
    inner = partial(
        torch.optim.AdamW,
        lr=diloco_cfg.inner_lr,
        weight_decay=diloco_cfg.inner_weight_decay,
        betas=tuple(diloco_cfg.inner_betas),
    )
    make_diloco = partial(
        DiLoCoOptimizer,
        dht=dht,
        run_id=cfg.run_id,
        # sparse: plain SGD on the averaged messages (SparseLoCo: the decayed accumulator takes momentum's place)
        outer_optimizer=partial(make_outer_optimizer, lr=diloco_cfg.sparse_outer_lr, momentum=0.0)
        if diloco_cfg.compression == "sparse" else
        partial(make_outer_optimizer, lr=diloco_cfg.outer_lr, momentum=diloco_cfg.outer_momentum),
        settings=diloco_cfg,
        options=DiLoCoOptions(batch_size=cfg.train.batch_size, progress=publisher,
                              inner_lr_schedule=inner_lr_schedule(diloco_cfg),
                              outer_lr_schedule=outer_lr_schedule(diloco_cfg), replayer=replayer),
    )
    return inner, make_diloco


def load_sharded_into_one_rank(directory: Union[str, Path], model: torch.nn.Module, opt: DiLoCoOptimizer) -> None:
    """Load the latest sharded checkpoint in ``directory`` (written by any number of ranks) into a 1-rank peer's
    plain model, inner optimizer and DiLoCo state. Needs no process group."""
    target = latest_sharded_or_raise(directory)
    load_shards(target, model, opt.inner_optimizer)
    opt.load_state_dict(load_checkpoint(target / "diloco.pt")["diloco"])  # its "inner" is None: loaded above


class OneProcess(PeerRanks):
    """A peer of one process: its ``DiLoCoOptimizer`` steps the model itself."""

    optimizer: Optional[DiLoCoOptimizer]

    @property
    def diloco(self) -> Optional[DiLoCoOptimizer]:
        return self.optimizer

    def build_optimizer(self, model, cfg, dht, publisher, replayer=None) -> None:
        inner, make_diloco = _optimizer_factories(cfg, dht, publisher, replayer)
        self.optimizer = make_diloco(model.parameters(), inner_optimizer=inner).start()

    def broadcast(self, obj: Any) -> Any:
        return obj

    def any_rank(self, flag: bool) -> bool:
        return flag

    def catch_up(self, peer_id: str) -> bool:
        opt = self.optimizer
        swarm_outer_step = opt.swarm_outer_step()
        if swarm_outer_step <= opt.outer_step:
            return False
        logger.info(f"[{peer_id}] the swarm is at outer step {swarm_outer_step}, this peer at {opt.outer_step}: "
                    "taking the state from live peers")
        caught_up = opt.catch_up()
        if not caught_up:
            logger.warning(f"[{peer_id}] could not take the state from peers; training from its own, which is behind "
                           "the swarm")
        return caught_up

    def checkpoint_location(self, directory, run_id) -> Path:
        return checkpoint_path(directory, run_id)

    def save_checkpoint(self, model, directory, run_id, meta) -> Path:
        path = checkpoint_path(directory, run_id)
        save_checkpoint(path, {**meta, "model_state": model.state_dict(), "optimizer": self.optimizer.state_dict()})
        return path

    def restore(self, model, state, directory, run_id) -> None:
        if state["sharded"]:
            load_sharded_into_one_rank(sharded_checkpoint_dir(directory, run_id), model, self.optimizer)
        else:
            model.load_state_dict(state["model_state"])
            self.optimizer.load_state_dict(state["optimizer"])


class HsdpMesh(PeerRanks):
    """A peer of several ranks: the model is sharded over them (``fully_shard`` on ``mesh``), and the leader's
    ``DiLoCoOptimizer`` syncs a full proxy of it with the swarm (``hsdp.ShardedDiLoCo``)."""

    optimizer: Optional[ShardedDiLoCo]

    def __init__(self, position: LocalRanks, device: torch.device, mesh):
        super().__init__(position)
        self.device, self.mesh = device, mesh

    @property
    def diloco(self) -> Optional[DiLoCoOptimizer]:
        return self.optimizer.diloco if self.optimizer is not None else None

    def build_optimizer(self, model, cfg, dht, publisher, replayer=None) -> None:
        if cfg.diloco.replay_rate > 0:
            raise ConfigError("the replay check (--replay-rate) runs on peers of one process only for now; start this "
                              "peer with one rank, or without it")
        if cfg.diloco.fragments > 1 or cfg.diloco.overlap_steps > 0:
            raise ConfigError("the streaming sync (--fragments, --overlap-steps) runs on peers of one process only "
                              "for now; start this peer with one rank, or without those flags")
        inner, make_diloco = _optimizer_factories(cfg, dht, publisher)
        shard_model(model, self.mesh)
        # the ranks catch up together at a sync, never one of them mid-phase; the inner LR schedule drives the
        # ranks' inner optimizers, not the leader's proxy (which never steps)
        options = replace(make_diloco.keywords["options"], catch_up_mid_phase=False, inner_lr_schedule=None)
        diloco = (lambda params, proxy_inner: make_diloco(params, inner_optimizer=proxy_inner, options=options))
        self.optimizer = ShardedDiLoCo(model, inner_optimizer=inner, local_steps=cfg.diloco.local_steps,
                                       diloco=diloco if self.leader else None,
                                       inner_lr_schedule=inner_lr_schedule(cfg.diloco))

    def broadcast(self, obj: Any) -> Any:
        return broadcast_object(obj)

    def any_rank(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    def catch_up(self, peer_id: str) -> bool:
        return self.optimizer.catch_up_if_behind()

    def checkpoint_location(self, directory, run_id) -> Path:
        return sharded_checkpoint_dir(directory, run_id)

    def save_checkpoint(self, model, directory, run_id, meta) -> Path:
        # every rank writes its hsdp shards of the model and of the inner optimizer's state
        return self.optimizer.save_checkpoint(sharded_checkpoint_dir(directory, run_id), model, extra=meta)

    def restore(self, model, state, directory, run_id) -> None:
        if state["sharded"]:
            self.optimizer.load_checkpoint(sharded_checkpoint_dir(directory, run_id), model)
        else:
            self.optimizer.load_full_state(model, state["model_state"], state["optimizer"])

    def end(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
