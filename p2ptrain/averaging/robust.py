"""Robust aggregation at a reducer: what one insider can do to the average of a group's pseudo-gradients.

With the plain mean, a member that holds the swarm key moves its group's average by its own contribution / n, and
the only limit is the norm check (``max_norm_ratio``, 10x the reducer's own norm over the same range): scaled x5,
sign-flipped or pointed anywhere within that norm, it is averaged in like anyone else. A reducer sees every member's
contribution to its part before it answers (``TensorPartReducer`` waits for all of them), so it can aggregate them
robustly instead. Two rules, chosen with ``--aggregation``:

Under every rule, the mean included, a member's weight counts at most ``WEIGHT_CAP`` x the median of the weights
its group gathered (``weight_cap``): a weight is the member's own claim of its samples, and without the cap one
member claiming 10^9 samples made the mean its own pseudo-gradient. Honest members train about the same samples per
phase (adaptive inner steps), so the cap binds on nobody honest but a peer more than twice as fast as the median
that runs with --no-adaptive-steps.

- ``clip``: centered clipping (Karimireddy, He and Jaggi 2021, "Learning from History for Byzantine Robust
  Optimization"). Start from the coordinate-wise median v; then, ``CLIP_ITERATIONS`` times,
  ``v <- v + sum_i w_i clip(x_i - v, tau) / sum_i w_i`` with ``clip(z, tau) = z min(1, tau / |z|)`` and
  ``tau = CLIP_RADIUS x`` the median of the members' distances to the starting median.
  Guarantee: each iteration moves v by at most ``tau x w_i / sum w`` per member, so f attackers shift the result by
  at most ``CLIP_ITERATIONS x tau x`` their share of the (capped) weight, whatever they send; tau is set by the
  honest majority's spread (the median distance) as long as attackers are fewer than half. When nobody is far from
  the median (no clip binds) the result is the weighted mean: honest groups lose nothing.
- ``trim``: the coordinate-wise trimmed mean: per value, drop the ``b`` largest and ``b`` smallest of the members'
  values and average the rest (unweighted), ``b = max(1, floor(TRIM_SHARE x n))``. Guarantee: with at most b
  attackers every value of the result lies within the range of the honest members' values. It throws away honest
  information too (with n = 3 it is the median), so it costs accuracy when nobody attacks.

Any of them named with ``CHECKED`` ("trim+check") also runs the sender check (``sender_check.py``): each reducer
sums every sender's scores over its range into its signed receipts, and every member convicts a sender its checks
flag three rounds in a row (``averaging/sender_scores.py``).

Both need n >= 3: in a group of 2 nobody can tell the honest member from the other, and the result is the mean.
Members that weigh 0 (a newcomer with nothing to add, a diverged peer) are left out, as in the mean. The reducer
computes the aggregate once and sends the same bits to every member, so the members stay bit-identical.
"""

from __future__ import annotations

import math
import statistics
from typing import Iterable, Sequence

import torch

RULES = ("mean", "clip", "trim")
CHECKED = "+check"
"""an aggregation's suffix: the sender check acts too (sender_check.py)"""
AGGREGATIONS = (*RULES, *(rule + CHECKED for rule in RULES))
CLIP_RADIUS = 2.0
"""tau = this x the median distance of the members' contributions to their coordinate-wise median. Honest
pseudo-gradients lie at similar distances from their median (many values, independent noise), so at 2x none of
them is clipped and the result is their mean"""
CLIP_ITERATIONS = 3
WEIGHT_CAP = 2.0
"""a member's weight counts at most this x the median weight its group gathered (``weight_cap``; every rule)"""
TRIM_SHARE = 0.25
"""``trim`` drops this share of the members (at least 1) at each end of every value"""


def weight_cap(weights: Iterable[float]) -> float:
    """The most one member's weight counts in a group that gathered ``weights``: ``WEIGHT_CAP`` x their median
    (over the members with a finite weight above 0; infinity if there are none). Every member computes it from the
    same gathered weights, so the reducers agree."""
    positive = [float(w) for w in weights if 0 < float(w) < math.inf]
    return WEIGHT_CAP * statistics.median(positive) if positive else math.inf


def rule_of(aggregation: str) -> str:
    """The rule that combines the parts: the aggregation without its ``CHECKED`` suffix."""
    return aggregation.removesuffix(CHECKED)


def checks_senders(aggregation: str) -> bool:
    return aggregation.endswith(CHECKED)


def check_aggregation(name: str, sparse: bool = False, signed: bool = True) -> str:
    """``name``, if an averager can run it: a known aggregation, a butterfly round unless it is "mean" (``sparse``:
    the sparse codec's all-gather), receipts the reducers sign under the sender check (``signed``)."""
    if name not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {name!r}: choose one of {', '.join(AGGREGATIONS)}")
    if name != "mean" and sparse:
        raise ValueError(f"aggregation {name!r} needs a butterfly round: the sparse codec's all-gather averages "
                         "every member's message on every member; use aggregation 'mean' with it")
    if checks_senders(name) and not signed:
        raise ValueError(f"aggregation {name!r} needs reducers that sign their receipts (the senders' sums): start "
                         "the DHT with p2ptrain.swarm.dht.start_dht, which gives each peer its identity key")
    return name


@torch.no_grad()
def robust_aggregate(parts: Sequence[torch.Tensor], weights: Sequence[float], aggregation: str) -> torch.Tensor:
    """The aggregate of the members' ``parts`` (same shape, fp32 result) under ``aggregation``. ``weights``: their
    stated weights; members of weight 0 are left out, and a group that all weighs 0 gets zeros."""
    aggregation = rule_of(aggregation)
    members = [(part.float(), float(w)) for part, w in zip(parts, weights, strict=True) if w > 0]
    if not members:
        return torch.zeros_like(parts[0], dtype=torch.float32)
    stack = torch.stack([part for part, _ in members])
    w = torch.tensor([weight for _, weight in members], dtype=torch.float32)
    if aggregation == "mean" or len(members) < 3:
        return (stack * w.view(-1, *[1] * (stack.dim() - 1))).sum(0) / w.sum()
    if aggregation == "trim":
        n = len(members)
        b = max(1, math.floor(TRIM_SHARE * n))
        ordered = stack.sort(dim=0).values
        return ordered[b:n - b].mean(0)
    if aggregation == "clip":
        return _centered_clip(stack, w.clamp(max=WEIGHT_CAP * float(w.median())))
    raise ValueError(f"unknown aggregation {aggregation!r}")


def _centered_clip(stack: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    flat = stack.reshape(len(stack), -1)
    center = flat.median(dim=0).values
    tau = CLIP_RADIUS * float(torch.linalg.vector_norm(flat - center, dim=1).median())
    share = (w / w.sum()).view(-1, 1)
    for _ in range(CLIP_ITERATIONS):
        deltas = flat - center
        norms = torch.linalg.vector_norm(deltas, dim=1, keepdim=True)
        scale = torch.where(norms > tau, tau / norms.clamp(min=1e-30), torch.ones_like(norms))
        center = center + (share * scale * deltas).sum(0)
    return center.view(stack.shape[1:])
