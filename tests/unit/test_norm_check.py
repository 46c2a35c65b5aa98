"""The all-reduce's norm check (norm_check.NormCheck, ExactAllReduceRunner's): a part far larger than ours is refused, a small
range where our own values happen to be tiny is not (honest peers' norms over a few values can differ by any factor;
refusing one banned an honest peer and split a group in CI)."""

from __future__ import annotations

import math
import torch

from p2ptrain.averaging.norm_check import NormCheck


def check(values, own, own_rms: float, ratio: float = 10.0) -> str:
    return NormCheck(ratio, own_rms).check(("received", 0), values, own, "part #0")


def test_a_part_ten_times_larger_than_ours_is_refused():
    own = torch.full((1000,), 0.01)  # norm 0.316; our whole vector has the same RMS, 0.01
    assert check(own * 9.9, own, own_rms=0.01) == ""
    assert check(own * 10.5, own, own_rms=0.01).startswith("part #0 with norm 3.32, more than 10x our own 0.316")


def test_a_small_range_where_our_values_cancelled_is_judged_against_our_whole_vector():
    own = torch.tensor([1e-5, -1e-5])  # a bias whose steps cancelled out
    theirs = torch.tensor([0.02, 0.03])  # another honest peer's: 2000x ours, ordinary for the vector (RMS 0.01)
    assert check(theirs, own, own_rms=0.01) == ""
    poison = torch.tensor([1.0, 1.0])  # 100x what our vector holds per value
    assert "more than 10x our own" in check(poison, own, own_rms=0.01)
    assert math.isclose(0.01 * math.sqrt(2), 0.01414, rel_tol=1e-3)  # the reference the message names
    assert "our own 0.01414" in check(poison, own, own_rms=0.01)


def test_with_nothing_of_our_own_every_finite_part_is_taken_and_nan_never():
    zeros = torch.zeros(4)  # a newcomer's contribution to a round it joins with weight 0
    assert check(torch.full((4,), 1e6), zeros, own_rms=0.0) == ""
    assert check(torch.tensor([1.0, float("nan"), 0.0, 0.0]), zeros, own_rms=0.0) == "part #0 with NaN or infinite values"


def test_a_stepped_state_is_judged_by_its_distance_from_ours_against_our_pseudo_gradient():
    """Mixing groups average parameters (norm ~ 1 per value) whose honest differences are the size of a few
    pseudo-gradients (~ 0.01): a plain norm check at 10x would let a member shift them by 10x their own size, so
    the distance from our own values is held to 10x our pseudo-gradient over the range instead."""
    own = torch.full((1000,), 1.0)
    scale = torch.full((1000,), 0.01)  # our pseudo-gradient over the range: norm 0.316

    def centered(values):
        return NormCheck(10.0, own_rms=0.01).check(("received", 0), values, own, "part #0", scale)

    assert centered(own + 0.05) == ""  # another group's parameters, 5 pseudo-gradients away
    assert centered(own * 2).startswith("part #0 at a distance 31.62 from our own values, more than 10x our "
                                        "pseudo-gradient's norm 0.3162")
    assert check(own * 2, own, own_rms=1.0) == ""  # what the plain check would have let through
    assert "NaN" in centered(torch.full((1000,), float("inf")))
