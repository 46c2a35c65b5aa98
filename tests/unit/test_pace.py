"""Adaptive inner steps (p2ptrain/pace.py): when a peer takes a stride, how far its local step moves."""

from __future__ import annotations

from p2ptrain.pace import Pace, stride_for


def test_a_peer_about_as_fast_as_the_swarm_keeps_every_step():
    assert [stride_for(r, 100) for r in (None, 0.5, 1.0, 1.3, 1.7)] == [1] * 5


def test_a_slower_peer_strides_by_its_rounded_slowness_keeping_two_steps_a_phase():
    assert [stride_for(r, 100) for r in (1.75, 2.0, 2.9, 3.0, 4.2)] == [2, 2, 3, 3, 4]
    assert stride_for(50.0, 10) == 5


def test_the_stride_grows_only_after_two_slow_looks_and_drops_at_once():
    pace = Pace(local_steps=40)
    assert pace.update(0.2, 10.0) == 1  # 2x slower once: could be noise
    assert pace.update(0.1, 10.0) == 1  # as fast as the swarm: the count starts over
    assert pace.update(0.2, 10.0) == 1
    assert pace.update(0.2, 10.0) == 2  # twice in a row: a trend
    assert pace.update(0.2, 10.0) == 2  # strided, its step is still 2x the fastest peer's: it stays
    assert pace.update(0.1, 10.0) == 1  # fast again: back to every step at once
    assert pace.update(None, 10.0) == 1 and pace.update(0.4, None) == 1  # unknown: full steps


def test_advance_never_crosses_the_phase_end():
    pace = Pace(local_steps=10)
    pace.stride = 3
    moves, step = [], 0
    while step < 20:
        moves.append(pace.advance(step))
        step += moves[-1]
    assert moves == [3, 3, 3, 1, 3, 3, 3, 1] and step == 20


def test_a_disabled_pace_stays_at_one():
    pace = Pace(local_steps=40, enabled=False)
    for _ in range(4):
        assert pace.update(1.0, 10.0) == 1
