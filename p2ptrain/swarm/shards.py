"""Claiming a data shard that no other live peer of the run trains on, and moving on when it is done.

There is no coordinator: a peer reads the live peers' progress records (each carries its shard), takes the least
seen free shard (the lowest index among equals), publishes its claim and waits ``settle_s`` for concurrent claims
to show up. Two peers that claimed the same shard at the same moment both see the conflict; the one with the larger
peer id moves on. A claim lives as long as the peer keeps refreshing its progress record, so a crashed peer's shard
frees itself when that expires.

Each shard's owner also publishes a ``ShardCursor`` after every committed round: where in the shard its training
has got to (for a shard it left since the previous round, where it left it). A peer that takes the shard over (its
owner left or died) continues from there, so the samples that already reached the swarm's parameters are not
trained on again and none are skipped. When a peer completes a pass over its shard it moves to the least seen shard
that no other live peer claims (``pick_next_shard``): the live peers together go through all of the data, whatever
their number, before any shard is seen twice. ``coverage`` sums the cursors up for ``p2ptrain status``.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections import Counter
from typing import Dict, Iterable, Optional, Set

import hivemind
from google.protobuf.message import DecodeError
from hivemind.utils import ValueWithExpiration, get_dht_time

from p2ptrain.proto.p2ptrain_pb2 import ShardCursor
from p2ptrain.swarm.progress import ProgressPublisher, fetch_progress

logger = logging.getLogger(__name__)


def claim_shard(
    dht: hivemind.DHT,
    run_id: str,
    num_shards: int,
    publisher: ProgressPublisher,
    *,
    settle_s: float = 2.0,
    max_rounds: int = 20,
) -> int:
    """Claim a shard in [0, num_shards) and return it: the least seen (by the published cursors) of those no live
    peer claims, the lowest index among equals; one a live peer left since its last commit (trained on, its cursor
    not out yet) only when no other is free. Falls back to sharing a shard (with a warning) if all are taken,
    since training on overlapping data beats refusing to train."""
    me = dht.peer_id.to_base58()
    seen = shard_progress(fetch_cursors(dht, run_id).values(), num_shards)
    for _ in range(max_rounds):
        owners: dict[int, str] = {}
        left: set[int] = set()  # left by a live peer since its last commit: trained on, no cursor out yet
        for record in fetch_progress(dht, run_id):
            if record.peer_id != me and record.HasField("shard_index"):
                index = record.shard_index
                owners[index] = min(owners.get(index, record.peer_id), record.peer_id)
                left.update(record.left_shards)
        mine = publisher.shard_index
        if mine is not None and (mine not in owners or me < owners[mine]):
            return mine  # published at least settle_s ago and nobody with priority claims it
        free = sorted((i for i in range(num_shards) if i not in owners),
                      key=lambda i: (i in left, seen.get(i, 0.0), i))
        if not free:
            shared = int.from_bytes(dht.peer_id.to_bytes()[-4:], "big") % num_shards
            logger.warning(
                f"all {num_shards} data shards are claimed by live peers; sharing shard {shared}. "
                "Raise train.num_shards (the same on every peer) to give each peer its own data"
            )
            publisher.shard_index = shared
            return shared
        publisher.shard_index = free[0]
        publisher.publish(outer_step=0, local_step=0, samples_per_s=0.0, samples_since_sync=0)
        time.sleep(settle_s)
    logger.warning(f"shard claims did not settle after {max_rounds} rounds; keeping shard {publisher.shard_index}")
    return publisher.shard_index


CURSOR_EXPIRATION_S = 24 * 3600.0


def cursor_key(run_id: str) -> str:
    return f"{run_id}_shards"


def publish_cursor(dht: hivemind.DHT, run_id: str, data_state: dict, outer_step: int):
    """Publish where this peer's shard is (``ShardedBatches.state_dict()``) in the background; never blocks.
    Returns the store's future: a peer about to leave waits for it (``DataShardTracker.flush``)."""
    cursor = ShardCursor(
        run_id=run_id,
        shard_index=data_state["shard_index"],
        num_shards=data_state["num_shards"],
        samples_per_epoch=data_state["samples_per_epoch"],
        seed=data_state["seed"],
        block_size=data_state["block_size"],
        epoch=data_state["epoch"],
        position=data_state["position"],
        outer_step=outer_step,
        peer_id=dht.peer_id.to_base58(),
        timestamp=get_dht_time(),
    )
    return dht.store(cursor_key(run_id), cursor.SerializeToString(),
                     expiration_time=get_dht_time() + CURSOR_EXPIRATION_S, subkey=data_state["shard_index"],
                     return_future=True)


def fetch_cursors(dht: hivemind.DHT, run_id: str, timeout_s: float = 10.0) -> Dict[int, ShardCursor]:
    """Every shard's last published cursor (shard index -> cursor); unreadable ones are logged and left out, and a
    failed lookup (logged) gives none."""
    try:
        found = dht.get(cursor_key(run_id), latest=True, return_future=True).result(timeout=timeout_s)
    except Exception as e:
        logger.warning(f"Could not read the data cursors of run {run_id!r} from the DHT: {e!r}")
        return {}
    if found is None or not isinstance(found.value, dict):
        return {}
    cursors = {}
    for subkey, entry in found.value.items():
        if not isinstance(subkey, int) or isinstance(subkey, bool) or subkey < 0:
            logger.warning(f"Ignoring a data cursor stored under the subkey {subkey!r}, which is no shard index")
            continue
        cursor = parse_cursor(entry, run_id, subkey)
        if cursor is not None:
            cursors[subkey] = cursor
    return cursors


