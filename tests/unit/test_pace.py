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


def test_the_step_count_drops_after_two_looks_in_a_row_and_rises_after_three():
    pace = Pace(local_steps=40)
    assert pace.update(0.13, 0.1) == 40  # 1.3x slower than the fastest peer once: could be noise
    assert pace.update(0.1, 0.1) == 40  # as fast: the count starts over
    assert pace.update(0.13, 0.1) == 40
    assert pace.update(0.14, 0.1) == 30  # twice in a row: a trend; the mean of the two looks (31 and 29)
    assert pace.stride == pytest.approx(40 / 30, abs=1e-3)
    assert pace.update(0.135, 0.1) == 30  # 30 wanted: within 8% of 30, noise, it stays
    assert pace.update(0.1, 0.1) == 30  # as fast once: speeding up always takes three looks
    assert pace.update(0.16, 0.1) == 30  # then slower (25, 17% fewer): the other way, the count starts over
    assert pace.update(0.1, 0.1) == 30 and pace.update(0.1, 0.1) == 30
    assert pace.update(0.1, 0.1) == 40  # as fast three times in a row: back to every step
    assert pace.update(None, 0.1) == 40 and pace.update(0.4, None) == 40  # unknown: no change
    pace.steps = 13
    assert pace.update(0.3, None) == 13 and pace.update(0.3, None) == 13  # unknown now: no news, no change


def test_a_clearly_slower_peer_takes_fewer_steps_at_its_first_look():
    """Waiting for the second look cost the fast peers a whole phase: 44 s of a 70 s one in the benchmark."""
    pace = Pace(local_steps=40)
    assert pace.update(0.2, 0.1) == 20  # 2x slower: half the steps, at once
    assert pace.update(0.1, 0.1) == 20 and pace.update(0.1, 0.1) == 20  # as fast once, twice: could be noise
    assert pace.update(0.1, 0.1) == 40
    assert pace.update(0.15, 0.1) == 40  # 27 wanted, a third fewer: under CLEAR_DROP, it waits for a second look
    assert pace.update(0.15, 0.1) == 27
    assert pace.update(0.3, 0.1) == 13  # then 3x: 13 wanted, half of 27, at once


def test_one_stalled_phase_halves_the_steps_at_most():
    """A phase that met a one-off stall measured 9.82x and cut H = 10 to 2: the peer then chased the swarm."""
    pace = Pace(local_steps=10)
    assert pace.update(0.982, 0.1) == 5  # one look: at most half
    assert pace.update(0.1, 0.1) == 5 and pace.update(0.1, 0.1) == 5
    assert pace.update(0.1, 0.1) == 10  # it was a stall: back after three looks
    assert pace.update(0.982, 0.1) == 5 and pace.update(0.982, 0.1) == 2  # truly that slow: the second look says so


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


def test_a_raise_goes_to_the_fewest_steps_its_looks_wanted():
    """CI, 2 cores shared with another swarm: a 2x slower peer at 14 of 40 steps read 1.2x twice in a row between
    2.9x and 2.2x; the mean of two looks took it to 33 steps, and its fast partner waited a whole phase."""
    pace = Pace(local_steps=40)
    pace.steps = 14
    assert pace.update(0.10, 0.1) == 14 and pace.update(0.155, 0.1) == 14  # 40 and 26 wanted: not yet
    assert pace.update(0.22, 0.1) == 18  # 18 wanted: three looks want more, and 18 is the least of them
    assert pace.update(0.29, 0.1) == 18  # 14 wanted once: could be noise
    assert pace.update(0.10, 0.1) == 18  # the other way: starts over


def test_a_look_the_halving_held_back_counts_toward_the_next_pair():
    """CI, 2 cores shared with another swarm: a 4x slower peer halved from 40 to 20 steps at its first look (10
    wanted), then read 3.3x (12 wanted, not 40% below 20) and waited a third look; its fast partner waited for it."""
    pace = Pace(local_steps=40)
    assert pace.update(0.4, 0.1) == 20  # 10 wanted: half at most
    assert pace.update(0.33, 0.1) == 11  # 12 wanted: with the first look, two in a row; the mean
    pace = Pace(local_steps=40)
    assert pace.update(0.2, 0.1) == 20  # 20 wanted and given: nothing held back
    assert pace.update(0.267, 0.1) == 20  # 15 wanted once: could be noise
    pace = Pace(local_steps=10)
    assert pace.update(0.982, 0.1) == 5  # a stall: 2 wanted, held back at 5
    assert pace.update(0.1, 0.1) == 5  # as fast: the other way, the pair is broken


def test_the_published_step_time_is_of_the_last_two_phases_however_few_their_steps():
    """CI: a CPU burst cut a peer to 2 of 20 steps; its window of the last 32 steps kept the burst's time for 15 phases
    after it, and the peer took 2 steps per phase to the end of the run."""
    pace = Pace(local_steps=20)
    assert pace.step_s is None
    for _ in range(3):  # three phases of 20 steps in a burst: 0.3 s each
        for _ in range(20):
            pace.record_step(0.3)
        pace.update(pace.step_s, 0.04)
    assert pace.steps == 3  # 7.5x: halved, then the pair of looks
    for phase in range(3):  # the burst is over: 3 steps per phase at 0.04 s
        for _ in range(3):
            pace.record_step(0.04)
        assert pace.step_s == (0.3 if phase == 0 else 0.04)  # the phase before still counts, then only the new ones
        pace.update(pace.step_s, 0.04)
    assert pace.update(0.04, 0.04) == 20  # three looks in a row want every step: back to 20
    pace = Pace(local_steps=1)  # one step per phase: the window reaches back to four of them
    for _ in range(4):
        pace.record_step(0.1)
        pace.update(pace.step_s, 0.1)
    pace.record_step(0.2)
    assert pace.step_s == pytest.approx(0.1)  # the median of 0.2 and the three 0.1s before it
    assert Pace(local_steps=1).step_s is None
