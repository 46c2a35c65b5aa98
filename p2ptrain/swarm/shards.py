"""Claiming a data shard that no other live peer of the run trains on.

There is no coordinator: a peer reads the live peers' progress records (each carries its shard), takes the lowest
free shard, publishes its claim and waits ``settle_s`` for concurrent claims to show up. Two peers that claimed
the same shard at the same moment both see the conflict; the one with the larger peer id moves on. A claim lives as
long as the peer keeps refreshing its progress record, so a crashed peer's shard frees itself when that expires.

Each shard's owner also publishes a ``ShardCursor`` after every committed round: where in the shard its training
has got to. A peer that takes the shard over (its owner left or died) continues from there, so the samples that
already reached the swarm's parameters are not trained on again and none are skipped.
"""

from __future__ import annotations

import logging
import time
from typing import Optional

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
    """Claim a shard in [0, num_shards) and return it. Falls back to sharing a shard (with a warning) if all
    are taken, since training on overlapping data beats refusing to train."""
    me = dht.peer_id.to_base58()
    for _ in range(max_rounds):
        owners: dict[int, str] = {}
        for record in fetch_progress(dht, run_id):
            if record.peer_id != me and record.HasField("shard_index"):
                index = record.shard_index
                owners[index] = min(owners.get(index, record.peer_id), record.peer_id)
        mine = publisher.shard_index
        if mine is not None and (mine not in owners or me < owners[mine]):
            return mine  # published at least settle_s ago and nobody with priority claims it
        free = [i for i in range(num_shards) if i not in owners]
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


def publish_cursor(dht: hivemind.DHT, run_id: str, data_state: dict, outer_step: int) -> None:
    """Publish where this peer's shard is (``ShardedBatches.state_dict()``) in the background; never blocks."""
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
    dht.store(cursor_key(run_id), cursor.SerializeToString(), expiration_time=get_dht_time() + CURSOR_EXPIRATION_S,
              subkey=data_state["shard_index"], return_future=True)


def fetch_cursor(dht: hivemind.DHT, run_id: str, shard_index: int, timeout_s: float = 10.0) -> Optional[ShardCursor]:
    """The last published cursor of a shard, or None (none yet, unreadable: logged and ignored)."""
    try:
        found = dht.get(cursor_key(run_id), latest=True, return_future=True).result(timeout=timeout_s)
    except Exception as e:
        logger.warning(f"Could not read the data cursors of run {run_id!r} from the DHT: {e!r}")
        return None
    if found is None or not isinstance(found.value, dict):
        return None
    entry = found.value.get(shard_index)
    if entry is None:
        return None
    return parse_cursor(entry, run_id, shard_index)


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
