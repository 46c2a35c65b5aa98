"""What one worker did: ``WorkerReport``, written as JSON by ``join --report`` (after start-up, after every round,
at exit, so it can be watched) and collected by ``demo`` and ``bench``. Its keys are an interface: tests and the
benchmark report read them."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from p2ptrain.data import ShardedBatches
from p2ptrain.health import write_atomically

logger = logging.getLogger(__name__)


def perplexity(loss: float) -> float:
    """exp(loss): the perplexity of a mean cross-entropy loss (inf where it overflows, NaN for NaN)."""
    try:
        return math.exp(loss)
    except OverflowError:
        return math.inf


@dataclass
class WorkerReport:
    """What one worker did; written as JSON by ``join --report`` and collected by ``demo``."""

    peer_id: str = ""
    run_id: str = ""
    model: str = ""
    num_parameters: int = 0
    shard_index: int = -1
    """the data shard this peer is on (at exit: the one it ended on)"""
    shard_history: List[Dict[str, Any]] = field(default_factory=list)
    """each shard this peer trained on, in order: ``shard``, where it started in it (``epoch``, ``position``), the
    ``outer_step`` and ``local_step`` then, and ``why`` (claimed, resumed, finished <shard>, conflict)"""
    outer_steps: int = 0
    syncs: int = 0
    """outer steps committed during this peer's training loop (a catch-up that took the state counts as one):
    what --max-outer-steps counts"""
    local_steps: int = 0
    initial_eval_loss: float = float("nan")
    final_eval_loss: float = float("nan")
    """``to_dict`` adds ``initial_perplexity`` and ``final_perplexity``: exp of these two losses"""
    wall_s: float = 0.0
    samples: int = 0
    maddrs: List[str] = field(default_factory=list)
    """addresses other peers can join through"""
    state_download_s: Optional[float] = None
    """seconds spent taking the swarm's state from live peers at start (None: not needed)"""
    state_download: Optional[Dict[str, Any]] = None
    """how that download went: bytes, chunks per donor, donors that failed part way"""
    first_loss: Optional[float] = None
    """training loss of this peer's first inner step (after any state download)"""
    replay: Optional[Dict[str, Any]] = None
    """the replay check (--replay-rate): replays made, their steps and seconds, bytes fetched for them, the largest
    deviation of a replay from what its sender sent, the senders convicted and why"""
    data_cursor: Optional[Dict[str, Any]] = None
    """where this peer started in its shard, when it continued from another peer's published cursor"""
    startup_s: Optional[float] = None
    """seconds from start to the first inner step: joining the DHT, building the model, taking the state"""
    compute_s: float = 0.0
    """seconds in inner steps (forward, backward, inner optimizer step); syncs and evals not included"""
    train_started_at: Optional[float] = None
    """wall-clock time (time.time()) of the first inner step: start-up ends here"""
    train_ended_at: Optional[float] = None
    """wall-clock time when the training loop ended"""
    stopped_by: str = ""
    """"max_outer_steps", "until_outer_step" or "signal" """
    reachability: str = ""
    """public or client mode, and why (swarm/reachability.py)"""
    config: Dict[str, Any] = field(default_factory=dict)
    """the effective config: the file's, flags' and environment's settings over the defaults (``RunConfig``)"""
    start_outer_step: Optional[int] = None
    """outer step of the state this peer started training from (after any checkpoint and state download)"""
    rounds: List[Dict[str, Any]] = field(default_factory=list)
    """one entry per sync: SyncRecord fields plus the eval loss right after it, the shard (``shard_index``) and
    the position in it (``data_position``: epoch, sample), the cumulative ``compute_s`` at that point, and this
    peer's libp2p connections then (``direct``, ``relayed``). A round joined with weight 0 while taking the swarm's
    state at start is one too (``caught_up``)"""
    evals: List[Dict[str, Any]] = field(default_factory=list)
    """the held-out evals of --eval-every, in order: ``local_step``, ``outer_step``, ``eval_loss``, ``perplexity``"""
    grad_norm: Optional[float] = None
    """the gradient's global norm before clipping at the last inner step (with --grad-clip; None without)"""

    def to_dict(self) -> Dict[str, Any]:
        report = dict(self.__dict__)
        # derived here, so they can never disagree with the losses
        report["initial_perplexity"] = perplexity(self.initial_eval_loss)
        report["final_perplexity"] = perplexity(self.final_eval_loss)
        report["final_model"] = self.final_model
        return report

    @property
    def final_model(self) -> Optional[Dict[str, Any]]:
        """The model this peer holds after its last round: its ``outer_step``, ``digest`` (of the global parameters,
        equal on every peer that holds the swarm's model of that step) and ``how`` it got it: "averaged" (in a group
        of ``group_size``), "took the state" (from live peers) or "stepped alone" (no other live peer of the run was
        at that outer step). A round abandoned on leaving changed nothing: the model is the one before it. None
        before any round that stepped."""
        stepped = [r for r in self.rounds if not r.get("abandoned")]
        if not stepped:
            return None
        last = stepped[-1]
        how = "took the state" if last.get("caught_up") else "averaged" if last.get("averaged") else "stepped alone"
        return {"outer_step": last["outer_step"], "digest": last.get("digest", ""), "how": how,
                "group_size": last.get("group_size", 1)}

    def add_eval(self, *, local_step: int, outer_step: int, eval_loss: float) -> Dict[str, Any]:
        """One entry of ``evals``; returns it."""
        entry = dict(local_step=local_step, outer_step=outer_step, eval_loss=eval_loss,
                     perplexity=perplexity(eval_loss))
        self.evals.append(entry)
        return entry

    def add_round(self, record, batches: ShardedBatches, eval_loss: float, eval_s: float = 0.0,
                  connections: Optional[Dict[str, int]] = None, schedule: Optional[Dict[str, float]] = None) -> None:
        """One entry of ``rounds`` for ``record`` (a ``SyncRecord``), with where this peer is in its data and, in
        ``schedule``, where it is in the LR schedules after the round (``local_step``, the ``inner_lr`` and
        ``outer_lr`` the next steps use)."""
        entry = record.to_dict()
        entry.update(schedule or {})
        entry["shard_index"] = batches.shard_index
        entry["data_position"] = [batches.epoch, batches.position]
        entry["eval_loss"] = eval_loss
        entry["perplexity"] = perplexity(eval_loss)
        entry["eval_s"] = eval_s  # the held-out eval after the round: neither compute nor sync
        entry["compute_s"] = self.compute_s  # cumulative, so any window of rounds has its compute time
        if connections is not None:
            entry["connections"] = connections
        self.rounds.append(entry)

    def write(self, path: str | Path) -> None:
        """Write the report to ``path`` atomically: a reader never sees half of it."""
        path = Path(path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, json.dumps(self.to_dict(), indent=2))
        except OSError as e:  # a report is not worth stopping training for
            logger.error(f"[{self.peer_id}] could not write the report {path}: {e}")
