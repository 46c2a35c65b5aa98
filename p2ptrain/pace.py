"""Adaptive inner steps (DyLU-like): a peer persistently slower than the swarm takes fewer inner steps per phase, so
it reaches each sync point with the others instead of holding them up or being left out.

Every peer counts its ``local_step`` on the swarm's clock: a peer of stride s advances it by s per inner step it
actually takes (never past the phase's end), so it syncs at the same local step as everyone, its learning-rate
schedule stays the swarm's, and its pseudo-gradient holds H / s inner steps, weighted in the average by the samples it
actually trained on (the weight every member sends). Dynamic Local Updates (Forgather's DiLoCo server, after Liu et
al.) gives each worker a number of local steps proportional to its speed in the same way.

The stride is the ratio of this peer's time per inner step to the fastest other live peer's (every peer publishes the
median of its recent inner steps' seconds in its progress record), rounded, once that ratio reached ``SLOW_RATIO``
at two phase ends in a row; it moves again (either way) only when two looks in a row want it more than half a step
away. A step time, not a peer's progress through the
phases: a fast peer that waits for a slow one at every sync moves through the phases as slowly as that one. Plain
values: no torch, no network.
"""

from __future__ import annotations

import collections
import statistics
from typing import Deque, Optional

SLOW_RATIO = 1.75
"""a peer whose inner step takes this many times the fastest peer's (or more) is slow: it steps with a stride"""
LOOKS_TO_CHANGE = 2
"""phase ends in a row that must want the stride moved (the same way) before it moves: noise is not a trend"""


def stride_for(ratio: Optional[float], local_steps: int) -> int:
    """The stride for a peer whose inner step takes ``ratio`` times the fastest peer's (None: unknown). At least 2
    inner steps per phase are kept."""
    if ratio is None or ratio < SLOW_RATIO:
        return 1
    return max(1, min(int(ratio + 0.25), local_steps // 2))


class Pace:
    """A peer's stride, from one look per phase end at its own step time and the fastest peer's."""

    def __init__(self, local_steps: int, enabled: bool = True):
        self.local_steps, self.enabled = local_steps, enabled
        self.stride = 1
        self.ratio: Optional[float] = None
        self._looks, self._direction = 0, 0  # looks in a row that wanted the stride moved, and which way
        self._step_times: Deque[float] = collections.deque(maxlen=32)  # seconds of recent inner steps

    def record_step(self, seconds: float) -> None:
        """One inner step's seconds: forward, backward, data and the update, not the sync work around it."""
        self._step_times.append(seconds)

    @property
    def step_s(self) -> Optional[float]:
        """The median of the recent inner steps' seconds (None until there are a few): what the peer publishes."""
        return statistics.median(self._step_times) if len(self._step_times) >= 4 else None

    def update(self, step_s: Optional[float], fastest_step_s: Optional[float]) -> int:
        """Take one look (at a phase end) at this peer's step time and the fastest other peer's; return the stride
        for the next phase. The stride moves only when ``LOOKS_TO_CHANGE`` looks in a row want it moved the same
        way, and not while the ratio stays within half a step of it (CPU noise on a shared host made a 2x slower peer
        measure 1.6x to 2.8x from one phase to the next)."""
        if not self.enabled:
            return self.stride
        self.ratio = step_s / fastest_step_s if step_s and fastest_step_s else None
        if self.ratio is None:  # nothing to compare with (a read of the records failed): no news, no change
            self._looks, self._direction = 0, 0
            return self.stride
        want = stride_for(self.ratio, self.local_steps)
        near = self.ratio is not None and self.stride > 1 and abs(self.ratio - self.stride) < 0.5
        if want == self.stride or near:
            self._looks, self._direction = 0, 0
            return self.stride
        direction = 1 if want > self.stride else -1
        self._looks = self._looks + 1 if direction == self._direction else 1
        self._direction = direction
        if self._looks >= LOOKS_TO_CHANGE:
            self.stride, self._looks, self._direction = want, 0, 0
        return self.stride

    def advance(self, local_step: int) -> int:
        """How far ``local_step`` moves for one inner step: the stride, never past the phase's end."""
        return min(self.stride, self.local_steps - local_step % self.local_steps)
