"""Claiming a data shard that no other live peer of the run trains on.

There is no coordinator: a peer reads the live peers' progress records (each carries its shard), takes the lowest
free shard, publishes its claim and waits ``settle_s`` for concurrent claims to show up. Two peers that claimed
the same shard at the same moment both see the conflict; the one with the larger peer id moves on. A claim lives as
long as the peer keeps refreshing its progress record, so a crashed peer's shard frees itself when that expires.
"""

from __future__ import annotations

import logging
import time

import hivemind

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
