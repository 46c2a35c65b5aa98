"""Catching a sender by redoing its work: a verifier replays a sender's phase and compares what it sent.

A DiLoCo pseudo-gradient is H inner steps from the global parameters, so it is a function of what its sender can
name before the round: the parameters it started from (everyone's), its inner optimizer's state then, its shard and
cursor, its steps. A verifier that loads that state, trains the same steps on the same batches and takes the
pseudo-gradient the same way gets the sender's, up to floating-point order: on one CPU with the same thread count,
bit for bit; with another thread count, 7e-6 of its norm after 15 steps, 1.5e-5 after 60 and 8.4e-5 after 240
(tiny model, fp32; the wire's fp16 rounding adds nothing measurable). ``TOLERANCE`` is 100x the largest of those.

What it catches: anything that is not the claimed work, whatever its direction or size (a scale, a flip, a fixed
direction, a small drift, a stale round, other data than claimed), the first time it is replayed. What it costs: the
replayed steps, one sender's phase each, and the bytes of the sender's inner optimizer state (two values per
parameter for AdamW). So a rate of audits is a rate of compute: auditing each sender with probability ``rate`` per
round costs every peer ``rate`` of its training on average, and an attacker is caught in 1/``rate`` rounds on average.
What it cannot see: an inner state that the sender crafted in an earlier round that nobody replayed (the state a
replay starts from is the sender's word, chained to its previous round's end), and hardware whose nondeterminism
exceeds the tolerance (bf16 on GPUs: unmeasured). Plain torch; no network.
"""

from __future__ import annotations

import random
from typing import Hashable, List, Optional, Sequence, Tuple

import torch

TOLERANCE = 1e-2
"""a replayed pseudo-gradient further than this fraction of its norm from the sent one convicts its sender: honest
replays measured 0 (same thread count) to 8.4e-5 (another thread count, 240 steps); the smallest attack of the suite,
a drift, is 0.2"""


@torch.no_grad()
def deviation(sent: Sequence[torch.Tensor], replayed: Sequence[torch.Tensor]) -> float:
    """How far a sent pseudo-gradient is from its replay, relative to the replay's norm, both rounded to fp16 as the
    wire rounds them (all tensors as one vector); inf where the replay is zero and the sent is not."""
    if len(sent) != len(replayed):
        raise ValueError(f"{len(sent)} sent tensors against {len(replayed)} replayed ones")
    apart = norm = 0.0
    for s, r in zip(sent, replayed):
        if s.shape != r.shape:
            raise ValueError(f"a sent tensor of shape {tuple(s.shape)} against a replayed one of {tuple(r.shape)}")
        s16, r16 = s.detach().half().double(), r.detach().half().double()
        apart += float((s16 - r16).square().sum())
        norm += float(r16.square().sum())
    if apart == 0.0:
        return 0.0
    return (apart / norm) ** 0.5 if norm > 0 else float("inf")


def verdict(away: float, tolerance: float = TOLERANCE) -> Optional[str]:
    """None when a sent pseudo-gradient ``away`` (its ``deviation``) from its replay is within ``tolerance``; else why
    its sender is convicted."""
    if away <= tolerance:
        return None
    return (f"its pseudo-gradient is {away:.3g} of its norm away from a replay of its claimed work "
            f"(tolerance {tolerance:g})")


class Audits:
    """Which senders a round's members replay: each sender with probability ``rate``, by one other member, drawn from
    a generator the senders cannot read (a verifier's choice is secret until it asks for the state)."""

    def __init__(self, rate: float, seed: Optional[int] = None):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"a replay rate must be in [0, 1], got {rate}; 0 replays nobody, 1 every sender each "
                             "round")
        self.rate = rate
        self.replayed = 0
        self._random = random.Random(seed)

    def draw(self, senders: Sequence[Hashable]) -> List[Tuple[Hashable, Hashable]]:
        """(verifier, sender) pairs for one round of ``senders``: a sender is replayed with probability ``rate``, by
        a member other than itself, chosen uniformly."""
        pairs = []
        for sender in senders:
            others = [s for s in senders if s != sender]
            if others and self._random.random() < self.rate:
                pairs.append((self._random.choice(others), sender))
        self.replayed += len(pairs)
        return pairs
