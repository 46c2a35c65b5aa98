"""Robust aggregation (averaging/robust.py): its stated guarantees, and the reducer that applies it."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from p2ptrain.averaging.robust import CLIP_ITERATIONS, CLIP_RADIUS, WEIGHT_CAP, robust_aggregate, weight_cap
from p2ptrain.outer import group_average
from p2ptrain.averaging.compression import get_compression
from tests.reducers import reduce_part


def honest(n: int, size: int = 4096, seed: int = 0, spread: float = 0.5) -> list:
    """n pseudo-gradients of one direction plus independent noise: what honest peers send."""
    gen = torch.Generator().manual_seed(seed)
    signal = torch.randn(size, generator=gen)
    return [signal + spread * torch.randn(size, generator=gen) for _ in range(n)]


def test_mean_is_the_weighted_mean_and_weight_zero_adds_nothing():
    parts = honest(3)
    got = robust_aggregate(parts + [torch.full((4096,), 1e6)], [1.0, 2.0, 3.0, 0.0], "mean")
    assert torch.allclose(got, (parts[0] + 2 * parts[1] + 3 * parts[2]) / 6, atol=1e-6)
    assert torch.equal(robust_aggregate(parts, [0.0, 0.0, 0.0], "clip"), torch.zeros(4096))


@pytest.mark.parametrize("aggregation", ["clip", "trim"])
def test_groups_of_two_get_the_mean(aggregation):
    parts = honest(2)
    assert torch.allclose(robust_aggregate(parts, [1.0, 1.0], aggregation), (parts[0] + parts[1]) / 2)


@pytest.mark.parametrize("n", [3, 4, 8])
def test_clip_gives_an_honest_group_its_weighted_mean(n):
    """No honest member is twice the median distance from the median: nothing is clipped, nothing is lost."""
    parts = honest(n, seed=n)
    weights = [1.0 + i % 2 for i in range(n)]  # within WEIGHT_CAP of the median
    mean = sum(w * p for w, p in zip(weights, parts)) / sum(weights)
    assert torch.allclose(robust_aggregate(parts, weights, "clip"), mean, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(3, 8), scale=st.floats(-1e4, 1e4), seed=st.integers(0, 1000),
       weight=st.floats(1.0, 1e9))
def test_one_attacker_moves_clip_by_at_most_its_bounded_share(n, scale, seed, weight):
    """Whatever one member sends, and whatever weight it claims, the result moves from the honest members' own
    aggregate by at most CLIP_ITERATIONS x tau x its capped share of the weight (tau from the honest spread)."""
    parts = honest(n - 1, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    attack = scale * torch.randn(4096, generator=gen)
    got = robust_aggregate(parts + [attack], [1.0] * (n - 1) + [weight], "clip")
    flat = torch.stack(parts + [attack])
    tau = CLIP_RADIUS * float(torch.linalg.vector_norm(flat - flat.median(0).values, dim=1).median())
    share = min(weight, WEIGHT_CAP) / (n - 1 + min(weight, WEIGHT_CAP))
    without = robust_aggregate(parts, [1.0] * (n - 1), "mean")
    # the honest members' own pull is bounded by tau too: their mean is within reach of the clipped iteration
    assert float(torch.linalg.vector_norm(got - without)) <= CLIP_ITERATIONS * tau * share + tau


@pytest.mark.parametrize("n,attackers", [(3, 1), (4, 1), (8, 2)])
def test_trim_stays_within_the_honest_values(n, attackers):
    parts = honest(n - attackers)
    lies = [torch.full((4096,), 1e4 * (-1) ** i) for i in range(attackers)]
    got = robust_aggregate(parts + lies, [1.0] * n, "trim")
    stack = torch.stack(parts)
    assert bool((got >= stack.min(0).values).all()) and bool((got <= stack.max(0).values).all())


def test_a_sign_flipper_moves_clip_far_less_than_the_mean():
    parts = honest(3, spread=0.3)
    flipped = -5 * parts[0]
    truth = robust_aggregate(parts, [1.0] * 3, "mean")
    mean = robust_aggregate(parts + [flipped], [1.0] * 4, "mean")
    clip = robust_aggregate(parts + [flipped], [1.0] * 4, "clip")
    assert torch.linalg.vector_norm(clip - truth) < 0.3 * torch.linalg.vector_norm(mean - truth)


def test_the_reducer_answers_the_aggregate_in_group_order_whatever_the_arrival_order():
    """Every sender gets the same bits, equal to robust_aggregate over the senders in the group's order."""
    parts = honest(4, size=64)
    weights = [1.0, 3.0, 2.0, 1.0]
    for seed in range(3):
        order = list(range(4))
        random.Random(seed).shuffle(order)
        answers, _ = reduce_part(parts, weights, "clip", order)
        for answer in answers:
            assert torch.equal(answer, robust_aggregate(parts, weights, "clip"))


def test_the_simulation_aggregates_wire_part_by_wire_part():
    """group_average's robust path cuts tensors as the wire does: with parts of 16 values, a lie confined to one
    part leaves the others at their honest aggregate."""
    codec = get_compression("none")
    parts = honest(3, size=64)
    lie = parts[0].clone()
    lie[:16] = 1e4
    got = group_average([[p] for p in parts + [lie]], [1.0] * 4, codec, 16 * 4, "trim")[0]
    assert torch.equal(got[16:], robust_aggregate([p[16:] for p in parts + [lie]], [1.0] * 4, "trim"))
    assert float(got[:16].abs().max()) < 100


def test_a_claimed_weight_counts_at_most_twice_the_median():
    """Under every rule, the mean included: a member claiming 10^9 samples counts as 2x the median claim."""
    assert weight_cap([24.0, 24.0, 24.0, 1e9]) == 2 * 24.0
    assert weight_cap([0.0, 0.0]) == float("inf")
    parts = honest(3, size=64)
    lie = -5 * parts[0]
    weights = [24.0, 24.0, 24.0, 1e9]
    capped = reduce_part(parts + [lie], weights, "mean", range(4), weight_cap(weights))[0][0]
    assert torch.allclose(capped, (24 * (parts[0] + parts[1] + parts[2]) + 48 * lie) / (3 * 24 + 48), atol=1e-5)
    codec = get_compression("none")
    simulated = group_average([[p] for p in parts + [lie]], [24.0, 24.0, 24.0, 1e9], codec, 2 ** 19)[0]
    assert torch.allclose(simulated, capped, atol=1e-5)
