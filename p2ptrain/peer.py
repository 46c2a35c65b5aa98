"""The daemons: a training worker (startup -> inner steps and syncs -> shutdown) and a DHT-only bootstrap peer (its
code is ``bootstrap_peer``; ``run_bootstrap`` is here too).

This is the one module that knows every other: it wires config, DHT, data, model and this peer's ranks together
(the loop is ``train_loop``, the data shards ``data_shards``, the ranks and their optimizer ``ranks``, the
checkpoints ``worker_checkpoints``). Both daemons stop on ``request_stop()`` (the CLI calls it on the first
SIGINT/SIGTERM) and always shut down their hivemind processes on the way out, so no p2pd or averager outlives them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from functools import partial
from typing import Any, Callable, Dict, Optional

import torch

from p2ptrain.checkpoint import resume_state
from p2ptrain.config import ConfigError, RunConfig, default_threads
from p2ptrain.data import ShardedBatches, eval_batches, phase_shortfall, token_unit
from p2ptrain.data_shards import DataShardTracker
from p2ptrain.health import Heartbeat
from p2ptrain.lifeline import follow_parent
from p2ptrain.memory import GiB, check_memory
from p2ptrain.model_source import ModelSpec, build_from_spec, resolve_model
from p2ptrain.observe import listen_problem
from p2ptrain.observe.telemetry import Telemetry, TelemetryPublisher
from p2ptrain.ranks import LocalRanks, PeerRanks, start_ranks
from p2ptrain.swarm.dht import DHTWatch, start_dht, stop_dht, visible_maddrs
from p2ptrain.swarm.progress import ProgressPublisher, wait_for_peers
from p2ptrain.swarm.reachability import connection_counts
from p2ptrain.swarm.shards import claim_shard
from p2ptrain.train_loop import TrainLoop, compile_model, evaluate_held_out
from p2ptrain.training_data import load_training_data
from p2ptrain.worker_checkpoints import WorkerCheckpoints
from p2ptrain.worker_replay import WorkerReplayer
from p2ptrain.worker_report import WorkerReport

__all__ = ["Worker", "WorkerReport", "pick_device"]

logger = logging.getLogger(__name__)


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
        self.report_path = report_path
        self.show_progress = show_progress
        self.report = WorkerReport(run_id=config.run_id, model=config.train.model)
        self.ranks: Optional[PeerRanks] = None  # from torchrun's environment, once run() starts
        self._phase = "starting"
        self._stop = threading.Event()
        self._dht = None  # set once joined: the round reports list its connections
        self._checkpoints: Optional[WorkerCheckpoints] = None  # once the ranks started
        self.telemetry: Optional[Telemetry] = None  # the leader's metrics, loggers and dashboard record
        self.metrics_port: Optional[int] = None
        """the port the Prometheus metrics are served on (``--metrics-port 0`` picks one), once started"""

    def request_stop(self) -> None:
        """Leave after the current step; a sync that is waiting for peers gives up after its current attempt."""
        self._stop.set()
        opt = self.ranks.optimizer if self.ranks is not None else None
        if opt is not None:
            opt.interrupt()

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
        train_cfg = cfg.train
        torch.set_num_threads(train_cfg.threads or default_threads())
        device = pick_device(train_cfg.device)
        # read the model, the data and the checkpoint before joining: bad input must fail before any process starts
        position = LocalRanks.from_env()
        spec = resolve_model(train_cfg.model, train_cfg.seq_len)
        data = load_training_data(train_cfg, spec, show_progress=self.show_progress and position.leader)
        self.report.model = spec.identity
        if position.world > 1:
            # torchrun starts each rank in a session of its own: if its agent is SIGKILLed, nothing else stops it
            follow_parent()
        resumed = None
        if self.resume:
            resumed = resume_state(train_cfg.checkpoint_dir, cfg.run_id, model=spec.identity,
                                   num_shards=train_cfg.num_shards, sharded_peer=position.world > 1)
        # first of the servers: a taken port is the user's to fix before anything joins the swarm
        metrics = self._start_metrics(spec) if position.leader else None
        try:
            ranks = self.ranks = start_ranks(position, device, train_cfg)
        except BaseException:
            if metrics is not None:
                metrics.close()
            raise
        checkpoints = self._checkpoints = WorkerCheckpoints(cfg, ranks, self.report)

        if train_cfg.memory_check:
            estimate = check_memory(spec, train_cfg.micro_batch_size or train_cfg.batch_size, ranks.world,
                                    train_cfg.shard_size or ranks.world, device,
                                    train_cfg.activation_checkpointing, leader=ranks.leader,
                                    mixing=self.config.diloco.target_group_size is not None,
                                    sparse=self.config.diloco.compression == "sparse")
            logger.info(f"memory (estimated): {estimate.rank_bytes / GiB:.2f} GiB per rank on {device}, "
                        f"{estimate.host_bytes / GiB:.2f} GiB on the host, {estimate.shm_bytes / GiB:.2f} GiB in "
                        "/dev/shm")

        self._phase = "joining"
        try:
            dht = self._dht = start_dht(cfg.swarm) if ranks.leader else None
        except BaseException:
            if metrics is not None:
                metrics.close()
            raise
        # the DHT process gone: leave as on a signal (DHTWatch said why; the CLI exits with 1)
        watch = DHTWatch(dht, lambda line: self.request_stop()).start() if dht is not None else None
        try:
            publisher = self._join_swarm(dht, resumed, spec) if ranks.leader else None
            shard_index = ranks.broadcast(publisher.shard_index if publisher else None)
            self.report.shard_index = shard_index
            shards = DataShardTracker(cfg.run_id, ranks, self.report, pinned=train_cfg.shard_index is not None,
                                      dht=dht, publisher=publisher)
            block_size = spec.seq_len
            batches = shards.batches = ShardedBatches(
                data.train,
                block_size=block_size,
                batch_size=train_cfg.batch_size,
                shard_index=shard_index,
                num_shards=train_cfg.num_shards,
                seed=train_cfg.seed,
                # a peer pinned to a data shard (--shard-index) stays on it; the others move on after each pass
                on_epoch_end=None if shards.pinned else shards.on_epoch_end,
            )
            shortfall = phase_shortfall(len(data.train), train_cfg.num_shards, block_size,
                                        cfg.diloco.local_steps, train_cfg.batch_size, shard_index,
                                        unit=token_unit(data.train))
            if shortfall and ranks.leader:
                logger.warning(shortfall)
            held_out = eval_batches(data.held_out, block_size, train_cfg.batch_size, train_cfg.eval_batches)

            model = build_from_spec(spec, seed=train_cfg.seed).to(device)
            model.activation_checkpointing = train_cfg.activation_checkpointing
            self.report.num_parameters = model.num_parameters()
            # the replay check: a replica of the model and the data to redo others' phases with (worker_replay.py)
            replayer = WorkerReplayer(batches, build_from_spec(spec, seed=train_cfg.seed).to(device), train_cfg,
                                      device, pinned=shards.pinned) if cfg.diloco.replay_rate > 0 else None
            ranks.build_optimizer(model, cfg, dht, publisher, replayer)
            if ranks.leader:
                logger.info(f"[{self.report.peer_id}] joined run {cfg.run_id!r}")
                self.telemetry = self._open_telemetry(metrics, dht, publisher)
            if train_cfg.compile:  # after sharding: FSDP2's hooks are in place, and compiled around
                compile_model(model)
            opt = ranks.optimizer
            if self._stop.is_set():  # a signal arrived while the optimizer was being built
                opt.interrupt()
            if resumed is not None:
                checkpoints.restore(resumed, model, batches)
            if train_cfg.wait_for_peers:
                if ranks.leader:
                    wait_for_peers(dht, cfg.run_id, train_cfg.wait_for_peers, self._stop)
                ranks.broadcast(None)  # the other ranks wait for the leader here
            joined_rounds = self._catch_up()
            shards.continue_from_cursor()
            shards.note("resumed" if resumed is not None else "claimed")
            evaluate = partial(evaluate_held_out, model, held_out, device, train_cfg.precision)
            self.report.initial_eval_loss = evaluate()
            self.report.start_outer_step = opt.outer_step
            if ranks.leader:
                for record in joined_rounds:
                    self._report_round(record, batches, self.report.initial_eval_loss)
            logger.info(
                f"[{self.report.peer_id}] model {train_cfg.model} ({self.report.num_parameters:,} parameters) on "
                f"{device} x {ranks.world} rank(s), shard {shard_index}/{train_cfg.num_shards}, "
                f"eval loss {self.report.initial_eval_loss:.4f}"
            )
            checkpoints.parts = (model, batches, spec, data.tokenizer)
            self._phase = "training"
            loop = TrainLoop(train_cfg, ranks, self.report, stop=self._stop, show_progress=self.show_progress,
                             started=started, after_round=lambda: self._after_round(model, shards, evaluate),
                             evaluate=evaluate if train_cfg.eval_every else None, telemetry=self.telemetry)
            loop.run(model, replayer.track(batches) if replayer is not None else batches, device)
            if watch is not None and watch.lost:
                self.report.stopped_by = "dht_lost"
            self._phase = "leaving"
            shards.flush()  # the last commit's data cursors, before the DHT goes
            # only on a normal exit (done or signalled): after an exception the state may be half-updated
            checkpoints.save("exit")
        finally:
            self._phase = "leaving"
            if ranks.optimizer is not None:
                ranks.optimizer.close()
            if self.telemetry is not None:
                self.telemetry.close()
            elif metrics is not None:
                metrics.close()
            if dht is not None:
                watch.stop()
                stop_dht(dht)
            ranks.end()
            self.report.wall_s = time.monotonic() - started
            self._write_report()
        return self.report

    def _join_swarm(self, dht, resumed: Optional[dict], spec: ModelSpec) -> ProgressPublisher:
        """Log who we are and how to reach us, and settle which data shard this peer trains on."""
        cfg = self.config
        peer_id = dht.peer_id.to_base58()
        self.report.peer_id = peer_id
        self.report.reachability = str(dht.reachability) if getattr(dht, "reachability", None) else ""
        # not "joined" yet: the run's live peers may still refuse this one's settings (DiLoCoOptimizer.start)
        logger.info(f"[{peer_id}] in the swarm; other peers can join through:")
        self.report.maddrs = [str(maddr) for maddr in visible_maddrs(dht)]
        for maddr in self.report.maddrs:
            logger.info(f"[{peer_id}]   {maddr}")
        # the whole config is one long line (1,800 characters with the defaults): in the report, and at -v
        self.report.config = cfg.to_dict()
        self._write_report()
        logger.debug(f"[{peer_id}] effective config: {json.dumps(self.report.config, sort_keys=True)}")
        publisher = ProgressPublisher(dht, cfg.run_id)
        # the model in words (a refused newcomer is told what differs; its identity covers a Hugging Face model's
        # whole architecture config) and this worker's own settings (status)
        publisher.settings = dict(
            model=spec.identity, n_layer=spec.n_layer, n_embd=spec.n_embd, n_head=spec.n_head,
            block_size=spec.seq_len, vocab_size=spec.vocab_size, seed=cfg.train.seed,
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

    def _catch_up(self) -> list:
        """A peer that starts behind the swarm (joining mid-run, resuming late) takes the state from live peers
        first, so it never averages a pseudo-gradient computed from stale parameters. Returns the SyncRecords of
        the rounds it joined meanwhile (on the leader)."""
        opt = self.ranks.optimizer
        started, records_before = time.monotonic(), len(opt.history)
        if self.ranks.catch_up(self.report.peer_id):
            self.report.outer_steps = opt.outer_step
            self.report.local_steps = opt.local_step
            self.report.state_download_s = time.monotonic() - started
            self.report.state_download = opt.last_download
            if self.telemetry is not None and opt.last_download:
                self.telemetry.state_taken(seconds=opt.last_download["seconds"],
                                           num_bytes=opt.last_download["bytes"])
        return [r for r in opt.history[records_before:] if r.averaged]

    def _after_round(self, model: torch.nn.Module, shards: DataShardTracker, evaluate: Callable[[], float]) -> None:
        """After a round that moved the outer step, on every rank: data shards and their cursors, the checkpoint
        every ``checkpoint_every`` outer steps, the held-out eval, the report."""
        opt = self.ranks.optimizer
        shards.after_commit()  # it may move to another data shard
        if opt.outer_step % self.config.train.checkpoint_every == 0:
            self._checkpoints.save(f"outer step {opt.outer_step}")
        eval_started = time.perf_counter()
        eval_loss = evaluate()  # on every rank: a sharded forward
        eval_s = time.perf_counter() - eval_started
        model.train()
        self.report.outer_steps = opt.outer_step
        self.report.final_eval_loss = eval_loss
        if self.ranks.leader:
            self._report_round(opt.history[-1], shards.batches, eval_loss, eval_s)

    def _report_round(self, record, batches: ShardedBatches, eval_loss: float, eval_s: float = 0.0) -> None:
        connections = connection_counts(self._dht) if self._dht is not None else None
        opt = self.ranks.optimizer
        schedule = {"local_step": opt.local_step, "inner_lr": opt.param_groups[0]["lr"]}
        outer = getattr(opt, "diloco", opt)  # a sharded peer's leader holds the swarm-side optimizer
        if outer is not None:
            schedule["outer_lr"] = outer.outer_optimizer.param_groups[0]["lr"]
        self.report.add_round(record, batches, eval_loss, eval_s, connections, schedule)
        if self.telemetry is not None:
            self.telemetry.round(self.report.rounds[-1])
        self._write_report()

    # ------------------------------------------------------------------------------------------- observability

    def _start_metrics(self, spec: ModelSpec):
        """The Prometheus endpoint (--metrics-port), or None when it is off. Raises PortUnavailable for a taken port."""
        observe = self.config.observe
        if observe.metrics_port is None:
            return None
        from p2ptrain.observe.metrics import WorkerMetrics

        metrics = WorkerMetrics(run_id=self.config.run_id, model=spec.identity,
                                compression=self.config.diloco.compression)
        try:
            metrics.start(observe.metrics_host, observe.metrics_port)
        except OSError as e:
            raise listen_problem("--metrics-port", observe.metrics_host, observe.metrics_port, e) from None
        self.metrics_port = metrics.port
        logger.info(f"Prometheus metrics at {metrics.url(observe.metrics_host)}")
        return metrics

    def _open_telemetry(self, metrics, dht, publisher: ProgressPublisher) -> Telemetry:
        """The leader's sinks: the metrics started earlier, the --log-to loggers, and the record dashboards read."""
        opt = self.ranks.optimizer
        outer = getattr(opt, "diloco", opt)  # a sharded peer's leader holds the swarm-side optimizer
        averager = outer.averager
        peer_id = self.report.peer_id
        if metrics is not None:
            metrics.set_peer(peer_id)
            metrics.watch(peers_known=lambda: publisher.live_peers, bans_total=lambda: averager.bans_total,
                          banned_now=lambda: len(averager.banned_peers), states_served=lambda: averager.states_served,
                          state_bytes_served=lambda: averager.state_bytes_served,
                          group_lookups=lambda: averager.group_lookups)
        loggers = None
        if self.config.observe.log_to:
            from p2ptrain.observe.log_targets import parse_log_to
            from p2ptrain.observe.loggers import TrainingLoggers

            loggers = TrainingLoggers([parse_log_to(spec) for spec in self.config.observe.log_to],
                                      run_id=self.config.run_id, peer_id=peer_id, config=self.config.to_dict())
            loggers.open()
        sources = dict(banned=lambda: averager.banned_peers, states_served=lambda: averager.states_served,
                       states_taken=lambda: outer.states_taken)
        return Telemetry(metrics=metrics, loggers=loggers, publisher=TelemetryPublisher(dht, self.config.run_id),
                         sources=sources)

    def _write_report(self) -> None:
        """Write the report (after start-up, after every round, at exit), so it can be watched. The leader writes it
        for a peer of several ranks."""
        if self.report_path and (self.ranks is None or self.ranks.leader):
            check = getattr(getattr(self.ranks, "diloco", None), "replay_check", None)
            if check is not None:  # its replays run beside training: as far as they got
                self.report.replay = check.figures()
            self.report.write(self.report_path)
