"""Shard cursors from other peers: a sound one resumes the iterator exactly, anything else is skipped."""

from __future__ import annotations

import logging

import pytest
from hivemind.utils import ValueWithExpiration

from p2ptrain.data import ShardedBatches
from p2ptrain.proto.p2ptrain_pb2 import ShardCursor
from p2ptrain.swarm.shards import cursor_state, parse_cursor

DATA = bytes(range(256)) * 64


def batches(shard_index: int = 1, seed: int = 0) -> ShardedBatches:
    return ShardedBatches(DATA, block_size=16, batch_size=4, shard_index=shard_index, num_shards=2, seed=seed)


def cursor_of(it: ShardedBatches, run_id: str = "r") -> ShardCursor:
    state = it.state_dict()
    return ShardCursor(run_id=run_id, shard_index=state["shard_index"], num_shards=state["num_shards"],
                       samples_per_epoch=state["samples_per_epoch"], seed=state["seed"],
                       block_size=state["block_size"], epoch=state["epoch"], position=state["position"],
                       outer_step=3, peer_id="QmPeer", timestamp=1.7e9)


def entry(cursor: ShardCursor | bytes) -> ValueWithExpiration:
    return ValueWithExpiration(cursor if isinstance(cursor, bytes) else cursor.SerializeToString(), 1e12)


def test_a_peer_that_takes_over_continues_with_the_next_batch():
    owner = batches()
    for _ in range(37):  # into the second epoch: 256 samples per shard-epoch / 4 per batch = 64 batches
        next(owner)
    cursor = parse_cursor(entry(cursor_of(owner)), "r", 1)
    successor = batches()
    successor.load_state_dict(cursor_state(cursor))
    for _ in range(40):
        x_owner, _ = next(owner)
        x_successor, _ = next(successor)
        assert x_owner.equal(x_successor)


def test_a_cursor_of_other_data_is_refused_by_the_iterator():
    other_seed = cursor_of(batches(seed=1))
    with pytest.raises(ValueError, match="seed"):
        batches().load_state_dict(cursor_state(other_seed))


def test_bad_cursors_are_skipped_and_logged(caplog):
    caplog.set_level(logging.WARNING)
    cases = [
        (entry(b"\xff\xff\xff garbage"), "r", 1),  # does not parse
        (entry(cursor_of(batches(), run_id="other")), "r", 1),  # another run's
        (entry(cursor_of(batches(shard_index=0))), "r", 1),  # stored under another shard
        ("not a ValueWithExpiration", "r", 1),
        (ValueWithExpiration(12345, 1e12), "r", 1),
    ]
    for value, run_id, shard in cases:
        assert parse_cursor(value, run_id, shard) is None
    assert len(caplog.records) == len(cases)
