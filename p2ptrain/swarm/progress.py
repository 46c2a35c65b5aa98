"""Progress records: each training peer publishes a ``PeerProgress`` message in the DHT, ``status`` reads them.

DHT layout: key ``"<run_id>_progress"``, subkey = the publishing peer's id (bytes), value = the serialized
``PeerProgress`` (proto/p2ptrain.proto). A record expires ``expiration_s`` after it was written, so peers that
stopped refreshing vanish from the listing on their own.

Records come from other peers: anything that does not parse, names another peer or run, or carries impossible
numbers is logged and skipped, never raised.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from typing import List, Optional

from google.protobuf.message import DecodeError
from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration, get_dht_time

from p2ptrain.proto.p2ptrain_pb2 import PeerProgress

logger = logging.getLogger(__name__)


def progress_key(run_id: str) -> str:
    return f"{run_id}_progress"


class RunMismatch(ValueError):
    """This peer's model or settings differ from the run's live peers'; the message names each difference."""


SETTINGS = ("params_schema", "local_steps", "compression", "protocol")
"""the PeerProgress fields every peer of a run must agree on"""


def check_run_settings(mine: dict, records: List[PeerProgress], run_id: str) -> None:
    """Raise RunMismatch if ``mine`` (SETTINGS -> value) differs from what most live peers publish."""
    others = [r for r in records if r.params_schema]  # records of peers before protocol 3 carry no settings
    if not others:
        return
    differences = []
    for name in SETTINGS:
        values = Counter(getattr(r, name) for r in others)
        theirs, count = values.most_common(1)[0]
        if theirs != mine[name]:
            differences.append(f"{name} {mine[name]!r} here, {theirs!r} on {count} of {len(others)} live peer(s)")
    if differences:
        raise RunMismatch(f"this peer does not match run {run_id!r}: {'; '.join(differences)}; start it with the "
                          "run's model and settings, or under another --run-id")


class ProgressPublisher:
    """Publishes one peer's progress, at most once per ``period_s`` unless forced. Never blocks training."""

    def __init__(self, dht: DHT, run_id: str, *, period_s: float = 5.0, client_mode: bool = False):
        self.dht, self.run_id, self.period_s, self.client_mode = dht, run_id, period_s, client_mode
        # a record outlives a few missed refreshes, not much more: status should drop dead peers quickly
        self.expiration_s = max(3 * period_s, 30.0)
        self._last_published = -math.inf
        self._last_expiration = 0.0
        self.shard_index: Optional[int] = None
        """the data shard this peer claimed, published with every record (see swarm/shards.py)"""
        self.reachability = ""
        """how this peer chose public or client mode (swarm/reachability.py), published for status"""
        self.settings: dict = {}
        """SETTINGS -> this peer's value, published with every record (set by DiLoCoOptimizer)"""

    def due(self) -> bool:
        return time.monotonic() - self._last_published >= self.period_s

    def publish(self, *, outer_step: int, local_step: int, samples_per_s: float, samples_since_sync: int) -> None:
        record = PeerProgress(
            run_id=self.run_id,
            peer_id=self.dht.peer_id.to_base58(),
            outer_step=outer_step,
            local_step=local_step,
            samples_per_s=samples_per_s,
            timestamp=get_dht_time(),
            samples_since_sync=samples_since_sync,
            client_mode=self.client_mode,
            reachability=self.reachability,
            shard_index=self.shard_index,
            **self.settings,
        )
        self._store(record.SerializeToString(), get_dht_time() + self.expiration_s)
        self._last_published = time.monotonic()

    def withdraw(self, timeout_s: float = 5.0) -> None:
        """Overwrite our record with an empty one, so we leave `status` on a clean exit. Waits (bounded) for the
        store: the caller usually shuts the DHT down next, which would drop a store still in flight."""
        # the DHT keeps whichever value of a subkey expires last, so the empty record must outlive the last real one
        expiration = max(self._last_expiration, get_dht_time()) + 1.0
        try:
            self._store(b"", expiration).result(timeout=timeout_s)
        except Exception as e:
            logger.debug(f"Could not withdraw the progress record: {e!r}")

    def _store(self, value: bytes, expiration_time: float):
        # return_future: the DHT process stores it in the background; a failed store only delays the listing
        self._last_expiration = max(self._last_expiration, expiration_time)
        return self.dht.store(
            progress_key(self.run_id),
            value,
            expiration_time=expiration_time,
            subkey=self.dht.peer_id.to_bytes(),
            return_future=True,
        )


def fetch_progress(dht: DHT, run_id: str, timeout_s: float = 10.0) -> List[PeerProgress]:
    """The run's live peers' latest records, sorted by peer id. Malformed records are logged and skipped."""
    try:
        found = dht.get(progress_key(run_id), latest=True, return_future=True).result(timeout=timeout_s)
    except Exception as e:
        logger.warning(f"Could not read progress of run {run_id!r} from the DHT: {e!r}")
        return []
    if found is None:
        return []
    if not isinstance(found.value, dict):
        logger.warning(f"Ignoring a malformed progress entry for run {run_id!r}: expected a dictionary")
        return []

    records = []
    for subkey, entry in found.value.items():
        record = parse_progress(subkey, entry, run_id)
        if record is not None:
            records.append(record)
    return sorted(records, key=lambda r: r.peer_id)


def parse_progress(subkey: object, entry: object, run_id: str) -> Optional[PeerProgress]:
    """Validate one DHT entry; returns None (and logs why) for anything that is not a sound record."""
    if not isinstance(entry, ValueWithExpiration) or not isinstance(entry.value, bytes):
        logger.warning(f"Ignoring a progress record of unexpected type {type(entry).__name__}")
        return None
    if entry.value == b"":
        return None  # a withdrawn record: the peer left cleanly
    try:
        record = PeerProgress.FromString(entry.value)
    except DecodeError as e:
        logger.warning(f"Ignoring a progress record that does not parse: {e}")
        return None
    try:
        subkey_peer = PeerID(subkey).to_base58() if isinstance(subkey, bytes) else None
    except Exception:
        subkey_peer = None
    if subkey_peer is None or subkey_peer != record.peer_id:
        logger.warning(f"Ignoring a progress record for {record.peer_id!r} stored under another peer's subkey")
        return None
    if record.run_id != run_id:
        logger.warning(f"Ignoring a progress record of run {record.run_id!r} under run {run_id!r}")
        return None
    if not (math.isfinite(record.samples_per_s) and record.samples_per_s >= 0 and math.isfinite(record.timestamp)):
        logger.warning(f"Ignoring a progress record from {record.peer_id} with impossible numbers")
        return None
    return record
