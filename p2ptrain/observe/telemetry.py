"""Where a worker's numbers go besides its report: ``Telemetry`` takes each inner step, round, eval and state download
from the Worker and hands it to what is on: Prometheus metrics (metrics.py), training loggers (loggers.py) and the
``PeerTelemetry`` record this peer publishes in the DHT for dashboards (``TelemetryPublisher``; read back with
``fetch_telemetry``).

DHT layout: key ``"<run_id>_telemetry"``, subkey = the publishing peer's id, value = a serialized ``PeerTelemetry``
(proto/p2ptrain.proto). Like a progress record it is signed by the peer's identity, and in a private run tagged with
the swarm key (security.py), so a dashboard without the key reads nothing of the run. It holds a bounded recent
window (the ``MAX_*`` below); it is rewritten at most every ``period_s`` (after a round or an inner step), and
expires after ``3 x period_s`` when the peer is gone. Records come from other peers: one that is too large, names
another peer or run, or holds more points than the limits is logged and skipped, never raised.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from typing import Any, Callable, Dict, List, Optional

from p2ptrain.proto.p2ptrain_pb2 import LossPoint, PeerTelemetry, RoundPoint
from p2ptrain.swarm.pipe import RECORD_MAX_BYTES

logger = logging.getLogger(__name__)

MAX_LOSSES, MAX_EVALS, MAX_ROUNDS, MAX_BANNED = 128, 64, 64, 64
MAX_RECORD_BYTES = 64 * 1024
"""the largest record a reader takes (older peers stored up to this)"""
LOSS_SAMPLE_S = 1.0
"""at most one training-loss point a second goes into the record's window (a dashboard polls every few seconds)"""


def telemetry_key(run_id: str) -> str:
    return f"{run_id}_telemetry"


