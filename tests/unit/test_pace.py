"""Adaptive inner steps (p2ptrain/pace.py): when a peer takes a stride, how far its local step moves."""

from __future__ import annotations

from p2ptrain.pace import Pace, stride_for


def test_a_peer_about_as_fast_as_the_swarm_keeps_every_step():
    assert [stride_for(r, 100) for r in (None, 0.5, 1.0, 1.3, 1.7)] == [1] * 5


def test_a_slower_peer_strides_by_its_rounded_slowness_keeping_two_steps_a_phase():
    assert [stride_for(r, 100) for r in (1.75, 2.0, 2.9, 3.0, 4.2)] == [2, 2, 3, 3, 4]
    assert stride_for(50.0, 10) == 5


def test_the_stride_moves_only_after_two_looks_in_a_row_want_it_moved():
    pace = Pace(local_steps=40)
    assert pace.update(0.2, 0.1) == 1  # 2x slower than the fastest peer once: could be noise
    assert pace.update(0.1, 0.1) == 1  # as fast: the count starts over
    assert pace.update(0.2, 0.1) == 1
    assert pace.update(0.2, 0.1) == 2  # twice in a row: a trend
    assert pace.update(0.16, 0.1) == 2  # strided at 2, 1.6x is within half a step of it: noise, it stays
    assert pace.update(0.25, 0.1) == 2  # 2.5x: still within half a step
    assert pace.update(0.1, 0.1) == 2  # as fast once
    assert pace.update(0.1, 0.1) == 1  # twice: back to every step
    assert pace.update(None, 0.1) == 1 and pace.update(0.4, None) == 1  # unknown: full steps
    pace.stride = 3
    assert pace.update(0.3, None) == 3 and pace.update(0.3, None) == 3  # unknown now: no news, no change


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
        assert pace.update(1.0, 0.1) == 1
