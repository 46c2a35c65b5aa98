"""Prometheus metrics of a daemon (``--metrics-port``): a worker's training and syncs, the bootstrap peer's view of
the swarm. Each daemon has a registry of its own (not prometheus_client's global one), served by the official
client's HTTP server; the names follow Prometheus conventions (``p2ptrain_`` prefix, ``_total`` counters, base units
``_seconds`` and ``_bytes``).

Counters only go up while the process lives: a worker that resumes from a checkpoint starts them at 0 again, as
Prometheus expects of a restarted process (``rate()`` handles the reset). Gauges are set when the training loop
reports (every inner step, every round) or read when Prometheus scrapes (peers known, peers excluded, states served)."""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Dict, Iterable, Optional

from p2ptrain.observe import require

logger = logging.getLogger(__name__)

SYNC_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
"""histogram buckets of a sync's seconds: a tiny model on loopback (0.1 s) to a 1B model over home links (minutes)"""

ROUND_OUTCOMES = ("committed", "partial", "repaired", "solo", "behind", "abandoned")
"""``p2ptrain_rounds_total{outcome}``: averaged with a group; averaged, but a reducer failed mid-round and part of
the vector is this peer's own; averaged, then the group's digests differed and the state was taken anew; no group
formed and the peer applied its own pseudo-gradient; the swarm had moved on and the peer took its state; no group
while leaving, no outer step taken"""


def round_outcome(entry: Dict[str, Any]) -> str:
    """The ``ROUND_OUTCOMES`` label of a round (a ``WorkerReport.rounds`` entry, i.e. a SyncRecord as a dict)."""
    if entry.get("caught_up"):
        return "behind"
    if entry.get("abandoned"):
        return "abandoned"
    if not entry.get("averaged"):
        return "solo"
    if entry.get("repaired"):
        return "repaired"
    return "partial" if entry.get("failed_fraction", 0.0) > 0 else "committed"


def _finite(value: Optional[float]) -> float:
    return value if value is not None and math.isfinite(value) else math.nan


