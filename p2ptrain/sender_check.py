"""Catching a poisoning sender by how its pseudo-gradient compares with the other senders' of the same round.

Each round, every sender's pseudo-gradient (all of its tensors as one vector) is compared with the coordinatewise
median of the others': its cosine with that median, relative to the median of the others' own cosines, and its norm
over the median of their norms. Relative, because the honest cosines of a run spread from 0.35 to 0.98 as training
goes on (tiny model, H = 15: docs/bench/2026-11-29-attack-suite), while within one round they stay together. A sender
is flagged in a round when its relative cosine is below ``COSINE_FLOOR`` or its norm ratio is beyond ``NORM_BOUND``
either way, and convicted when flagged in ``ROUNDS`` rounds in a row: chance singles out one honest sender of n in a
round, seldom in three in a row.

Both sums compose over the all-reduce's ranges: with a coordinatewise median, a sender's dot product with the median
and its squared norm are sums over ranges, so reducers that each hold one range can add up exact scores (``partial``
and ``RangeSums``). What it cannot see: a pseudo-gradient that points the honest way at the honest norm (a small
drift, a stale round, the same data read twice) and any attack by half of the senders or more, whose median is the
attackers'. Plain values and torch; no network.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch

COSINE_FLOOR = 0.5
"""a sender whose cosine with the median of the others is below this fraction of the others' median cosine is flagged.
Over 44 recorded 40-round runs of 4 and 6 replicas (6400 honest sender-rounds, docs/bench/2026-11-29-sender-check)
honest senders fell below 0.5 twice, never two rounds in a row; at 0.6 an honest replica whose shard drifted from the
others' was convicted (0.53, 0.37, 0.57 in rounds 34-36 of a trim+check run of 6). A sign flip measured below -1, a
fixed direction -0.86 (median), data other than claimed -0.77"""
NORM_BOUND = 2.0
"""a sender whose norm is more than this many times the others' median norm, or less than its inverse, is flagged:
honest ratios measured 0.77-1.3, a 5x scaled one 4.1 or more"""
ROUNDS = 3
"""rounds in a row a sender must be flagged in to be convicted"""
MIN_SENDERS = 4
"""fewer senders in a round: no flag (the median of two others is their mean, and one attacker of three owns half)"""


@dataclass(frozen=True)
class Score:
    """One sender in one round: its cosine with the coordinatewise median of the others' pseudo-gradients, that over
    the median of the others' cosines (``relative``), its norm over the median of theirs."""

    cosine: float
    relative: float
    norm_ratio: float

    def flagged(self, cosine_floor: float = COSINE_FLOOR, norm_bound: float = NORM_BOUND) -> bool:
        return self.relative < cosine_floor or not 1.0 / norm_bound <= self.norm_ratio <= norm_bound


@dataclass
class RangeSums:
    """One range's sums for every sender: dot product with the coordinatewise median of the others on the range, the
    sender's squared norm and the median's. Added over ranges, they give the whole vectors' scores (``scores_of``)."""

    dots: List[float]
    squares: List[float]
    median_squares: List[float]

    def __add__(self, other: "RangeSums") -> "RangeSums":
        return RangeSums([a + b for a, b in zip(self.dots, other.dots)],
                         [a + b for a, b in zip(self.squares, other.squares)],
                         [a + b for a, b in zip(self.median_squares, other.median_squares)])


NETWORK_ROWS = 16
"""up to this many senders the columns are sorted by a network of elementwise min/max (10x torch's sort along the
rows: 0.03 against 0.39 CPU seconds for a 25M model's range in a group of 4); more, by torch.sort"""


def others_medians(flat: torch.Tensor) -> torch.Tensor:
    """Row i: the coordinatewise median of every row but i (torch's median: the lower middle of an even count). One
    sort of the n rows serves all n: with k = (n - 2) // 2, the others' median is the sorted column's (k+1)-th value
    where row i's value is at most its k-th (removing it moves the rest down), else its k-th. A value tied with the
    k-th gives the same either way."""
    n = len(flat)
    if n < 2:
        return torch.zeros_like(flat)
    k = (n - 2) // 2
    if n > NETWORK_ROWS:
        ordered = list(flat.sort(dim=0).values[k:k + 2])
    else:
        ordered = list(flat.unbind(0))
        for r in range(n):  # odd-even transposition: n rounds sort n rows
            for j in range(r % 2, n - 1, 2):
                ordered[j], ordered[j + 1] = torch.minimum(ordered[j], ordered[j + 1]), \
                    torch.maximum(ordered[j], ordered[j + 1])
        ordered = ordered[k:k + 2]
    return torch.where(flat <= ordered[0], ordered[1], ordered[0])


