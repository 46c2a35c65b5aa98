"""The daemons: a training worker (startup -> inner steps and syncs -> shutdown) and a DHT-only bootstrap peer.

This is the one module that knows every other: it wires config, DHT, data, model and DiLoCoOptimizer together.
Both daemons stop on ``request_stop()`` (the CLI calls it on the first SIGINT/SIGTERM) and always shut down their
hivemind processes on the way out, so no p2pd or averager outlives them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from tqdm import tqdm

from p2ptrain.checkpoint import CheckpointError, checkpoint_path, load_checkpoint, save_checkpoint
from p2ptrain.config import ConfigError, RunConfig, default_threads
from p2ptrain.data import (
    ShardedBatches,
    eval_batches,
    evaluate,
    load_corpus,
    phase_shortfall,
    split_train_val,
)
from p2ptrain.diloco import DiLoCoOptimizer
from p2ptrain.health import Heartbeat, write_atomically
from p2ptrain.hsdp import (
    LocalRanks,
    ShardedDiLoCo,
    any_rank,
    broadcast_object,
    init_ranks,
    load_sharded_into_one_rank,
    multi_rank_problem,
    read_checkpoint_meta,
    shard_model,
)
from p2ptrain.lifeline import follow_parent
from p2ptrain.memory import GiB, check_memory
from p2ptrain.model import build_model, model_config
from p2ptrain.outer import make_outer_optimizer
from p2ptrain.swarm.dht import SwarmConfig, start_dht, stop_dht, visible_maddrs
from p2ptrain.swarm.progress import ProgressPublisher, fetch_progress
from p2ptrain.swarm.reachability import connection_counts
from p2ptrain.swarm.shards import (
    claim_shard,
    cursor_state,
    fetch_cursor,
    fetch_cursors,
    pick_next_shard,
    publish_cursor,
    shard_progress,
)

logger = logging.getLogger(__name__)


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
    start_outer_step: Optional[int] = None
    """outer step of the state this peer started training from (after any checkpoint and state download)"""
    rounds: List[Dict[str, Any]] = field(default_factory=list)
    """one entry per sync: SyncRecord fields plus the eval loss right after it, the shard (``shard_index``) and
    the position in it (``data_position``: epoch, sample), the cumulative ``compute_s`` at that point, and this
    peer's libp2p connections then (``direct``, ``relayed``). A round joined with weight 0 while taking the swarm's
    state at start is one too (``caught_up``)"""

    def to_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--device {name}: CUDA is not available on this host; use --device cpu or auto")
    return torch.device(name)


class Worker:
    """A training peer. ``run()`` blocks until ``max_outer_steps`` or ``request_stop()``; returns a report."""

    def __init__(
        self,
        config: RunConfig,
        *,
        report_path: Optional[str] = None,
        show_progress: bool = True,
        resume: bool = False,
        health_file: Optional[str] = None,
    ):
        self.config = config
        self.resume = resume
        self.health_file = health_file
        self._phase = "starting"
        self._dht = None
        self.report_path = report_path
        self.show_progress = show_progress
        self._stop = threading.Event()
        self._opt: Optional[DiLoCoOptimizer] = None
        self._checkpoint_parts: Optional[tuple] = None  # (model, optimizer, batches) once training can begin
        self._publisher: Optional[ProgressPublisher] = None  # the leader's, once joined
        self._batches: Optional[ShardedBatches] = None
        self._seen: Dict[int, dict] = {}  # shard -> the furthest state of it this peer knows of (left or published)
        self.report = WorkerReport(run_id=config.run_id, model=config.train.model)
        self._dht = None  # set once joined: the round reports list its connections
        self.ranks = LocalRanks()  # set from torchrun's environment when run() starts

    def request_stop(self) -> None:
        """Leave after the current step; a sync that is waiting for peers gives up after its current attempt."""
        self._stop.set()
        if self._opt is not None:
            self._opt.interrupt()

    def run(self) -> WorkerReport:
        """Train until done or stopped; with a health file, keep it current meanwhile (on the leader)."""
        heartbeat = None
        if self.health_file and LocalRanks.from_env().leader:
            heartbeat = Heartbeat(self.health_file, self._health).start()
        try:
            report = self._run()
        except BaseException as e:
            if heartbeat is not None:
                heartbeat.stop("failed" if not isinstance(e, KeyboardInterrupt) else "left")
            raise
        if heartbeat is not None:
            heartbeat.stop("left")
        return report

    def _health(self) -> Dict[str, Any]:
        rounds = self.report.rounds
        return dict(role="worker", phase=self._phase, run_id=self.config.run_id, peer_id=self.report.peer_id,
                    outer_step=self.report.outer_steps, local_step=self.report.local_steps,
                    samples=self.report.samples, last_group_size=rounds[-1].get("group_size") if rounds else None,
                    dht_alive=self._dht.is_alive() if self._dht is not None else None)

    def _run(self) -> WorkerReport:
        cfg, started = self.config, time.monotonic()
        self._started = started
        train_cfg, diloco_cfg = cfg.train, cfg.diloco
        torch.set_num_threads(train_cfg.threads or default_threads())
        device = pick_device(train_cfg.device)
        # read the data and the checkpoint before joining: bad input must fail before any process is started
        train_bytes, val_bytes = split_train_val(load_corpus(train_cfg.data or None))
        ranks = self.ranks = LocalRanks.from_env()
        if ranks.world > 1:
            # torchrun starts each rank in a session of its own: if its agent is SIGKILLed, nothing else stops it
            follow_parent()
        resumed = self._load_resume_state() if self.resume else None
        if ranks.world > 1:
            problem = multi_rank_problem(train_cfg, ranks.world)  # the CLI checked it before starting torchrun
            if problem:
                raise ConfigError(problem)
            if not ranks.leader:
                logging.getLogger("p2ptrain").setLevel(logging.WARNING)  # the leader speaks for the peer
            mesh = init_ranks(ranks, device, train_cfg.shard_size)

        if train_cfg.memory_check:
            estimate = check_memory(model_config(train_cfg.model), train_cfg.batch_size, ranks.world,
                                    train_cfg.shard_size or ranks.world, device,
                                    train_cfg.activation_checkpointing, leader=ranks.leader)
            logger.info(f"memory (estimated): {estimate.rank_bytes / GiB:.2f} GiB per rank on {device}, "
                        f"{estimate.host_bytes / GiB:.2f} GiB on the host, {estimate.shm_bytes / GiB:.2f} GiB in "
                        "/dev/shm")

        self._phase = "joining"
        dht = self._dht = start_dht(cfg.swarm) if ranks.leader else None
        opt = None
        try:
            publisher = self._publisher = self._join_swarm(dht, resumed) if ranks.leader else None
            shard_index = publisher.shard_index if publisher else None
            if ranks.world > 1:
                shard_index = broadcast_object(shard_index)
            self.report.shard_index = shard_index
            batches = self._batches = ShardedBatches(
                train_bytes,
                block_size=self._block_size(),
                batch_size=train_cfg.batch_size,
                shard_index=shard_index,
                num_shards=train_cfg.num_shards,
                seed=train_cfg.seed,
                # a peer pinned to a shard (--shard-index) stays on it; the others move on after each pass
                on_epoch_end=None if self._pinned() else self._on_epoch_end,
            )
            shortfall = phase_shortfall(len(train_bytes), train_cfg.num_shards, self._block_size(),
                                        diloco_cfg.local_steps, train_cfg.batch_size, shard_index)
            if shortfall and ranks.leader:
                logger.warning(shortfall)
            held_out = eval_batches(val_bytes, self._block_size(), train_cfg.batch_size, train_cfg.eval_batches)

            model = build_model(train_cfg.model, seed=train_cfg.seed).to(device)
            model.activation_checkpointing = train_cfg.activation_checkpointing
            self.report.num_parameters = model.num_parameters()
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
                local_steps=diloco_cfg.local_steps,
                outer_optimizer=partial(make_outer_optimizer, lr=diloco_cfg.outer_lr,
                                        momentum=diloco_cfg.outer_momentum),
                compression=diloco_cfg.compression,
                matchmaking_time_s=diloco_cfg.matchmaking_time_s,
                late_peer_wait_s=diloco_cfg.late_peer_wait_s,
                averaging_timeout_s=diloco_cfg.averaging_timeout_s,
                min_group_size=diloco_cfg.min_group_size,
                target_group_size=diloco_cfg.target_group_size,
                no_group_policy=diloco_cfg.no_group_policy,
                batch_size=train_cfg.batch_size,
                progress=publisher,
            )
            if ranks.world == 1:
                opt = make_diloco(model.parameters(), inner_optimizer=inner).start()
            else:
                shard_model(model, mesh)
                opt = ShardedDiLoCo(
                    model, inner_optimizer=inner, local_steps=diloco_cfg.local_steps,
                    diloco=(lambda params, proxy_inner: make_diloco(params, inner_optimizer=proxy_inner,
                                                                     catch_up_mid_phase=False))
                    if ranks.leader else None,
                )
            self._opt = opt
            if self._stop.is_set():  # a signal arrived while the optimizer was being built
                opt.interrupt()
            if resumed is not None:
                self._restore(resumed, model, opt, batches)
            joined_rounds = self._catch_up(opt)
            self._continue_shard(dht, opt, batches)
            self._note_shard(batches, opt, "resumed" if resumed is not None else "claimed")
            self.report.initial_eval_loss = self._evaluate(model, held_out, device)
            self.report.start_outer_step = opt.outer_step
            if ranks.leader:
                for record in joined_rounds:
                    self._report_round(record, batches, self.report.initial_eval_loss)
            logger.info(
                f"[{self.report.peer_id}] model {train_cfg.model} ({self.report.num_parameters:,} parameters) on "
                f"{device} x {ranks.world} rank(s), shard {shard_index}/{train_cfg.num_shards}, "
                f"eval loss {self.report.initial_eval_loss:.4f}"
            )
            self._checkpoint_parts = (model, opt, batches)
            self._phase = "training"
            self._train(model, opt, batches, held_out, device)
            self._phase = "leaving"
            # only on a normal exit (done or signalled): after an exception the state may be half-updated
            self._save_checkpoint("exit")
        finally:
            self._phase = "leaving"
            if opt is not None:
                opt.close()
            if dht is not None:
                stop_dht(dht)
            if ranks.world > 1 and dist.is_initialized():
                dist.destroy_process_group()
            self.report.wall_s = time.monotonic() - started
            self._write_report()
        return self.report

    def _join_swarm(self, dht, resumed: Optional[dict]) -> ProgressPublisher:
        """Log who we are and how to reach us, and settle which data shard this peer trains on."""
        cfg = self.config
        peer_id = dht.peer_id.to_base58()
        self.report.peer_id = peer_id
        self.report.reachability = str(dht.reachability) if getattr(dht, "reachability", None) else ""
        self._dht = dht
        logger.info(f"[{peer_id}] joined run {cfg.run_id!r}; other peers can join through:")
        self.report.maddrs = [str(maddr) for maddr in visible_maddrs(dht)]
        for maddr in self.report.maddrs:
            logger.info(f"[{peer_id}]   {maddr}")
        self._write_report()
        logger.info(f"[{peer_id}] effective config: {json.dumps(cfg.to_dict(), sort_keys=True)}")
        publisher = ProgressPublisher(dht, cfg.run_id)
        # the model in words (a refused newcomer is told what differs) and this worker's own settings (status)
        shape = model_config(cfg.train.model)
        publisher.settings = dict(
            model=cfg.train.model, n_layer=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head,
            block_size=shape.block_size, vocab_size=shape.vocab_size, seed=cfg.train.seed,
            data=", ".join(cfg.train.data)[:200] if cfg.train.data else "built-in corpus",
            batch_size=cfg.train.batch_size, threads=torch.get_num_threads(),
        )
        if resumed is not None:
            publisher.shard_index = resumed["shard_index"]  # keep training on the same data
        elif cfg.train.shard_index is not None:
            publisher.shard_index = cfg.train.shard_index
        else:
            publisher.shard_index = claim_shard(dht, cfg.run_id, cfg.train.num_shards, publisher)
        return publisher

    def _write_report(self) -> None:
        """Write the report atomically (after start-up, after every sync, at exit), so it can be watched. The
        leader writes it for a peer of several ranks."""
        if not self.report_path or not self.ranks.leader:
            return
        path = Path(self.report_path)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(path, json.dumps(self.report.to_dict(), indent=2))
        except OSError as e:  # a report is not worth stopping training for
            logger.error(f"[{self.report.peer_id}] could not write the report {path}: {e}")

    def _catch_up(self, opt) -> list:
        """A peer that starts behind the swarm (joining mid-run, resuming late) takes the state from live peers
        first, so it never averages a pseudo-gradient computed from stale parameters. Returns the SyncRecords of
        the rounds it joined meanwhile (on the leader)."""
        started, records_before = time.monotonic(), len(opt.history)
        if isinstance(opt, ShardedDiLoCo):
            caught_up = opt.catch_up_if_behind()
        else:
            swarm_outer_step = opt.swarm_outer_step()
            if swarm_outer_step <= opt.outer_step:
                return []
            logger.info(f"[{self.report.peer_id}] the swarm is at outer step {swarm_outer_step}, this peer at "
                        f"{opt.outer_step}: taking the state from live peers")
            caught_up = opt.catch_up()
            if not caught_up:
                logger.warning(f"[{self.report.peer_id}] could not take the state from peers; training from its "
                               "own, which is behind the swarm")
        if caught_up:
            self.report.outer_steps = opt.outer_step
            self.report.local_steps = opt.local_step
            self.report.state_download_s = time.monotonic() - started
            self.report.state_download = opt.last_download
        return [r for r in opt.history[records_before:] if r.averaged]

    def _report_round(self, record, batches: ShardedBatches, eval_loss: float, eval_s: float = 0.0) -> None:
        entry = record.to_dict()
        entry["shard_index"] = batches.shard_index
        entry["data_position"] = [batches.epoch, batches.position]
        entry["eval_loss"] = eval_loss
        entry["eval_s"] = eval_s  # the held-out eval after the round: neither compute nor sync
        entry["compute_s"] = self.report.compute_s  # cumulative, so any window of rounds has its compute time
        if self._dht is not None:
            entry["connections"] = connection_counts(self._dht)
        self.report.rounds.append(entry)
        self._write_report()

    def _continue_shard(self, dht, opt: DiLoCoOptimizer, batches: ShardedBatches) -> None:
        """Continue this shard where the swarm's training of it got to, if that is ahead of us: its previous owner
        left or died (or we resumed from an older checkpoint). Cursors from a later outer step than ours are from an
        earlier run under the same run id, and are ignored."""
        state = self._take_shard_cursor(dht, opt, batches) if self.ranks.leader else None
        if self.ranks.world > 1:
            state = broadcast_object(state)
            if state is not None and not self.ranks.leader:
                batches.load_state_dict(state)

    def _take_shard_cursor(self, dht, opt, batches: ShardedBatches) -> Optional[dict]:
        """Move ``batches`` to the shard's published cursor if it applies; returns that position (a
        ``ShardedBatches`` state) for the other ranks, or None."""
        cursor = fetch_cursor(dht, self.config.run_id, batches.shard_index)
        if cursor is None or (cursor.epoch, cursor.position) <= (batches.epoch, batches.position):
            return None
        peer = self.report.peer_id
        if cursor.outer_step > opt.outer_step:
            logger.warning(f"[{peer}] ignoring the data cursor of shard {batches.shard_index} from outer step "
                           f"{cursor.outer_step}: this run is at {opt.outer_step} (an earlier run with this run id?)")
            return None
        state = cursor_state(cursor)
        try:
            batches.load_state_dict(state)  # refuses a position from another data layout
        except ValueError as e:
            logger.warning(f"[{peer}] ignoring the data cursor of shard {batches.shard_index}: {e}")
            return None
        self.report.data_cursor = {"from_peer": cursor.peer_id, "outer_step": cursor.outer_step,
                                   "epoch": cursor.epoch, "position": cursor.position}
        logger.info(f"[{peer}] continuing shard {batches.shard_index} at epoch {cursor.epoch}, sample "
                    f"{cursor.position}, where {cursor.peer_id[-8:]} left it at outer step {cursor.outer_step}")
        return state

    # ------------------------------------------------------------------------------------ moving between shards

    def _pinned(self) -> bool:
        """A peer given --shard-index trains on that shard only."""
        return self.config.train.shard_index is not None

    def _note_shard(self, batches: ShardedBatches, opt, why: str) -> None:
        """Record (report, progress record) that this peer now trains on ``batches``' current shard."""
        self.report.shard_index = batches.shard_index
        self.report.shard_history.append({
            "shard": batches.shard_index, "epoch": batches.epoch, "position": batches.position,
            "outer_step": opt.outer_step if opt is not None else 0,
            "local_step": opt.local_step if opt is not None else 0, "why": why,
        })
        if self._publisher is not None and self._publisher.shard_index != batches.shard_index:
            self._publisher.shard_index = batches.shard_index
            diloco = opt.diloco if isinstance(opt, ShardedDiLoCo) else opt
            if diloco is not None:  # at once: other peers choosing a shard now must see this claim
                self._publisher.publish(outer_step=diloco.outer_step, local_step=diloco.local_step,
                                        samples_per_s=diloco.samples_per_s,
                                        samples_since_sync=diloco.samples_since_sync)

    def _on_epoch_end(self, finished: dict) -> Optional[dict]:
        """``ShardedBatches.on_epoch_end``: a pass over the current shard is complete; where to go on. Called on
        every rank at the same batch (the ranks iterate the same batches): the leader chooses and broadcasts."""
        self._seen[finished["shard_index"]] = finished
        choice = self._choose_shard(finished, conflict=False) if self.ranks.leader else None
        if self.ranks.world > 1:
            choice = broadcast_object(choice)
        if choice is not None:
            self._batches.load_state_dict(choice)
            self._note_shard(self._batches, self._opt, f"finished {finished['shard_index']}")
        return choice

    def _choose_shard(self, current: dict, conflict: bool) -> Optional[dict]:
        """On the leader: the state to go on from when leaving the shard of ``current`` (its pass is complete, or
        ``conflict``: another live peer with a smaller peer id trains on it too), or None to stay. The least seen
        shard that no other live peer claims, where the swarm's training of it got to."""
        cfg, opt, batches = self.config, self._opt, self._batches
        me, mine = self.report.peer_id, current["shard_index"]
        records = fetch_progress(self._dht, cfg.run_id)
        others = [r for r in records if r.peer_id != me and r.HasField("shard_index")]
        if conflict and not any(r.shard_index == mine and r.peer_id < me for r in others):
            return None
        claimed = {r.shard_index for r in others}
        outer_step = opt.outer_step if opt is not None else None
        cursors = fetch_cursors(self._dht, cfg.run_id)
        progress = shard_progress(cursors.values(), batches.num_shards, outer_step, layout=current)
        starts: Dict[int, dict] = {}
        for index, cursor in cursors.items():
            state = cursor_state(cursor)
            if index in progress and state == {**batches.state_for(index), "epoch": state["epoch"],
                                               "position": state["position"]}:
                starts[index] = state
        for index, state in {**self._seen, mine: current}.items():
            passes = state["epoch"] + state["position"] / state["samples_per_epoch"]
            progress[index] = max(progress.get(index, 0.0), passes)
            if index not in starts or (state["epoch"], state["position"]) > (starts[index]["epoch"],
                                                                                starts[index]["position"]):
                starts[index] = state
        pick = pick_next_shard(batches.num_shards, progress, claimed, me)
        if pick is None or pick == mine:
            if not conflict:
                logger.info(f"[{me}] shard {mine} done ({current['epoch']} pass(es)); every other shard is claimed "
                            f"by a live peer or seen as often: pass {current['epoch'] + 1} of shard {mine}")
            return None
        state = starts.get(pick, batches.state_for(pick))
        if state["position"] >= state["samples_per_epoch"]:  # defensive: a cursor at the very end is a pass done
            state = {**state, "epoch": state["epoch"] + 1, "position": 0}
        seen = progress.get(pick, 0.0)
        why = (f"another live peer ({min(r.peer_id for r in others if r.shard_index == mine)[-8:]}) trains on "
               f"shard {mine} too" if conflict else f"shard {mine} done ({current['epoch']} pass(es))")
        logger.info(f"[{me}] {why}; moving on to shard {pick} ({'unseen' if seen == 0 else f'{seen:.2f} passes seen'}"
                    f"), at epoch {state['epoch']}, sample {state['position']}")
        return state

    def _after_commit(self, batches: ShardedBatches, opt) -> None:
        """After a committed round, on every rank: move off a shard another live peer took too (one with a smaller
        peer id stays), then (leader) publish the cursors: of each shard left since the previous round, where it
        was left, and of the current one. Only now did those samples reach the swarm's parameters."""
        if not self._pinned():
            move = self._choose_shard(batches.state_dict(), conflict=True) if self.ranks.leader else None
            if self.ranks.world > 1:
                move = broadcast_object(move)
            if move is not None:
                batches.load_state_dict(move)
                self._note_shard(batches, opt, "conflict")
        left, batches.left_shards = batches.left_shards, {}
        if not self.ranks.leader:
            return
        states = {index: state for index, state in left.items() if index != batches.shard_index}
        states[batches.shard_index] = batches.state_dict()
        # a cursor only moves forward: another peer that trained on the same shard (two picked it at once) may have
        # published a position further through its order already; samples up to there did reach the swarm
        published = fetch_cursors(self._dht, self.config.run_id) if not self._pinned() else {}
        for index, state in states.items():
            cursor = published.get(index)
            if cursor is not None and cursor.outer_step <= opt.outer_step:
                theirs = cursor_state(cursor)
                if theirs == {**state, "epoch": theirs["epoch"], "position": theirs["position"]} and \
                        (theirs["epoch"], theirs["position"]) > (state["epoch"], state["position"]):
                    self._seen[index] = theirs
                    continue
            publish_cursor(self._dht, self.config.run_id, state, opt.outer_step)
            if index != batches.shard_index:
                self._seen[index] = max(state, self._seen.get(index, state),
                                        key=lambda st: (st["epoch"], st["position"]))

    # ------------------------------------------------------------------------------------------- checkpoints

    def _load_resume_state(self) -> dict:
        cfg = self.config
        if not cfg.train.checkpoint_dir:
            raise ConfigError("--resume needs --checkpoint-dir: the folder the previous run wrote its checkpoint to")
        # a peer may come back with another number of ranks: take the latest checkpoint of either kind
        full_path = checkpoint_path(cfg.train.checkpoint_dir, cfg.run_id)
        candidates = []
        if full_path.exists():
            full = load_checkpoint(full_path)
            candidates.append({**full, "sharded": False, "outer_step": full["optimizer"]["outer_step"],
                               "local_step": full["optimizer"]["local_step"]})
        if (self._sharded_checkpoint_dir() / "latest").exists():
            candidates.append({**read_checkpoint_meta(self._sharded_checkpoint_dir()), "sharded": True})
        if not candidates:
            raise CheckpointError(f"no checkpoint at {full_path} or in {self._sharded_checkpoint_dir()}; drop "
                                  "--resume to start fresh, or check --checkpoint-dir")
        # the latest; between two of the same age, the kind this peer writes
        sharded_peer = self.ranks.world > 1
        state = max(candidates, key=lambda c: (c["outer_step"], c["local_step"], c["sharded"] == sharded_peer))
        for key, expected in (("run_id", cfg.run_id), ("model", cfg.train.model), ("num_shards", cfg.train.num_shards)):
            if state.get(key) != expected:
                raise ConfigError(
                    f"the checkpoint was written with {key}={state.get(key)!r} but this run has {expected!r}; "
                    f"use the same {key} to resume"
                )
        return state

    def _sharded_checkpoint_dir(self) -> Path:
        """Where a peer of several ranks keeps its sharded checkpoints (a 1-rank peer writes <run-id>.pt)."""
        return Path(self.config.train.checkpoint_dir) / f"{self.config.run_id}-sharded"

    def _restore(self, state: dict, model, opt, batches: ShardedBatches) -> None:
        if isinstance(opt, ShardedDiLoCo) and state["sharded"]:
            opt.load_checkpoint(self._sharded_checkpoint_dir(), model)
        elif isinstance(opt, ShardedDiLoCo):
            opt.load_full_state(model, state["model_state"], state["optimizer"])
        elif state["sharded"]:
            load_sharded_into_one_rank(self._sharded_checkpoint_dir(), model, opt)
        else:
            model.load_state_dict(state["model_state"])
            opt.load_state_dict(state["optimizer"])
        batches.load_state_dict(state["data"])
        batches.left_shards = dict(state.get("left_shards", {}))
        self.report.outer_steps = opt.outer_step
        self.report.local_steps = opt.local_step
        logger.info(
            f"[{self.report.peer_id}] resumed from the checkpoint at outer step {opt.outer_step}, "
            f"local step {opt.local_step}"
        )

    def _save_checkpoint(self, why: str) -> None:
        directory = self.config.train.checkpoint_dir
        if not directory or self._checkpoint_parts is None:
            return
        model, opt, batches = self._checkpoint_parts
        meta = {
            "run_id": self.config.run_id,
            "model": self.config.train.model,
            "num_shards": self.config.train.num_shards,
            "shard_index": batches.shard_index,
            "data": batches.state_dict(),
            # shards left since the last committed round: their cursors are published after the next one
            "left_shards": dict(batches.left_shards),
        }
        try:
            if isinstance(opt, ShardedDiLoCo):  # every rank writes its shards; a collective
                path = opt.save_checkpoint(self._sharded_checkpoint_dir(), model, extra=meta)
            else:
                path = checkpoint_path(directory, self.config.run_id)
                save_checkpoint(path, {**meta, "model_state": model.state_dict(), "optimizer": opt.state_dict()})
            logger.info(f"[{self.report.peer_id}] checkpoint written to {path} ({why})")
        except OSError as e:  # a full disk must not kill training: the previous checkpoint stays valid
            logger.error(f"[{self.report.peer_id}] could not write the checkpoint {path}: {e}")

    def _block_size(self) -> int:
        return model_config(self.config.train.model).block_size

    def _evaluate(self, model: torch.nn.Module, held_out, device: torch.device) -> float:
        with self._autocast(device):
            return evaluate(model, [(x.to(device), y.to(device)) for x, y in held_out])

    @staticmethod
    def _autocast(device: torch.device):
        return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    def _train(self, model, opt: DiLoCoOptimizer, batches, held_out, device: torch.device) -> None:
        cfg = self.config.train
        peer = self.report.peer_id
        max_syncs, until = cfg.max_outer_steps, cfg.until_outer_step
        if until is not None and opt.outer_step >= until:
            logger.info(f"[{peer}] already at outer step {opt.outer_step}, at or past --until-outer-step {until}: "
                        "leaving without training")
            self.report.stopped_by = "until_outer_step"
            self.report.train_ended_at = time.time()
            return
        # inner steps until the first sync, then H per sync (a catch-up may jump further: the bar is a plan)
        first_sync_in = opt.local_steps - opt.local_step % opt.local_steps
        planned = [n for n in (max_syncs, until - opt.outer_step if until is not None else None) if n is not None]
        total = (min(planned) - 1) * opt.local_steps + first_sync_in if planned else None
        syncs = 0
        ranks = self.ranks
        bar = tqdm(total=total, desc=f"{peer[-8:]} train", unit="step", leave=False,
                   disable=not (self.show_progress and ranks.leader))
        last_log, loss_value = time.monotonic(), float("nan")
        # each rank of a multi-rank peer trains on its slice of the batch; FSDP averages their gradients
        rows = slice(ranks.rank * cfg.batch_size // ranks.world, (ranks.rank + 1) * cfg.batch_size // ranks.world)
        model.train()
        try:
            for x, y in batches:
                stop = self._stop.is_set()
                if ranks.world > 1:
                    stop = any_rank(stop, device)  # every rank leaves at the same step, or a collective hangs
                if stop:
                    self.report.stopped_by = "signal"
                    break
                if self.report.startup_s is None:
                    self.report.startup_s = time.monotonic() - self._started
                    self.report.train_started_at = time.time()
                step_started = time.perf_counter()
                x, y = x[rows], y[rows]
                with self._autocast(device):
                    _, loss = model(x.to(device), y.to(device))
                loss.backward()
                synced_before = opt.outer_step
                opt.step(batch_size=cfg.batch_size)
                opt.zero_grad()
                loss_value = loss.item()
                step_s = time.perf_counter() - step_started
                if opt.outer_step != synced_before and opt.history:
                    step_s -= opt.history[-1].seconds  # the sync this step ended with is not compute
                self.report.compute_s += max(step_s, 0.0)
                if self.report.first_loss is None:
                    self.report.first_loss = loss_value
                self.report.local_steps = opt.local_step
                self.report.samples += cfg.batch_size
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.3f}", outer=opt.outer_step)

                if opt.outer_step != synced_before:
                    # a sync this peer took part in (averaged, or stepped alone); taking the swarm's state instead
                    # (it was left out of a round) is not one: a newcomer asked for n syncs averages n times
                    took_part = bool(opt.history) and not opt.history[-1].caught_up if ranks.leader else None
                    if ranks.world > 1:
                        took_part = broadcast_object(took_part)
                    syncs += took_part
                    self.report.syncs = syncs
                    self._after_commit(batches, opt)  # on every rank: it may move to another shard
                    if opt.outer_step % cfg.checkpoint_every == 0:
                        self._save_checkpoint(f"outer step {opt.outer_step}")
                    eval_started = time.perf_counter()
                    eval_loss = self._evaluate(model, held_out, device)  # on every rank: a sharded forward
                    eval_s = time.perf_counter() - eval_started
                    model.train()
                    self.report.outer_steps = opt.outer_step
                    self.report.final_eval_loss = eval_loss
                    if ranks.leader:
                        self._report_round(opt.history[-1], batches, eval_loss, eval_s)
                log_due = time.monotonic() - last_log >= cfg.log_interval_s or opt.outer_step != synced_before
                if ranks.leader and log_due:
                    self._log_line(opt, loss_value)
                    last_log = time.monotonic()
                if max_syncs and syncs >= max_syncs:
                    self.report.stopped_by = "max_outer_steps"
                    break
                if until is not None and opt.outer_step >= until:
                    self.report.stopped_by = "until_outer_step"
                    break
        finally:
            bar.close()
            self.report.train_ended_at = time.time()

    def _log_line(self, opt: DiLoCoOptimizer, loss_value: float) -> None:
        last = opt.history[-1] if opt.history else None
        sync = f"last sync: group_size={last.group_size} {last.seconds:.2f}s" if last else "last sync: none yet"
        logger.info(
            f"[{self.report.peer_id}] outer_step={opt.outer_step} local_step={opt.local_step} loss={loss_value:.4f} "
            f"samples/s={opt.samples_per_s:.1f} {sync}"
        )


