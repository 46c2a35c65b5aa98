"""When a benchmark configuration's rounds have stopped coming: it ends with one line instead of running until killed.

A swarm benchmark waits for its workers to reach their last outer step. Some configurations never get there: workers
that can all only dial out (every one behind NAT, so nobody can lead a group or reduce), or a round that no longer
forms for another reason. ``Stall`` watches the rounds the workers report and says why the configuration is given
up: the workers' own explanation when every one of them has logged it twice (``explain_no_group`` logs it once a
minute, only while no live peer can lead), otherwise after a stretch without a round that is long against the
rounds seen so far.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import List, Optional

NO_GROUP = "no group can form"
"""the start of the workers' explanation (diloco/rounds.py, ``explain_no_group``)"""
FIRST_ROUND_S = 900.0
"""how long the first round may take, start-up included (the 124m model's workers take minutes on 2 cores)"""
STALL_S = 300.0
STALL_ROUNDS = 5.0
"""later, no round for this many times the longest gap between rounds so far (at least ``STALL_S``) gives up"""
LOG_TAIL_BYTES = 1 << 20
"""how much of the end of each worker's log is read for the explanation"""
LOOK_EVERY_S = 10.0
"""how often the logs are read"""


class Stall:
    """One configuration's watch: ``check`` after each look at the rounds done."""

    def __init__(self, logs: List[Path], clock=time.monotonic) -> None:
        self._logs, self._clock = logs, clock
        self._rounds, self._since, self._longest_gap = 0, clock(), 0.0
        self._looked_at = -LOOK_EVERY_S

    def check(self, rounds: int) -> Optional[str]:
        """Why the configuration should be given up now (one line), or None while it goes on. ``rounds``: the fewest
        rounds any worker has done."""
        now = self._clock()
        if rounds != self._rounds:
            if self._rounds > 0:  # the first round's wait includes start-up: not a gap between rounds
                self._longest_gap = max(self._longest_gap, now - self._since)
            self._rounds, self._since = rounds, now
            return None
        explanation = ""
        if now - self._looked_at >= LOOK_EVERY_S:
            self._looked_at = now
            explanation = self.workers_explanation()
        if explanation:
            return f"no round can form; every worker says ({self._logs[0].name}): {explanation}"
        limit = FIRST_ROUND_S if rounds == 0 else max(STALL_S, STALL_ROUNDS * self._longest_gap)
        if now - self._since > limit:
            return (f"no round in {now - self._since:.0f}s after round {rounds} (the limit: "
                    f"{'the first round' if rounds == 0 else 'rounds so far'} took at most {limit:.0f}s); see "
                    f"{self._logs[0]}")
        return None

    def workers_explanation(self) -> str:
        """The workers' explanation why no group can form, if every worker has logged it at least twice; else ''."""
        said = []
        for log in self._logs:
            lines = [line for line in _tail(log).splitlines() if NO_GROUP in line]
            if len(lines) < 2:
                return ""
            said.append(lines[-1])
        return said[0][said[0].index(NO_GROUP) + len(NO_GROUP):].lstrip(": ").strip()


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(f.tell() - LOG_TAIL_BYTES, 0))
            return f.read().decode(errors="replace")
    except OSError:
        return ""
