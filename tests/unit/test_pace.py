"""Adaptive inner steps (p2ptrain/pace.py): how many inner steps a slower peer takes per phase, and how far each
moves its local step."""

from __future__ import annotations

import pytest

from p2ptrain.pace import Pace, steps_for


def test_a_peer_about_as_fast_as_the_swarm_keeps_every_step():
    assert [steps_for(r, 100) for r in (None, 0.5, 1.0, 1.1, 1.14)] == [100] * 5


def test_a_slower_peer_takes_H_over_its_slowness_keeping_two_steps_a_phase():
    assert [steps_for(r, 100) for r in (1.15, 1.25, 1.5, 2.0, 2.3, 3.0, 4.2)] == [87, 80, 67, 50, 43, 33, 24]
    assert steps_for(50.0, 10) == 2
    assert steps_for(3.0, 1) == 1  # H = 1: nothing to spread


def test_the_step_count_moves_only_after_two_looks_in_a_row_want_it_moved():
    pace = Pace(local_steps=40)
    assert pace.update(0.2, 0.1) == 40  # 2x slower than the fastest peer once: could be noise
    assert pace.update(0.1, 0.1) == 40  # as fast: the count starts over
    assert pace.update(0.2, 0.1) == 40
    assert pace.update(0.24, 0.1) == 18  # twice in a row: a trend; the mean of the two looks (20 and 17)
    assert pace.stride == pytest.approx(40 / 18, abs=1e-3)
    assert pace.update(0.215, 0.1) == 18  # 19 wanted: within 8% of 18, noise, it stays
    assert pace.update(0.1, 0.1) == 18  # as fast once
    assert pace.update(0.3, 0.1) == 18  # then slower: the other way, the count starts over
    assert pace.update(0.1, 0.1) == 18
    assert pace.update(0.1, 0.1) == 40  # as fast twice in a row: back to every step
    assert pace.update(None, 0.1) == 40 and pace.update(0.4, None) == 40  # unknown: no change
    pace.steps = 13
    assert pace.update(0.3, None) == 13 and pace.update(0.3, None) == 13  # unknown now: no news, no change


@pytest.mark.parametrize("local_steps, steps", [(10, 3), (21, 10), (62, 27), (21, 21), (5, 2), (7, 6)])
def test_a_phase_spreads_its_local_steps_evenly_over_the_inner_steps_and_ends_on_the_phase_end(local_steps, steps):
    pace = Pace(local_steps=local_steps)
    pace.steps = steps
    moves, step = [], 0
    while step < 2 * local_steps:
        moves.append(pace.advance(step))
        step += moves[-1]
    assert step == 2 * local_steps and len(moves) == 2 * steps  # both phase ends hit, n inner steps in each
    assert set(moves) <= {local_steps // steps, -(-local_steps // steps)}  # even: 2s and 3s for 2.3x, never 1 and 4


def test_advance_from_off_the_schedule_still_lands_on_it():
    """A resumed or caught-up peer can stand at any local step: it moves to the next point, not past the end."""
    pace = Pace(local_steps=10)
    pace.steps = 3  # points 0, 4, 7, 10
    assert [pace.advance(s) for s in (1, 2, 5, 8, 9)] == [3, 2, 2, 2, 1]


def test_a_disabled_pace_keeps_every_step():
    pace = Pace(local_steps=40, enabled=False)
    for _ in range(4):
        assert pace.update(1.0, 0.1) == 40
    assert pace.stride == 1.0