def partial(parts: Sequence[torch.Tensor]) -> RangeSums:
    """The sums of one range, from each sender's part of it (the same range of every sender's vector)."""
    with torch.no_grad():
        flat = torch.stack([part.reshape(-1) for part in parts]).float()
        medians = others_medians(flat)
        # products in the parts' fp32, summed in fp64: the sums of any split into ranges agree to ~1e-12
        dots = (flat * medians).sum(dim=1, dtype=torch.float64)
        squares = (flat * flat).sum(dim=1, dtype=torch.float64)
        median_squares = (medians * medians).sum(dim=1, dtype=torch.float64)
    return RangeSums(dots.tolist(), squares.tolist(), median_squares.tolist())


def weighed_partial(parts: Sequence[Optional[torch.Tensor]], weights: Sequence[float]) -> RangeSums:
    """``partial`` over the senders whose part is there (not None) with a weight above 0, in the senders' order; 0
    for every other sender (a newcomer's zeros, a part left out of the average), and for all with fewer than 2. What a
    reducer signs of each part, and what an auditor recomputes."""
    scored = [i for i, (part, weight) in enumerate(zip(parts, weights)) if part is not None and weight > 0]
    sums = RangeSums([0.0] * len(parts), [0.0] * len(parts), [0.0] * len(parts))
    if len(scored) >= 2:
        part = partial([parts[i] for i in scored])
        for i, dot, square, median_square in zip(scored, part.dots, part.squares, part.median_squares):
            sums.dots[i], sums.squares[i], sums.median_squares[i] = dot, square, median_square
    return sums


def scores_of(sums: RangeSums) -> List[Score]:
    """Every sender's score from the sums over all ranges."""
    norms = [math.sqrt(s) for s in sums.squares]
    cosines = [dot / (norm * math.sqrt(m)) if norm and m else 0.0
               for dot, norm, m in zip(sums.dots, norms, sums.median_squares)]
    scores = []
    for i, (cosine, norm) in enumerate(zip(cosines, norms)):
        others = [c for j, c in enumerate(cosines) if j != i]
        other_norms = [n for j, n in enumerate(norms) if j != i]
        typical = statistics.median(others) if others else 0.0
        typical_norm = statistics.median(other_norms) if other_norms else 0.0
        # the others disagreeing among themselves (early rounds, tiny groups) says nothing about this one
        relative = cosine / typical if typical > 0 else 1.0
        scores.append(Score(cosine, relative, norm / typical_norm if typical_norm else 1.0))
    return scores


def round_scores(vectors: Sequence[Sequence[torch.Tensor]]) -> List[Score]:
    """Every sender's score from their whole pseudo-gradients (one list of tensors per sender): one range."""
    return scores_of(partial([torch.cat([t.reshape(-1) for t in tensors]) for tensors in vectors]))


@dataclass
class Conviction:
    """A sender convicted: the round it was convicted in, and the scores of the rounds that convicted it."""

    sender: str
    round: int
    evidence: List[Tuple[int, Score]]


@dataclass
class SenderCheck:
    """Flags and convicts senders round after round (``observe``); a convicted sender stays convicted."""

    cosine_floor: float = COSINE_FLOOR
    norm_bound: float = NORM_BOUND
    rounds: int = ROUNDS
    min_senders: int = MIN_SENDERS
    convicted: Dict[str, Conviction] = field(default_factory=dict)
    flags: int = 0
    """flags raised so far, on any sender"""
    _streaks: Dict[str, List[Tuple[int, Score]]] = field(default_factory=dict)
    _round: int = 0

    def observe(self, scores: Mapping[str, Score]) -> List[Conviction]:
        """One round's scores (sender -> score, convicted senders already left out by the caller); returns the
        senders convicted in it."""
        self._round += 1
        new: List[Conviction] = []
        for sender, score in scores.items():
            if sender in self.convicted:
                continue
            if len(scores) < self.min_senders or not score.flagged(self.cosine_floor, self.norm_bound):
                self._streaks.pop(sender, None)
                continue
            self.flags += 1
            streak = self._streaks.setdefault(sender, [])
            streak.append((self._round, score))
            if len(streak) >= self.rounds:
                self.convicted[sender] = conviction = Conviction(sender, self._round, list(streak))
                new.append(conviction)
                del self._streaks[sender]
        return new

    def admitted(self, senders: Sequence[str]) -> List[bool]:
        """Which of ``senders`` a round still averages."""
        return [sender not in self.convicted for sender in senders]

    def first_conviction(self, sender: str) -> Optional[int]:
        conviction = self.convicted.get(sender)
        return conviction.round if conviction is not None else None
