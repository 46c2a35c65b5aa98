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
import threading
import time
from collections import Counter
from typing import Callable, Collection, List, Optional, Tuple

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


MODEL_FIELDS = ("model", "n_layer", "n_embd", "n_head", "block_size", "vocab_size", "num_parameters", "num_tensors",
                "params_schema")
"""the PeerProgress fields that describe the model; ``params_schema`` (a digest of the tensors' shapes and dtypes)
is what decides, the others put the difference in words"""
RUN_FIELDS = ("local_steps", "compression", "seed", "protocol", "sync_schedule")
SETTINGS = MODEL_FIELDS + RUN_FIELDS
"""the PeerProgress fields every peer of a run must agree on"""
WORKER_FIELDS = ("data", "batch_size", "threads")
"""settings a worker publishes that may differ between the peers of a run: shown by status, never compared"""

_RUN_FIELD_WORDS = {"local_steps": "H (local_steps)", "compression": "codec (compression)", "seed": "seed",
                    "protocol": "protocol version", "sync_schedule": "streaming sync (--fragments, --overlap-steps)"}


def _known(value) -> bool:
    return value is not None and value != "" and value != 0


def _record_settings(record: PeerProgress) -> dict:
    values = {name: getattr(record, name) for name in SETTINGS}
    if not record.HasField("seed"):
        values["seed"] = None
    return values


def _count(n: int) -> str:
    """A parameter count in a few digits: 80, 9,600, 0.438M, 25.5M, 1.2B."""
    if n >= 10 ** 9:
        return f"{n / 10 ** 9:.3g}B"
    if n >= 10 ** 5:
        return f"{n / 10 ** 6:.3g}M"
    return f"{n:,}"


def _describe_model(values: dict, other: dict) -> str:
    """``values``' model in words, with the details that differ from ``other``'s (and the ones that always help)."""
    def differs(name: str) -> bool:
        return _known(values.get(name)) and _known(other.get(name)) and values[name] != other[name]

    details = []
    for name, words in (("n_layer", "{} layers"), ("n_embd", "{} wide"), ("n_head", "{} heads"),
                        ("block_size", "block size {}"), ("vocab_size", "vocab {}")):
        # layers and width always tell the sizes apart; the rest only where they differ
        if _known(values.get(name)) and (name in ("n_layer", "n_embd") or differs(name)):
            details.append(words.format(values[name]))
    if _known(values.get("num_parameters")):
        details.append(f"{_count(values['num_parameters'])} parameters")
    if _known(values.get("num_tensors")) and not (_known(values.get("model")) and _known(other.get("model"))):
        details.append(f"{values['num_tensors']} tensors")
    if not details and _known(values.get("params_schema")):  # a peer of an earlier version: only the digest
        details.append(f"tensor schema {values['params_schema']}")
    name = repr(values["model"]) if _known(values.get("model")) else "without a built-in name"
    return f"{name} ({', '.join(details)})" if details else name


def _model_differences(mine: dict, theirs: dict) -> bool:
    if mine.get("params_schema") != theirs.get("params_schema"):
        return True
    return any(_known(mine.get(n)) and _known(theirs.get(n)) and mine[n] != theirs[n] for n in MODEL_FIELDS)


def _shown(name: str, value) -> str:
    """A run setting's value as a refusal names it."""
    if name == "sync_schedule" and value == "":
        return "blocking (1 fragment, no overlap)"
    return repr(value)


TEXT_MAX_CHARS = 200
"""a record's free-text fields (model, data, reachability, sync schedule) are cut to this many characters, so that
the record stays under RECORD_MAX_BYTES whatever a user names things (tests/unit/test_record_bounds.py)"""
MAX_LEFT_SHARDS = 512
"""the most ``left_shards`` a record lists (a phase that ran through more shards than this claims its last ones)"""
_TEXT_FIELDS = ("model", "data", "reachability", "sync_schedule", "compression")


def clip_text(fields: dict) -> dict:
    """``fields`` with its free-text values cut to ``TEXT_MAX_CHARS``, as a record carries them."""
    return {name: value[:TEXT_MAX_CHARS] if name in _TEXT_FIELDS and isinstance(value, str) else value
            for name, value in fields.items()}


