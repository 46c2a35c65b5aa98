"""Shard cursors from other peers: a sound one resumes the iterator exactly, anything else is skipped; choosing the
next shard after a pass, and the swarm's coverage of the corpus, from the cursors."""

from __future__ import annotations

import logging
import random

import pytest
from hivemind.utils import ValueWithExpiration

from p2ptrain.data import ShardedBatches, shard_layout
from p2ptrain.proto.p2ptrain_pb2 import ShardCursor
from p2ptrain.swarm.shards import coverage, cursor_state, parse_cursor, pick_next_shard, shard_progress

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


# --- moving on: which shard next, and how much of the corpus the swarm has seen --------------------------------------


def cursor_at(shard: int, epoch: int, position: int, samples: int = 100, num_shards: int = 8, outer_step: int = 3,
              seed: int = 0, block_size: int = 16) -> ShardCursor:
    return ShardCursor(run_id="r", shard_index=shard, num_shards=num_shards, samples_per_epoch=samples, seed=seed,
                       block_size=block_size, epoch=epoch, position=position, outer_step=outer_step)


def test_the_next_shard_is_the_least_seen_one_nobody_else_claims():
    progress = {0: 1.0, 1: 0.5, 2: 0.25, 3: 1.0}
    assert pick_next_shard(4, progress, claimed={1}, peer_id="QmA") == 2
    assert pick_next_shard(4, progress, claimed={2}, peer_id="QmA") == 1  # a claimed shard is never taken
    # a second pass only once every free shard had its first
    assert pick_next_shard(4, {0: 1.0, 1: 1.0, 2: 1.0, 3: 1.3}, claimed=set(), peer_id="QmA") in (0, 1, 2)
    assert pick_next_shard(4, {0: 2.0, 1: 1.0}, claimed={1, 2, 3}, peer_id="QmA") == 0  # its own shard again
    assert pick_next_shard(2, {}, claimed={0, 1}, peer_id="QmA") is None


def test_peers_order_equally_seen_shards_differently():
    # peers that finish at the same moment should rarely pick the same unseen shard
    picks = {pick_next_shard(16, {0: 1.0, 1: 1.0}, claimed=set(), peer_id=f"QmPeer{i}") for i in range(20)}
    assert len(picks) >= 5 and not picks & {0, 1}


def test_shard_progress_leaves_out_cursors_of_other_layouts_and_earlier_runs():
    cursors = [cursor_at(0, 0, 50), cursor_at(1, 1, 25), cursor_at(2, 3, 0, num_shards=16),
               cursor_at(3, 0, 10, outer_step=99), cursor_at(4, 0, 10, seed=7)]
    assert shard_progress(cursors, 8, max_outer_step=10, layout={"seed": 0, "block_size": 16}) == {0: 0.5, 1: 1.25}
    assert shard_progress(cursors, 8) == {0: 0.5, 1: 1.25, 3: 0.1, 4: 0.1}


def test_coverage_counts_each_sample_seen_at_least_once():
    assert coverage([]) is None
    cov = coverage([cursor_at(0, 0, 50), cursor_at(1, 2, 10), cursor_at(2, 1, 0)])
    assert cov == {"num_shards": 8, "fraction_seen": 250 / 800, "shards_complete": 2, "passes": 0,
                   "samples_seen": 250, "samples_total": 800}
    everything = coverage([cursor_at(i, 1 + (i == 3), 7) for i in range(8)])
    assert everything["fraction_seen"] == 1.0 and everything["shards_complete"] == 8 and everything["passes"] == 1
    # the layout most cursors share wins; cursors from a later outer step (an earlier run) are left out
    mixed = coverage([cursor_at(0, 1, 0), cursor_at(1, 1, 0), cursor_at(5, 1, 0, num_shards=16),
                      cursor_at(2, 1, 0, outer_step=50)], max_outer_step=10)
    assert mixed["num_shards"] == 8 and mixed["shards_complete"] == 2


def test_workers_that_move_on_after_each_pass_cover_all_shards_before_any_second_pass():
    """Three simulated workers on 16 shards: each claims a shard, and at the end of a pass picks the next as the
    Worker does (the others' current shards are claimed, progress from the shared cursors). No sample is trained on
    twice before every shard has been taken up, and the corpus is covered within a shard's worth of samples per
    worker beyond its size."""
    data = bytes(random.Random(1).randbytes(16 * 40 * 16 + 100))
    num_shards, cursors, workers, started, seen = 16, {}, [], {0, 1, 2}, []
    all_started_at = []

    def mover(me: int):
        def on_epoch_end(state: dict):
            cursors[state["shard_index"]] = state
            progress = {i: c["epoch"] + c["position"] / c["samples_per_epoch"] for i, c in cursors.items()}
            claimed = {w.shard_index for j, w in enumerate(workers) if j != me}
            pick = pick_next_shard(num_shards, progress, claimed, f"QmWorker{me}")
            if pick is None or pick == state["shard_index"]:
                return None
            started.add(pick)
            if len(started) == num_shards and not all_started_at:
                all_started_at.append(len(seen))
            return cursors.get(pick, workers[me].state_for(pick))
        return on_epoch_end

    for me in range(3):
        workers.append(ShardedBatches(data, block_size=16, batch_size=3 + me, shard_index=me, num_shards=num_shards,
                                      on_epoch_end=mover(me)))
    total = sum(shard_layout(len(data), num_shards, i, 16)[2] for i in range(num_shards))
    shard_size = workers[0].samples_per_epoch
    while len(seen) < total + 2 * shard_size:
        for w in workers:
            seen.extend(bytes(row.tolist()) for row in next(w)[0])
    assert len(set(seen)) == total, "some samples were never trained on"
    before: set = set()
    for first_repeat, sample in enumerate(seen):
        if sample in before:
            break
        before.add(sample)
    assert all_started_at and first_repeat >= all_started_at[0] - 2 * 5, \
        "a shard got a second pass while another was still unseen and free"