class MetricsServer:
    """A registry served at ``http://host:port/metrics`` from a daemon thread. ``start`` raises OSError when the
    port is taken (the CLI turns that into a one-line error); ``port`` is the bound one (``--metrics-port 0``)."""

    def __init__(self, *, feature: str = "--metrics-port"):
        self.prom = require("prometheus_client", extra="metrics", feature=feature)
        self.registry = self.prom.CollectorRegistry(auto_describe=True)
        self._server = self._thread = None
        self.port: Optional[int] = None

    def start(self, host: str, port: int) -> "MetricsServer":
        self._server, self._thread = self.prom.start_http_server(port, addr=host, registry=self.registry)
        self.port = self._server.server_port
        return self

    def url(self, host: str) -> str:
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = self._thread = None

    def read_at_scrape(self, name: str, documentation: str, read: Callable[[], Optional[float]], *,
                       counter: bool = False) -> None:
        """A gauge, or a counter kept elsewhere (the averager process counts bans), whose value is ``read()`` when
        Prometheus scrapes: NaN for a gauge, nothing for a counter, when it returns None or fails."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        family = CounterMetricFamily if counter else GaugeMetricFamily

        class Reader:
            def describe(self):
                return [family(name, documentation)]

            def collect(self):
                try:
                    value = read()
                except Exception as e:  # a scrape must not fail because one source is gone (the averager at exit)
                    logger.debug(f"metric {name}: {e!r}")
                    value = None
                if value is None and counter:
                    return []
                return [family(name, documentation, value=_finite(value))]

        self.registry.register(Reader())


class WorkerMetrics(MetricsServer):
    """A training worker's metrics. The Worker calls ``step``, ``round``, ``eval`` and ``state_taken`` (through
    ``observe.telemetry.Telemetry``); ``watch`` attaches the live sources read at scrape time."""

    def __init__(self, *, run_id: str, model: str, compression: str):
        super().__init__()
        prom, r = self.prom, self.registry
        self._about = dict(run_id=run_id, peer_id="", model=model, compression=compression)
        self.info = prom.Info("p2ptrain_worker", "this worker: run, peer id, model, codec", registry=r)
        self.info.info(self._about)
        self.inner_steps = prom.Counter("p2ptrain_inner_steps", "inner (AdamW) steps taken by this process",
                                        registry=r)
        self.samples = prom.Counter("p2ptrain_samples", "training samples (sequences) seen by this process",
                                    registry=r)
        self.tokens = prom.Counter("p2ptrain_tokens", "training tokens seen by this process", registry=r)
        self.tokens_per_s = prom.Gauge("p2ptrain_tokens_per_second",
                                       "training throughput over the last reporting period (syncs included)",
                                       registry=r)
        self.loss = prom.Gauge("p2ptrain_loss", "training loss of the last inner step", registry=r)
        self.eval_loss = prom.Gauge("p2ptrain_eval_loss", "held-out loss at the last eval", registry=r)
        self.lr = prom.Gauge("p2ptrain_learning_rate", "learning rate the next step uses", ["optimizer"], registry=r)
        self.outer_step = prom.Gauge("p2ptrain_outer_step", "the run's outer step this peer holds", registry=r)
        self.local_step = prom.Gauge("p2ptrain_local_step", "the inner step count of the run this peer is at",
                                     registry=r)
        self.rounds = prom.Counter("p2ptrain_rounds", "syncs by outcome (see observe/metrics.py ROUND_OUTCOMES)",
                                   ["outcome"], registry=r)
        for outcome in ROUND_OUTCOMES:
            self.rounds.labels(outcome=outcome)  # every outcome exported from the start, at 0
        self.failed_attempts = prom.Counter("p2ptrain_round_failed_attempts",
                                            "matchmaking or all-reduce attempts that did not average (retried)",
                                            registry=r)
        self.sync_seconds = prom.Histogram("p2ptrain_sync_seconds", "wall seconds of a whole sync",
                                           buckets=SYNC_BUCKETS_S, registry=r)
        self.phase_seconds = prom.Counter("p2ptrain_sync_phase_seconds",
                                          "seconds of syncs by phase (matchmaking, allreduce, pseudo_gradient, "
                                          "outer_step, digest, ...; state_transfer for downloads)",
                                          ["phase"], registry=r)
        self.allreduce_cpu = prom.Counter("p2ptrain_allreduce_cpu_seconds",
                                          "CPU seconds inside all-reduces by part (encode, decode, checks of the "
                                          "received parts, write), spread over threads that overlap the wire",
                                          ["part"], registry=r)
        self.sent = prom.Counter("p2ptrain_sync_sent_bytes", "bytes this peer sent in all-reduces", registry=r)
        self.received = prom.Counter("p2ptrain_sync_received_bytes", "bytes this peer received in all-reduces",
                                     registry=r)
        self.group_size = prom.Gauge("p2ptrain_group_size", "peers in the last sync's group (1: alone)", registry=r)
        self.states_taken = prom.Counter("p2ptrain_state_transfers_taken", "state downloads from donors",
                                         registry=r)
        self.state_bytes_taken = prom.Counter("p2ptrain_state_taken_bytes", "bytes of state downloaded",
                                              registry=r)
        self.data_shard = prom.Gauge("p2ptrain_data_shard", "the data shard this peer trains on", registry=r)
        self.data_epoch = prom.Gauge("p2ptrain_data_epoch", "full passes over its current shard", registry=r)
        self.data_position = prom.Gauge("p2ptrain_data_position_samples", "the sample within the current pass",
                                        registry=r)

    def set_peer(self, peer_id: str) -> None:
        """The peer id, once the DHT has started (the endpoint is up before: a taken port fails first)."""
        self.info.info(dict(self._about, peer_id=peer_id))

    def watch(self, *, peers_known: Callable[[], Optional[float]], bans_total: Callable[[], Optional[float]],
              banned_now: Callable[[], Optional[float]], states_served: Callable[[], Optional[float]],
              state_bytes_served: Callable[[], Optional[float]], group_lookups: Callable[[], Optional[float]]) -> None:
        """Attach what is read when Prometheus scrapes (the optimizer and its averager process keep these)."""
        self.read_at_scrape("p2ptrain_peers_known", "live peers of the run at the last look, this one included",
                            peers_known)
        self.read_at_scrape("p2ptrain_peers_banned", "peers this peer excludes now for misbehaving", banned_now)
        self.read_at_scrape("p2ptrain_peer_bans", "exclusions of misbehaving peers so far", bans_total, counter=True)
        self.read_at_scrape("p2ptrain_state_transfers_served", "state transfers answered for newcomers",
                            states_served, counter=True)
        self.read_at_scrape("p2ptrain_state_served_bytes", "bytes of state served to newcomers", state_bytes_served,
                            counter=True)
        self.read_at_scrape("p2ptrain_group_lookups", "DHT lookups of a round's group key made by matchmaking",
                            group_lookups, counter=True)

    def step(self, *, loss: float, samples: int, tokens: int, tokens_per_s: float, local_step: int, outer_step: int,
             inner_lr: Optional[float], outer_lr: Optional[float]) -> None:
        self.inner_steps.inc()
        self.samples.inc(samples)
        self.tokens.inc(tokens)
        self.tokens_per_s.set(tokens_per_s)
        self.loss.set(_finite(loss))
        self.local_step.set(local_step)
        self.outer_step.set(outer_step)
        if inner_lr is not None:
            self.lr.labels(optimizer="inner").set(inner_lr)
        if outer_lr is not None:
            self.lr.labels(optimizer="outer").set(outer_lr)

    def round(self, entry: Dict[str, Any]) -> None:
        """One ``WorkerReport.rounds`` entry."""
        outcome = round_outcome(entry)
        self.rounds.labels(outcome=outcome).inc()
        self.failed_attempts.inc(max(entry.get("attempts", 1) - (outcome in ("committed", "partial", "repaired")),
                                     0))
        self.outer_step.set(entry["outer_step"])
        if not entry.get("caught_up"):  # a catch-up's seconds are the state transfer's, counted by state_taken
            self.sync_seconds.observe(entry.get("seconds", 0.0))
            for phase, seconds in entry.get("phases", {}).items():
                if phase.startswith("allreduce."):  # the all-reduce's inner split overlaps the wire: its own metric
                    self.allreduce_cpu.labels(part=phase.split(".", 1)[1]).inc(max(seconds, 0.0))
                else:
                    self.phase_seconds.labels(phase=phase).inc(max(seconds, 0.0))
        self.sent.inc(entry.get("bytes_sent", 0))
        self.received.inc(entry.get("bytes_received", 0))
        self.group_size.set(entry.get("group_size", 1))
        if entry.get("eval_loss") is not None:
            self.eval_loss.set(_finite(entry["eval_loss"]))
        if entry.get("shard_index") is not None:
            self.data_shard.set(entry["shard_index"])
        if entry.get("data_position"):
            epoch, position = entry["data_position"]
            self.data_epoch.set(epoch)
            self.data_position.set(position)

    def eval(self, entry: Dict[str, Any]) -> None:
        self.eval_loss.set(_finite(entry["eval_loss"]))

    def state_taken(self, *, seconds: float, num_bytes: int) -> None:
        self.states_taken.inc()
        self.state_bytes_taken.inc(num_bytes)
        self.phase_seconds.labels(phase="state_transfer").inc(seconds)


class SwarmMetrics(MetricsServer):
    """The bootstrap peer's view of the swarm, from the run's progress records (``update`` after each look)."""

    def __init__(self):
        super().__init__()
        prom, r = self.prom, self.registry
        self.info = prom.Info("p2ptrain_bootstrap", "this bootstrap peer", registry=r)
        self.peers = prom.Gauge("p2ptrain_swarm_peers", "live training peers by mode (public: can be dialled and "
                                "reduce; client: behind NAT)", ["run_id", "mode"], registry=r)
        self.outer_step = prom.Gauge("p2ptrain_swarm_outer_step", "the highest outer step among the live peers",
                                     ["run_id"], registry=r)
        self.min_outer_step = prom.Gauge("p2ptrain_swarm_min_outer_step",
                                         "the lowest outer step among the live peers", ["run_id"], registry=r)
        self.samples_per_s = prom.Gauge("p2ptrain_swarm_samples_per_second",
                                        "the live peers' training throughput, summed", ["run_id"], registry=r)
        self.looks = prom.Counter("p2ptrain_swarm_looks", "reads of the swarm's progress records", ["run_id"],
                                  registry=r)

    def set_peer(self, peer_id: str) -> None:
        self.info.info(dict(peer_id=peer_id))

    def update(self, run_id: str, records: Iterable[Any]) -> None:
        """``records``: the run's live PeerProgress records."""
        records = list(records)
        from p2ptrain.swarm.relays import peer_mode

        for mode in ("public", "relayed", "client"):
            self.peers.labels(run_id=run_id, mode=mode).set(sum(peer_mode(r) == mode for r in records))
        steps = [r.outer_step for r in records]
        self.outer_step.labels(run_id=run_id).set(max(steps) if steps else math.nan)
        self.min_outer_step.labels(run_id=run_id).set(min(steps) if steps else math.nan)
        self.samples_per_s.labels(run_id=run_id).set(sum(r.samples_per_s for r in records))
        self.looks.labels(run_id=run_id).inc()