def check_run_settings(mine: dict, records: List[PeerProgress], run_id: str) -> None:
    """Raise RunMismatch if ``mine`` (SETTINGS -> value; a value may be missing or None where this peer does not
    know it) differs from what most live peers publish. The message names each difference in words, with the value
    on each side, in one line."""
    mine = clip_text(mine)  # as the others' records carry it
    others = [_record_settings(r) for r in records if r.params_schema]  # peers before protocol 3 publish none
    if not others:
        return

    def on(count: int) -> str:
        return f"on {count} of {len(others)} live peer{'' if len(others) == 1 else 's'}"

    differences = []
    models = Counter(tuple(o[n] for n in MODEL_FIELDS) for o in others)
    theirs_tuple, count = models.most_common(1)[0]
    theirs = dict(zip(MODEL_FIELDS, theirs_tuple))
    if _model_differences(mine, theirs):
        here, there = _describe_model(mine, theirs), _describe_model(theirs, mine)
        if here == there:  # the same in every field we can name: the tensors' shapes or dtypes differ
            here += f", tensor shapes or dtypes {mine.get('params_schema')}"
            there += f", tensor shapes or dtypes {theirs.get('params_schema')}"
        differences.append(f"model {here} here, {there} {on(count)}")
    for name in RUN_FIELDS:
        values = Counter(o[name] for o in others if o[name] is not None)
        if not values or mine.get(name) is None:
            continue  # a peer that does not know its seed (a library user) is not compared on it
        value, count = values.most_common(1)[0]
        if value != mine[name]:
            here, there = (_shown(name, v) for v in (mine[name], value))
            differences.append(f"{_RUN_FIELD_WORDS[name]} {here} here, {there} {on(count)}")
    if differences:
        raise RunMismatch(f"this peer does not match run {run_id!r}: {'; '.join(differences)}; start it with the "
                          "run's model and settings, or under another --run-id")


FORCED_STORE_WAIT_S = 2.0
"""how long a forced progress record (a peer's first, a sync point or a fragment's launch, a commit) is waited for
before the peer goes on"""


def wait_until_stored(stored, timeout_s: float) -> None:
    """Wait at most ``timeout_s`` for a record's store (``ProgressPublisher.publish``'s future); a slow or failed
    store is left to the heartbeat, which stores the record again."""
    try:
        stored.result(timeout=max(timeout_s, 0.0))
    except Exception as e:
        logger.debug(f"The progress record was not stored within {timeout_s:.1f}s: {e!r}")


