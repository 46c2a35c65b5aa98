"""Adaptive inner steps (DyLU-like): a peer persistently slower than the swarm takes fewer inner steps per phase, so
it reaches each sync point with the others instead of holding them up or being left out.

Every peer counts its ``local_step`` on the swarm's clock: a peer of stride s advances it by s per inner step it
actually takes (never past the phase's end), so it syncs at the same local step as everyone, its learning-rate
schedule stays the swarm's, and its pseudo-gradient holds H / s inner steps, weighted in the average by the samples it
actually trained on (the weight every member sends). Dynamic Local Updates (Forgather's DiLoCo server, after Liu et
al.) gives each worker a number of local steps proportional to its speed in the same way.

The stride is the ratio of this peer's time per inner step to the fastest other peer's (its records' local steps
over time), rounded, once that ratio reached ``SLOW_RATIO`` at two phase ends in a row; it drops back as soon as the
ratio does. Plain values: no torch, no network.
"""

from __future__ import annotations

from typing import Optional

SLOW_RATIO = 1.75
"""a peer whose inner step takes this many times the fastest peer's (or more) is slow: it steps with a stride"""
PHASES_TO_SLOW_DOWN = 2
"""phase ends in a row at which a peer must look slow before it takes a larger stride (noise is not a trend)"""


def stride_for(ratio: Optional[float], local_steps: int) -> int:
    """The stride for a peer whose inner step takes ``ratio`` times the fastest peer's (None: unknown). At least 2
    inner steps per phase are kept."""
    if ratio is None or ratio < SLOW_RATIO:
        return 1
    return max(1, min(int(ratio + 0.25), local_steps // 2))


class Pace:
    """A peer's stride, from one look per phase end at its own step time and the swarm's pace."""

    def __init__(self, local_steps: int, enabled: bool = True):
        self.local_steps, self.enabled = local_steps, enabled
        self.stride = 1
        self.ratio: Optional[float] = None
        self._slow_looks = 0

    def update(self, step_s: Optional[float], swarm_steps_per_s: Optional[float]) -> int:
        """Take one look (at a phase end) and return the stride for the next phase."""
        if not self.enabled:
            return self.stride
        self.ratio = step_s * swarm_steps_per_s if step_s and swarm_steps_per_s else None
        want = stride_for(self.ratio, self.local_steps)
        if want > self.stride:
            self._slow_looks += 1
            if self._slow_looks >= PHASES_TO_SLOW_DOWN:
                self.stride, self._slow_looks = want, 0
        else:
            self.stride, self._slow_looks = want, 0
        return self.stride

    def advance(self, local_step: int) -> int:
        """How far ``local_step`` moves for one inner step: the stride, never past the phase's end."""
        return min(self.stride, self.local_steps - local_step % self.local_steps)