class TelemetryPublisher:
    """Keeps this peer's recent window and stores it in the DHT (``publish``: non-blocking, as progress records)."""

    def __init__(self, dht, run_id: str, *, period_s: float = 10.0):
        self.dht, self.run_id, self.period_s = dht, run_id, period_s
        self.losses: collections.deque = collections.deque(maxlen=MAX_LOSSES)
        self.evals: collections.deque = collections.deque(maxlen=MAX_EVALS)
        self.rounds: collections.deque = collections.deque(maxlen=MAX_ROUNDS)
        self.tokens_per_s = 0.0
        self.data_position = (0, 0)
        self.banned: List[str] = []
        self.states_served = self.states_taken = 0
        self._last_published = -math.inf
        self._last_loss_at = -math.inf

    def add_loss(self, local_step: int, loss: float) -> None:
        now = time.time()
        if now - self._last_loss_at >= LOSS_SAMPLE_S and math.isfinite(loss):
            self._last_loss_at = now
            self.losses.append(LossPoint(local_step=local_step, loss=loss, time=now))

    def add_eval(self, local_step: int, eval_loss: float) -> None:
        if math.isfinite(eval_loss):
            self.evals.append(LossPoint(local_step=local_step, loss=eval_loss, time=time.time()))

    def add_round(self, entry: Dict[str, Any]) -> None:
        phases = entry.get("phases", {})
        self.rounds.append(RoundPoint(
            outer_step=entry["outer_step"], finished_at=entry.get("finished_at", time.time()),
            group_size=entry.get("group_size", 1), seconds=entry.get("seconds", 0.0),
            matchmaking_s=phases.get("matchmaking", 0.0), allreduce_s=entry.get("allreduce_s", 0.0),
            bytes_sent=entry.get("bytes_sent", 0), bytes_received=entry.get("bytes_received", 0),
            averaged=bool(entry.get("averaged")), caught_up=bool(entry.get("caught_up"))))
        if entry.get("eval_loss") is not None and entry.get("local_step") is not None:
            self.add_eval(entry["local_step"], entry["eval_loss"])
        if entry.get("data_position"):
            self.data_position = tuple(entry["data_position"])

    def due(self) -> bool:
        return time.monotonic() - self._last_published >= self.period_s

    def record(self, peer_id: str, timestamp: float) -> PeerTelemetry:
        """The record to store: the windows, their oldest points left out while it is over RECORD_MAX_BYTES
        (swarm/pipe.py: why; full windows with 64 banned peers come to about 11 KB)."""
        record = self._whole_record(peer_id, timestamp)
        while record.ByteSize() > RECORD_MAX_BYTES:
            longest = max((record.losses, record.evals, record.rounds, record.banned), key=len)
            del longest[:max(1, len(longest) // 4)]
        return record

    def _whole_record(self, peer_id: str, timestamp: float) -> PeerTelemetry:
        epoch, sample = self.data_position
        return PeerTelemetry(
            run_id=self.run_id, peer_id=peer_id, timestamp=timestamp, losses=list(self.losses),
            evals=list(self.evals), rounds=list(self.rounds), tokens_per_s=self.tokens_per_s, data_epoch=epoch,
            data_sample=sample, banned=self.banned[:MAX_BANNED], states_served=self.states_served,
            states_taken=self.states_taken)

    def publish(self) -> None:
        """Store the window now (in the background: a failed store only delays the dashboard)."""
        from hivemind.utils import get_dht_time

        self._last_published = time.monotonic()
        record = self.record(self.dht.peer_id.to_base58(), get_dht_time())
        try:
            self.dht.store(telemetry_key(self.run_id), record.SerializeToString(),
                           expiration_time=get_dht_time() + 3 * self.period_s, subkey=self.dht.peer_id.to_bytes(),
                           return_future=True)
        except Exception as e:  # the DHT is shutting down
            logger.debug(f"Could not publish the telemetry record: {e!r}")


def fetch_telemetry(dht, run_id: str, timeout_s: float = 10.0) -> Dict[str, PeerTelemetry]:
    """The run's live peers' telemetry records by peer id; malformed ones are logged and skipped."""
    from hivemind.utils import ValueWithExpiration

    from p2ptrain.swarm.progress import subkey_peer_id

    try:
        found = dht.get(telemetry_key(run_id), latest=True, return_future=True).result(timeout=timeout_s)
    except Exception as e:
        logger.warning(f"Could not read the telemetry of run {run_id!r} from the DHT: {e!r}")
        return {}
    if found is None or not isinstance(found.value, dict):
        return {}
    records = {}
    for subkey, entry in found.value.items():
        if not isinstance(entry, ValueWithExpiration) or not isinstance(entry.value, bytes) or not entry.value:
            continue
        record = parse_telemetry(entry.value, run_id, subkey_peer_id(subkey))
        if record is not None:
            records[record.peer_id] = record
    return records


def parse_telemetry(value: bytes, run_id: str, subkey_peer: Optional[str]) -> Optional[PeerTelemetry]:
    """One record, checked; None (and a log line saying why) for anything unsound."""
    if len(value) > MAX_RECORD_BYTES:
        logger.warning(f"Ignoring a telemetry record of {len(value)} bytes (the limit is {MAX_RECORD_BYTES})")
        return None
    try:
        record = PeerTelemetry.FromString(value)
    except Exception as e:  # DecodeError, or a RuntimeWarning-free garbage message
        logger.warning(f"Ignoring a telemetry record that does not parse: {e}")
        return None
    if subkey_peer is None or record.peer_id != subkey_peer:
        logger.warning(f"Ignoring a telemetry record for {record.peer_id!r} stored under another peer's subkey")
        return None
    if record.run_id != run_id:
        logger.warning(f"Ignoring a telemetry record of run {record.run_id!r} under run {run_id!r}")
        return None
    limits = ((record.losses, MAX_LOSSES), (record.evals, MAX_EVALS), (record.rounds, MAX_ROUNDS),
              (record.banned, MAX_BANNED))
    if any(len(items) > limit for items, limit in limits):
        logger.warning(f"Ignoring a telemetry record from {record.peer_id} with more points than the limits")
        return None
    return record


class Telemetry:
    """Fans a worker's steps, rounds, evals and state downloads out to the sinks that are on (each may be None).
    Called on the leader rank only, from the training thread; ``sources`` are read when publishing (bans, states
    served: the averager's counters)."""

    def __init__(self, *, metrics=None, loggers=None, publisher: Optional[TelemetryPublisher] = None,
                 sources: Optional[Dict[str, Callable[[], Any]]] = None):
        self.metrics, self.loggers, self.publisher = metrics, loggers, publisher
        self.sources = sources or {}

    def step(self, *, local_step: int, outer_step: int, loss: float, samples: int, tokens: int,
             tokens_per_s: float, inner_lr: Optional[float], outer_lr: Optional[float]) -> None:
        if self.metrics is not None:
            self.metrics.step(loss=loss, samples=samples, tokens=tokens, tokens_per_s=tokens_per_s,
                              local_step=local_step, outer_step=outer_step, inner_lr=inner_lr, outer_lr=outer_lr)
        if self.loggers is not None:
            scalars = {"train/loss": loss, "train/tokens_per_s": tokens_per_s, "train/outer_step": outer_step}
            if inner_lr is not None:
                scalars["train/inner_lr"] = inner_lr
            if outer_lr is not None:
                scalars["train/outer_lr"] = outer_lr
            self.loggers.scalars(scalars, step=local_step)
        if self.publisher is not None:
            self.publisher.tokens_per_s = tokens_per_s
            self.publisher.add_loss(local_step, loss)
            if self.publisher.due():
                self._publish()

    def round(self, entry: Dict[str, Any]) -> None:
        """One ``WorkerReport.rounds`` entry (a SyncRecord with the eval loss and data position after it)."""
        if self.metrics is not None:
            self.metrics.round(entry)
        if self.loggers is not None and entry.get("local_step") is not None:
            phases = entry.get("phases", {})
            scalars = {"sync/seconds": entry.get("seconds", 0.0), "sync/group_size": entry.get("group_size", 1),
                       "sync/bytes_sent": entry.get("bytes_sent", 0),
                       "sync/bytes_received": entry.get("bytes_received", 0),
                       "sync/matchmaking_s": phases.get("matchmaking", 0.0),
                       "sync/allreduce_s": phases.get("allreduce", entry.get("allreduce_s", 0.0)),
                       "sync/outer_step": entry["outer_step"]}
            if entry.get("eval_loss") is not None:
                scalars["eval/loss"] = entry["eval_loss"]
                scalars["eval/perplexity"] = entry["perplexity"]
            if entry.get("outer_lr") is not None:
                scalars["train/outer_lr"] = entry["outer_lr"]
            self.loggers.scalars(scalars, step=entry["local_step"])
        if self.publisher is not None:
            self.publisher.add_round(entry)
            if self.publisher.due():  # at most every period: rounds of short phases came every 1-2 s
                self._publish()

    def eval(self, entry: Dict[str, Any]) -> None:
        """One ``WorkerReport.evals`` entry (--eval-every)."""
        if self.metrics is not None:
            self.metrics.eval(entry)
        if self.loggers is not None:
            self.loggers.scalars({"eval/loss": entry["eval_loss"], "eval/perplexity": entry["perplexity"]},
                                 step=entry["local_step"])
        if self.publisher is not None:
            self.publisher.add_eval(entry["local_step"], entry["eval_loss"])

    def state_taken(self, *, seconds: float, num_bytes: int) -> None:
        if self.metrics is not None:
            self.metrics.state_taken(seconds=seconds, num_bytes=num_bytes)

    def _publish(self) -> None:
        publisher = self.publisher
        for name, read in self.sources.items():
            try:
                setattr(publisher, name, read())
            except Exception as e:  # the averager is gone (shutting down): keep the last value
                logger.debug(f"telemetry source {name}: {e!r}")
        publisher.publish()

    def close(self) -> None:
        if self.loggers is not None:
            self.loggers.close()
        if self.metrics is not None:
            self.metrics.close()
