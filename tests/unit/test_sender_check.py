"""The sender check's scores and its conviction rule (p2ptrain/sender_check.py), on made-up pseudo-gradients."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.sender_check import (MIN_SENDERS, NETWORK_ROWS, ROUNDS, RangeSums, SenderCheck, others_medians, partial,
                                   round_scores, scores_of)


def honest_round(n: int, generator: torch.Generator, noise: float = 0.8) -> list:
    """n senders' pseudo-gradients (two tensors each): one shared direction plus each sender's own noise."""
    shared = [torch.randn(300, generator=generator), torch.randn(20, 10, generator=generator)]
    return [[t + noise * torch.randn(t.shape, generator=generator) for t in shared] for _ in range(n)]


def test_the_sums_of_the_ranges_give_the_whole_vectors_scores():
    """Reducers that each hold one range can add up exact scores: the median is coordinatewise."""
    vectors = honest_round(5, torch.Generator().manual_seed(0))
    flat = [torch.cat([t.reshape(-1) for t in tensors]) for tensors in vectors]
    cuts = [0, 37, 180, 333, flat[0].numel()]
    sums = RangeSums([0.0] * 5, [0.0] * 5, [0.0] * 5)
    for start, end in zip(cuts, cuts[1:]):
        sums = sums + partial([f[start:end] for f in flat])
    for whole, added in zip(round_scores(vectors), scores_of(sums)):
        assert added.cosine == pytest.approx(whole.cosine, rel=1e-9)
        assert added.relative == pytest.approx(whole.relative, rel=1e-9)
        assert added.norm_ratio == pytest.approx(whole.norm_ratio, rel=1e-9)


def test_honest_senders_are_never_flagged():
    generator = torch.Generator().manual_seed(1)
    check = SenderCheck()
    for _ in range(50):
        scores = round_scores(honest_round(4, generator))
        assert check.observe({f"peer{i}": s for i, s in enumerate(scores)}) == []
    assert check.flags == 0 and not check.convicted


@pytest.mark.parametrize("attack", [
    lambda tensors: [-t for t in tensors],  # a sign flip at the honest norm: the direction
    lambda tensors: [5 * t for t in tensors],  # x5, pointing the honest way: the norm
    lambda tensors: [0.1 * t for t in tensors],  # a sender that hardly trained: the norm, the other way
])
def test_an_attacker_is_convicted_in_the_third_round_with_the_rounds_that_convicted_it(attack):
    generator = torch.Generator().manual_seed(2)
    check = SenderCheck()
    convicted_in = None
    for r in range(1, 6):
        vectors = honest_round(4, generator)
        senders = ["a", "b", "c", "evil"]
        vectors[3] = attack(vectors[3])
        kept = [(s, v) for s, v, ok in zip(senders, vectors, check.admitted(senders)) if ok]
        scores = round_scores([v for _, v in kept])
        new = check.observe({s: score for (s, _), score in zip(kept, scores)})
        if new:
            assert convicted_in is None and [c.sender for c in new] == ["evil"]
            convicted_in = r
            assert [round_ for round_, _ in new[0].evidence] == [1, 2, 3]
            assert all(score.flagged() for _, score in new[0].evidence)
    assert convicted_in == ROUNDS
    assert check.admitted(["a", "evil"]) == [True, False]
    assert check.first_conviction("evil") == ROUNDS and check.first_conviction("a") is None


def test_a_sender_flagged_in_rounds_apart_is_not_convicted():
    generator = torch.Generator().manual_seed(3)
    check = SenderCheck()
    for r in range(12):
        vectors = honest_round(4, generator)
        if r % ROUNDS != 0:  # flagged in two rounds of every three: never three in a row
            vectors[0] = [-t for t in vectors[0]]
        check.observe({f"peer{i}": s for i, s in enumerate(round_scores(vectors))})
    assert check.flags == 8 and not check.convicted


def test_with_fewer_senders_than_the_check_needs_nobody_is_flagged():
    generator = torch.Generator().manual_seed(4)
    check = SenderCheck()
    for _ in range(5):
        vectors = honest_round(MIN_SENDERS - 1, generator)
        vectors[0] = [-5 * t for t in vectors[0]]
        check.observe({f"peer{i}": s for i, s in enumerate(round_scores(vectors))})
    assert check.flags == 0 and not check.convicted


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6, 8])
def test_one_sort_gives_each_senders_others_median_as_torch_computes_it(n):
    generator = torch.Generator().manual_seed(n)
    flat = torch.randn(n, 500, generator=generator).double()
    flat[:, :50] = flat[0, :50].clone()  # ties: every sender the same value
    flat[1:3, 50:100] = flat[1, 50:100].clone()  # ties between two of them
    for i, median in enumerate(others_medians(flat)):
        assert torch.equal(median, torch.cat([flat[:i], flat[i + 1:]]).median(dim=0).values), i


def test_more_senders_than_the_network_sorts_take_torchs_sort_to_the_same_medians():
    flat = torch.randn(NETWORK_ROWS + 3, 200, generator=torch.Generator().manual_seed(9)).double()
    for i, median in enumerate(others_medians(flat)):
        assert torch.equal(median, torch.cat([flat[:i], flat[i + 1:]]).median(dim=0).values), i