def fetch_cursor(dht: hivemind.DHT, run_id: str, shard_index: int, timeout_s: float = 10.0) -> Optional[ShardCursor]:
    """The last published cursor of a shard, or None (none yet, unreadable: logged and ignored)."""
    return fetch_cursors(dht, run_id, timeout_s).get(shard_index)


def parse_cursor(entry: object, run_id: str, shard_index: int) -> Optional[ShardCursor]:
    """Validate one DHT entry for a shard's cursor; None (and a log line) for anything that is not sound."""
    if not isinstance(entry, ValueWithExpiration) or not isinstance(entry.value, bytes):
        logger.warning(f"Ignoring a data cursor of unexpected type {type(entry).__name__} for shard {shard_index}")
        return None
    try:
        cursor = ShardCursor.FromString(entry.value)
    except DecodeError as e:
        logger.warning(f"Ignoring a data cursor for shard {shard_index} that does not parse: {e}")
        return None
    if cursor.run_id != run_id or cursor.shard_index != shard_index:
        logger.warning(f"Ignoring a data cursor of run {cursor.run_id!r} shard {cursor.shard_index} stored under "
                       f"run {run_id!r} shard {shard_index}")
        return None
    return cursor


def cursor_state(cursor: ShardCursor) -> dict:
    """The cursor as a ``ShardedBatches.state_dict()``, for ``load_state_dict`` (which checks it fits)."""
    return {
        "epoch": cursor.epoch,
        "position": cursor.position,
        "seed": cursor.seed,
        "shard_index": cursor.shard_index,
        "num_shards": cursor.num_shards,
        "block_size": cursor.block_size,
        "samples_per_epoch": cursor.samples_per_epoch,
    }


def cursor_progress(cursor: ShardCursor) -> float:
    """How far the swarm got through a shard, in passes: 1.5 is one full pass and half of the second."""
    return cursor.epoch + min(cursor.position, cursor.samples_per_epoch) / max(cursor.samples_per_epoch, 1)


def shard_progress(cursors: Iterable[ShardCursor], num_shards: int, max_outer_step: Optional[int] = None,
                   layout: Optional[dict] = None) -> Dict[int, float]:
    """Shard index -> passes seen, from the cursors of a run with ``num_shards`` shards. Cursors of another shard
    count, or of another layout (``layout``: a ``ShardedBatches.state_dict()``, compared on seed and block size),
    or from a later outer step than ``max_outer_step`` (an earlier run under the same run id), are left out."""
    progress = {}
    for cursor in cursors:
        if cursor.num_shards != num_shards or cursor.shard_index >= num_shards:
            continue
        if layout is not None and (cursor.seed, cursor.block_size) != (layout["seed"], layout["block_size"]):
            continue
        if max_outer_step is not None and cursor.outer_step > max_outer_step:
            continue
        progress[cursor.shard_index] = max(progress.get(cursor.shard_index, 0.0), cursor_progress(cursor))
    return progress


def _tie_break(peer_id: str, shard_index: int) -> bytes:
    # each peer orders equally seen shards its own (fixed) way, so peers that finish at the same moment rarely pick
    # the same one; a conflict that does happen is settled after the next round (the larger peer id moves on)
    return hashlib.blake2b(f"{peer_id}/{shard_index}".encode(), digest_size=8).digest()


def pick_next_shard(num_shards: int, progress: Dict[int, float], claimed: Set[int], peer_id: str) -> Optional[int]:
    """The shard a peer should go on with: the least seen (``progress``: shard -> passes, absent = unseen) of those
    not in ``claimed`` (the other live peers' shards), so no shard gets a second pass before every free one had its
    first. Between equally seen shards, an order of the peer's own. None if every shard is claimed."""
    free = [i for i in range(num_shards) if i not in claimed]
    if not free:
        return None
    return min(free, key=lambda i: (progress.get(i, 0.0), _tie_break(peer_id, i)))


def coverage(cursors: Iterable[ShardCursor], num_shards: Optional[int] = None,
             max_outer_step: Optional[int] = None) -> Optional[dict]:
    """How much of the corpus the swarm's parameters have seen, from the shard cursors: ``fraction_seen`` (samples
    trained on at least once / all samples), ``shards_complete`` (shards with a full pass), ``passes`` (the fewest
    full passes over any shard), ``num_shards``, ``samples_seen`` and ``samples_total``. ``num_shards`` defaults to
    the most common among the cursors; a shard without a cursor is unseen, its size taken as the mean of the known
    ones (shards differ by at most one sample). None when there is no cursor to go by."""
    cursors = list(cursors)
    if num_shards is None:
        counts = Counter(c.num_shards for c in cursors if c.num_shards > 0)
        if not counts:
            return None
        num_shards = counts.most_common(1)[0][0]
    best: Dict[int, ShardCursor] = {}
    for cursor in cursors:
        if cursor.num_shards != num_shards or cursor.shard_index >= num_shards or cursor.samples_per_epoch == 0:
            continue
        if max_outer_step is not None and cursor.outer_step > max_outer_step:
            continue
        held = best.get(cursor.shard_index)
        if held is None or cursor_progress(cursor) > cursor_progress(held):
            best[cursor.shard_index] = cursor
    if not best:
        return None
    sizes = [c.samples_per_epoch for c in best.values()]
    mean_size = sum(sizes) / len(sizes)
    seen = sum(c.samples_per_epoch if c.epoch >= 1 else min(c.position, c.samples_per_epoch) for c in best.values())
    total = sum(sizes) + mean_size * (num_shards - len(best))
    complete = sum(c.epoch >= 1 for c in best.values())
    return {
        "num_shards": num_shards,
        "fraction_seen": seen / total if total else 0.0,
        "shards_complete": complete,
        "passes": min(c.epoch for c in best.values()) if len(best) == num_shards else 0,
        "samples_seen": seen,
        "samples_total": round(total),
    }
