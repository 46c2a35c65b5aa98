"""A health file for supervisors (Docker's HEALTHCHECK, systemd, a cron job): the daemon rewrites it every few
seconds from a thread of its own, and ``p2ptrain health`` reads it, so a check costs no DHT start and no network.

The file says what the daemon is doing (``phase``), how far it got, and whether its DHT process is alive; its
``updated_at`` says whether the daemon itself is: a daemon that died or hung stops rewriting it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional

logger = logging.getLogger(__name__)

# a daemon that is up but not fit to serve: failed start-up, or leaving
UNHEALTHY_PHASES = {"failed", "leaving", "left"}


def write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so a reader sees the old file or the new one, never half of one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


class Heartbeat:
    """Rewrite ``path`` every ``interval_s`` with ``state()`` plus the time and the pid, until ``stop()``."""

    def __init__(self, path: str, state: Callable[[], Dict[str, Any]], interval_s: float = 5.0):
        self.path, self.state, self.interval_s = Path(path), state, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="p2ptrain-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self.beat()
        self._thread.start()
        return self

    def beat(self, **extra: Any) -> None:
        try:
            record = {**self.state(), **extra, "pid": os.getpid(), "updated_at": time.time()}
            write_atomically(self.path, json.dumps(record))
        except Exception as e:  # a health file is never worth stopping the daemon for
            logger.warning(f"could not write the health file {self.path}: {e}")

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.beat()

    def stop(self, phase: str = "left") -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=self.interval_s + 5)
        self.beat(phase=phase)


def check_health(path: str, max_age_s: float, now: Optional[float] = None) -> Optional[str]:
    """None when the daemon behind ``path`` is healthy, else one line saying what is wrong."""
    try:
        record = json.loads(Path(path).read_text())
        updated_at = float(record["updated_at"])
    except FileNotFoundError:
        return f"no health file at {path} yet: the daemon has not started (or runs without --health-file {path})"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"the health file {path} is unreadable ({e}); is another program writing it?"
    age = (time.time() if now is None else now) - updated_at
    phase = record.get("phase", "?")
    if age > max_age_s:
        return f"the health file was last written {age:.0f}s ago (limit {max_age_s:.0f}s): the daemon is gone or hung"
    if phase in UNHEALTHY_PHASES:
        return f"the daemon is {phase}" + (f": {record['error']}" if record.get("error") else "")
    if record.get("dht_alive") is False:
        return "the daemon's DHT process is not running: it cannot reach the swarm"
    return None