class ProgressPublisher:
    """Publishes one peer's progress, at most once per ``period_s`` unless forced. Never blocks training."""

    def __init__(self, dht: DHT, run_id: str, *, period_s: float = 5.0, client_mode: bool = False):
        self.dht, self.run_id, self.period_s, self.client_mode = dht, run_id, period_s, client_mode
        # a record outlives a few missed refreshes, not much more: a round stops waiting for a dead peer, and status
        # drops it, once its record expires. A background thread refreshes the record (start_heartbeat), so a peer
        # that is busy in a long sync or a state download stays live
        self.expiration_s = 3 * period_s
        self._last_published = -math.inf
        self._last_expiration = 0.0
        self._last_fields: Optional[dict] = None
        self._store_lock = threading.Lock()  # the training thread and the heartbeat both store
        self._heartbeat_stop = threading.Event()
        self._heartbeat: Optional[threading.Thread] = None
        self.watch_swarm = False
        """also read the live peers' records with every heartbeat, into ``swarm_outer_step`` (off the training
        thread: DiLoCoOptimizer looks at it every inner step to catch up as soon as the swarm moved on)"""
        self.swarm_outer_step = -1
        self.live_peers: Optional[int] = None
        """live peers of the run at the last look, this one included (None: not watching, or no look yet)"""
        self.others_seen_at = -math.inf
        """when a look at the records (the heartbeat's, or a round's) last showed another live peer of the run"""
        """the highest outer step among the other live peers at the last look (-1: none, or not watching)"""
        self.shard_index: Optional[int] = None
        """the data shard this peer claimed, published with every record (see swarm/shards.py)"""
        self.left_shards: Tuple[int, ...] = ()
        """data shards left since the last committed round, whose cursors are not out yet: claimed as well"""
        self.reachability = ""
        """how this peer chose public or client mode (swarm/reachability.py), published for status"""
        self.relay_maddrs: Tuple[str, ...] = ()
        """a relayed peer's relays (swarm/relays.py), published; ``on_look`` gets the others' records at each look"""
        self.on_look: Callable[[List[PeerProgress]], None] = lambda others: None
        self.fastest_step_s: Optional[float] = None
        """the shortest inner step among the other live peers' records (their ``step_s``; None: not watching, or
        none known yet). A slower peer sets its stride from it (``DiLoCoOptimizer``'s adaptive steps, pace.py)"""
        self.excluded: Callable[[], Collection[str]] = lambda: ()
        """base58 ids of the peers this peer excluded for misbehaving (its averager's bans): their records do not
        count in its view of the swarm (``others``): a caught insider's word moves nobody's plan, catch-up or pace"""
        self.settings: dict = {}
        """SETTINGS and WORKER_FIELDS -> this peer's value, published with every record (the Worker sets the
        model's description and its own settings, DiLoCoOptimizer adds the rest)"""

    def due(self) -> bool:
        return time.monotonic() - self._last_published >= self.period_s

    def start_heartbeat(self) -> None:
        """Re-publish the last record every ``period_s`` from a daemon thread until ``withdraw``: the record says
        the peer is alive even while its training thread is blocked (a sync, a state download, a slow step)."""
        if self._heartbeat is not None:
            return
        self._heartbeat = threading.Thread(target=self._beat, name="p2ptrain-progress-heartbeat", daemon=True)
        self._heartbeat.start()

    def _beat(self) -> None:
        while not self._heartbeat_stop.wait(self.period_s / 2):
            if self._last_fields is not None and self.due():
                try:
                    self.publish(**self._last_fields)
                except Exception as e:  # the DHT is shutting down, or gone: the record lapses on its own
                    logger.debug(f"Could not refresh the progress record: {e!r}")
            if self.watch_swarm and not self._heartbeat_stop.is_set():
                others = self.others(self.period_s)
                self.swarm_outer_step = max((r.outer_step for r in others), default=-1)
                self.live_peers = len(others) + 1
                known = [r.step_s for r in others if r.step_s > 0]
                if known:  # a failed or empty read is no news: the last value stands
                    self.fastest_step_s = min(known)
                if others:
                    self.others_seen_at = time.monotonic()
                self.on_look(others)

    def others(self, timeout_s: float, *, leaving: bool = False) -> List[PeerProgress]:
        """The other peers' records (``fetch_progress``), but those of the peers this one excluded."""
        me, excluded = self.dht.peer_id.to_base58(), set(self.excluded())
        return [r for r in fetch_progress(self.dht, self.run_id, timeout_s=timeout_s, leaving=leaving)
                if r.peer_id != me and r.peer_id not in excluded]

    def publish(self, *, outer_step: int, local_step: int, samples_per_s: float, samples_since_sync: int,
                wait_s: float = 0.0, step_s: float = 0.0):
        """Store this peer's record. ``wait_s`` > 0: wait (at most that long) until the DHT has stored it, for a
        record the other peers must see before they next read (a peer's first, its sync point). Returns the store's
        future, for a caller that waits later (``wait_until_stored``) and does other work meanwhile."""
        self._last_fields = dict(outer_step=outer_step, local_step=local_step, samples_per_s=samples_per_s,
                                 samples_since_sync=samples_since_sync, step_s=step_s)
        if self._heartbeat is None and not self._heartbeat_stop.is_set():
            self.start_heartbeat()  # from the first record on (a shard claim, before the model is even built)
        record = PeerProgress(
            run_id=self.run_id,
            peer_id=self.dht.peer_id.to_base58(),
            outer_step=outer_step,
            local_step=local_step,
            samples_per_s=samples_per_s,
            timestamp=get_dht_time(),
            samples_since_sync=samples_since_sync,
            step_s=step_s,
            client_mode=self.client_mode,
            shard_index=self.shard_index,
            left_shards=self.left_shards[-MAX_LEFT_SHARDS:],
            relay_maddrs=self.relay_maddrs,
            **clip_text(dict(self.settings, reachability=self.reachability)),
        )
        stored = self._store(record.SerializeToString(), get_dht_time() + self.expiration_s)
        self._last_published = time.monotonic()
        if wait_s > 0:
            wait_until_stored(stored, wait_s)
        return stored

    def withdraw(self, timeout_s: float = 5.0) -> None:
        """Overwrite our record with a leaving one (``PeerProgress.leaving``; empty if we never published one), so
        we leave `status` and the rounds on a clean exit. Waits (bounded) for the store: the caller usually shuts
        the DHT down next, which would drop a store still in flight."""
        self._heartbeat_stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=timeout_s)
        # the DHT keeps whichever value of a subkey expires last, so the leaving record must outlive the last live
        # one; it lasts no longer than that one would have, plus a second
        expiration = max(self._last_expiration, get_dht_time()) + 1.0
        value = b""
        if self._last_fields is not None:
            fields = self._last_fields
            value = PeerProgress(run_id=self.run_id, peer_id=self.dht.peer_id.to_base58(),
                                 outer_step=fields["outer_step"], local_step=fields["local_step"],
                                 timestamp=get_dht_time(), leaving=True).SerializeToString()
        try:
            self._store(value, expiration).result(timeout=timeout_s)
        except Exception as e:
            logger.debug(f"Could not withdraw the progress record: {e!r}")

    def _store(self, value: bytes, expiration_time: float):
        # return_future: the DHT process stores it in the background; a failed store only delays the listing
        with self._store_lock:
            return self._store_locked(value, expiration_time)

    def _store_locked(self, value: bytes, expiration_time: float):
        self._last_expiration = max(self._last_expiration, expiration_time)
        return self.dht.store(
            progress_key(self.run_id),
            value,
            expiration_time=expiration_time,
            subkey=self.dht.peer_id.to_bytes(),
            return_future=True,
        )