def run_bootstrap(
    swarm: SwarmConfig, *, maddrs_file: Optional[str], stop: threading.Event, status_interval_s: float = 60.0,
    health_file: Optional[str] = None,
) -> None:
    """A DHT-only peer: starts, prints its addresses, serves until ``stop`` is set, shuts down. Always a full
    member: workers dial it to join, and it answers their reachability probes."""
    dht = start_dht(dataclasses.replace(swarm, reachability="public"))
    peer_id = dht.peer_id.to_base58()
    heartbeat = None
    try:
        maddrs = visible_maddrs(dht)
        print(f"bootstrap peer {peer_id} is up; workers join with --initial-peers and one of:")
        for maddr in maddrs:
            print(f"  {maddr}", flush=True)
        if maddrs_file:  # atomically: a worker waiting for the file must never read half of it
            write_atomically(Path(maddrs_file), "".join(f"{m}\n" for m in maddrs))
        if health_file:
            heartbeat = Heartbeat(health_file, lambda: dict(role="bootstrap", phase="serving", peer_id=peer_id,
                                                            dht_alive=dht.is_alive())).start()
        while not stop.wait(timeout=status_interval_s):
            logger.info(f"bootstrap peer {peer_id} serving")
    finally:
        if heartbeat is not None:
            heartbeat.stop("leaving")
        stop_dht(dht)
        if heartbeat is not None:
            heartbeat.beat(phase="left", dht_alive=False)
