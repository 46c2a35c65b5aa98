"""Data shard claims between live peers, through real progress records on real hivemind DHTs on 127.0.0.1: a shard
another peer trained on and left since its last commit (its cursor not out yet) is not taken as unseen."""

from __future__ import annotations

from typing import List

import hivemind
import pytest

from p2ptrain.swarm.progress import ProgressPublisher, fetch_progress
from p2ptrain.swarm.shards import claim_shard

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(120)]


@pytest.fixture
def two_dhts():
    nodes: List[hivemind.DHT] = []
    for _ in range(2):
        initial = nodes[0].get_visible_maddrs() if nodes else []
        nodes.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial))
    yield nodes
    for node in reversed(nodes):
        node.shutdown()


def trainer_on(dht: hivemind.DHT, shard: int, left: tuple) -> ProgressPublisher:
    """A live peer training on ``shard`` that left the shards ``left`` within its current round."""
    publisher = ProgressPublisher(dht, "claims")
    publisher.shard_index, publisher.left_shards = shard, left
    publisher.publish(outer_step=1, local_step=30, samples_per_s=100.0, samples_since_sync=200, wait_s=5.0)
    return publisher


@pytest.mark.parametrize("num_shards, expected", [(6, 4), (4, 0)])
def test_a_newcomer_claims_a_shard_nobody_trained_on_this_round(two_dhts, num_shards, expected):
    """The trainer is on shard 3 and passed through 0, 1 and 2 since its last commit. A newcomer claims 4 when
    there is one; with only 4 shards it shares one the trainer left (the lowest) rather than its current one."""
    trainer_dht, newcomer_dht = two_dhts
    trainer = trainer_on(trainer_dht, 3, (0, 1, 2))
    try:
        [record] = fetch_progress(newcomer_dht, "claims")
        assert (record.shard_index, list(record.left_shards)) == (3, [0, 1, 2])
        newcomer = ProgressPublisher(newcomer_dht, "claims")
        try:
            assert claim_shard(newcomer_dht, "claims", num_shards, newcomer, settle_s=0.5) == expected
        finally:
            newcomer.withdraw()
    finally:
        trainer.withdraw()