def fetch_progress(dht: DHT, run_id: str, timeout_s: float = 10.0, *, strict: bool = False,
                   leaving: bool = False) -> List[PeerProgress]:
    """The run's live peers' latest records, sorted by peer id. Malformed records are logged and skipped. A failed
    read (a timeout, the DHT shutting down) is logged and reads as no record; ``strict``: it raises instead, for a
    reader that keeps its last answer (the dashboard), to whom "no peer" and "could not look" differ. ``leaving``:
    the records of peers that left cleanly a moment ago too (``PeerProgress.leaving``; the rounds' mixing draw)."""
    try:
        found = dht.get(progress_key(run_id), latest=True, return_future=True).result(timeout=timeout_s)
    except Exception as e:
        if strict:
            raise
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
        if record is not None and (leaving or not record.leaving):
            records.append(record)
    return sorted(records, key=lambda r: r.peer_id)


def wait_for_peers(dht: DHT, run_id: str, count: int, stop: threading.Event, *, poll_s: float = 1.0,
                   log_every_s: float = 10.0) -> bool:
    """Block until ``count`` peers of the run (this one included) are ready to train: True, or False if ``stop``
    was set first. Ready: its record carries the tensor schema, which a DiLoCoOptimizer publishes once it joined
    (a worker's shard claim comes before its model is built: on 2 cores 8 workers claimed within a second and
    joined 8 s apart). Logs how many are there every ``log_every_s``. Only the number counts: a fleet started
    together starts together, and a peer joining a swarm that has them already goes on at once."""
    started, seen = time.monotonic(), 0
    logged = started - log_every_s  # the first look that finds too few says so at once, then every log_every_s
    me = dht.peer_id.to_base58()
    while not stop.is_set():
        records = fetch_progress(dht, run_id, timeout_s=max(poll_s, 5.0))
        seen = 1 + sum(r.peer_id != me and bool(r.params_schema) for r in records)
        if seen >= count:
            logger.info(f"{seen} peers of run {run_id!r} are ready (--wait-for-peers {count}): training starts "
                        f"after {time.monotonic() - started:.1f}s")
            return True
        if time.monotonic() - logged >= log_every_s:
            logged = time.monotonic()
            logger.info(f"waiting for peers (--wait-for-peers {count}): {seen}/{count} ready after "
                        f"{logged - started:.0f}s")
        stop.wait(poll_s)
    return False


def subkey_peer_id(subkey: object) -> Optional[str]:
    """The base58 peer id a per-peer record's DHT subkey names, or None if it names none (records come from others)."""
    try:
        return PeerID(subkey).to_base58() if isinstance(subkey, bytes) else None
    except Exception:
        return None


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
    subkey_peer = subkey_peer_id(subkey)
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
