"""Adaptive inner steps (DyLU-like): a peer persistently slower than the swarm takes fewer inner steps per phase, so
it reaches each sync point with the others instead of holding them up or being left out.

Every peer counts its ``local_step`` on the swarm's clock. A peer that takes n < H inner steps per phase spreads
the phase's H local steps over them as evenly as whole numbers allow: inner step i of the phase moves the local step
to ceil((i+1) H / n), so some of its steps count for 2 local steps and some for 1 when it is 1.5x slower (a whole
stride left a 2.3x slower peer's partners waiting a fifth of every phase). It syncs at the same local step as
everyone, its learning-rate schedule stays the swarm's, and its pseudo-gradient holds n inner steps, weighted in the
average by the samples it actually trained on (the weight every member sends). Dynamic Local Updates (Forgather's
DiLoCo server, after Liu et al.) gives each worker a number of local steps proportional to its speed in the same
way.

n is H over the ratio of this peer's time per inner step to the fastest other live peer's (every peer publishes the
median of its recent inner steps' seconds in its progress record), rounded, once that ratio reached ``SLOW_RATIO``
at two phase ends in a row (at the first, when it wants it lowered by more than ``CLEAR_DROP``, by at most half). It
moves down again when two looks in a row want it lowered by more than ``TOLERANCE`` of itself, to the mean of what
they wanted; up only when ``LOOKS_TO_RAISE`` looks in a row want it raised, to the least of what they wanted. The two
ways cost differently: a count too high holds the fast peers up at every sync, one too low costs this peer only some
of its own samples; and under a shared CPU one look can read 1.2x for a peer that is 2x slower. A step time, not a
peer's progress through the phases: a fast peer that waits for a slow one at every sync moves through the phases as
slowly as that one. Plain values: no torch, no network.
"""

from __future__ import annotations

import collections
import statistics
from typing import Deque, Optional

SLOW_RATIO = 1.15
"""a peer whose inner step takes this many times the fastest peer's (or more) is slow: it takes fewer steps"""
LOOKS_TO_LOWER = 2
"""phase ends in a row that must want fewer steps before the count goes down: noise is not a trend"""
TOLERANCE = 0.08
"""a wanted step count within this fraction of the current one is noise (CPU contention on a shared host made a 2x
slower peer measure 1.6x to 2.8x from one phase to the next; the mean of the two looks damps the rest). Small
enough that a peer 10-15% slower than the swarm (unequal CPU shares) moves: in a streaming sync the fastest peer
otherwise waits for it at every fragment's apply step"""
CLEAR_DROP = 0.4
"""a look that wants the step count lowered by more than this fraction of it moves it at once: a peer 2x slower than
the others is no noise, and the second look cost the fast peers a whole phase of waiting (44 s of a 70 s phase, in
the benchmark's first rounds); speeding up, and smaller moves, still take more looks. One look moves it at most to
half (and, if it wanted more, counts as the first of the next pair): a phase that met a one-off stall (start-up, a
state download, another process's burst) once measured 9.82x and cut H to 2, and the peer chased the swarm for the
rest of the run (issue 34); a peer that slow halves again at its next look"""
LOOKS_TO_RAISE = 3
"""phase ends in a row that must want more steps before the count goes up. Two were not enough: on 2 cores shared
with another test's swarm a 2x slower peer measured 1.2x at two looks in a row, between looks of 2.9x and 2.2x, and
went from 14 to 33 of 40 steps (holding the fast peer up a whole phase) then back to 18 (CI, test_speeds)"""
MIN_STEPS = 2
"""the fewest inner steps a peer takes per phase, however slow"""
MIN_WINDOW = 4
"""the published step time is the median of the inner steps of the last two phases (the current one and the one
before), or of more phases until there are this many. A window counted in steps (the last 32) held a peer cut to 2
steps per phase at the step time of a CPU burst for 15 phases after the burst ended: it took 2 of 20 steps to the
end of the run (CI, test_defaults)"""


def steps_for(ratio: Optional[float], local_steps: int) -> int:
    """Inner steps per phase for a peer whose inner step takes ``ratio`` times the fastest peer's (None: unknown)."""
    if ratio is None or ratio < SLOW_RATIO:
        return local_steps
    return max(min(MIN_STEPS, local_steps), min(local_steps, round(local_steps / ratio)))


class Pace:
    """A peer's inner steps per phase, from one look per phase end at its own step time and the fastest peer's."""

    def __init__(self, local_steps: int, enabled: bool = True):
        self.local_steps, self.enabled = local_steps, enabled
        self.steps = local_steps
        """inner steps per phase: ``local_steps`` unless this peer is slow"""
        self.ratio: Optional[float] = None
        self._wanted: list = []  # the step counts the looks in a row wanted, all on the same side of ``steps``
        # seconds of the inner steps of the newest phases, the current one last
        self._phases: Deque[list] = collections.deque([[]], maxlen=5)

    @property
    def stride(self) -> float:
        """The local steps one inner step counts for, on average (1.0 unless this peer is slow)."""
        return round(self.local_steps / self.steps, 3)

    def record_step(self, seconds: float) -> None:
        """One inner step's seconds: forward, backward, data and the update, not the sync work around it."""
        self._phases[-1].append(seconds)

    @property
    def step_s(self) -> Optional[float]:
        """The median of the recent inner steps' seconds (see ``MIN_WINDOW``; None until there are that many): what
        the peer publishes."""
        recent: list = []
        for taken, phase in enumerate(reversed(self._phases), start=1):
            recent.extend(phase)
            if taken >= 2 and len(recent) >= MIN_WINDOW:
                break
        return statistics.median(recent) if len(recent) >= MIN_WINDOW else None

    def update(self, step_s: Optional[float], fastest_step_s: Optional[float]) -> int:
        """Take one look (at a phase end) at this peer's step time and the fastest other peer's; return the inner
        steps per phase for the next phase."""
        self._phases.append([])  # the steps from now on are the next phase's
        if not self.enabled:
            return self.steps
        self.ratio = step_s / fastest_step_s if step_s and fastest_step_s else None
        if self.ratio is None:  # nothing to compare with (a read of the records failed): no news, no change
            self._wanted = []
            return self.steps
        want = steps_for(self.ratio, self.local_steps)
        if abs(want - self.steps) <= TOLERANCE * self.steps:
            self._wanted = []
            return self.steps
        if self._wanted and (self._wanted[-1] > self.steps) != (want > self.steps):
            self._wanted = []  # the other way from the last look: start over
        self._wanted.append(want)
        if want > self.steps:
            if len(self._wanted) >= LOOKS_TO_RAISE:
                self.steps, self._wanted = min(self._wanted), []
        elif len(self._wanted) >= LOOKS_TO_LOWER:
            self.steps, self._wanted = round(statistics.mean(self._wanted)), []
        elif want < (1 - CLEAR_DROP) * self.steps:
            self.steps = max(want, self.steps // 2)
            # a look that wanted more than the halving gave still counts: the next look that wants fewer steps makes
            # the pair (CI: a 4x slower peer halved to 20, then read 3.3x, 12 wanted, and waited a third look)
            self._wanted = [want] if want < self.steps else []
        return self.steps

    def advance(self, local_step: int) -> int:
        """How far ``local_step`` moves for one inner step: to the next of the phase's n evenly spread points
        ceil(i H / n), so never past the phase's end (from any local step, also one off those points)."""
        in_phase = local_step % self.local_steps
        i = in_phase * self.steps // self.local_steps
        return -(-(i + 1) * self.local_steps // self.steps) - in_phase
