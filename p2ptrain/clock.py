"""Seconds per named phase of a piece of work (a sync, an all-reduce), from any thread."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Dict


class PhaseClock:
    """``with clock("digest"): ...`` adds the body's seconds to ``clock.seconds["digest"]``. Safe to use from
    several threads at once (the all-reduce's codec threads): their seconds add up, so phases may overlap."""

    def __init__(self):
        self.seconds: Dict[str, float] = {}
        self._lock = threading.Lock()

    @contextmanager
    def __call__(self, phase: str):
        started = time.perf_counter()
        try:
            yield
        finally:
            with self._lock:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - started
