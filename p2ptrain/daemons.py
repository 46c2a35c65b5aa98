"""Starting and stopping `p2ptrain` daemons from another command (`demo`, `bench`), as a user would in shells.

Each daemon runs in a session of its own, so a Ctrl-C typed at the driving command reaches the driver alone; the
driver then stops each daemon exactly once (a second signal would force the daemon out without its clean leave),
and signals its whole process group, so nothing the daemon started outlives it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Sequence


class DaemonError(Exception):
    """A daemon did not come up; the message says which and where its log is."""


def spawn(args: Sequence[str], log_path: Path, prefix: Sequence[str] = ()) -> subprocess.Popen:
    """``p2ptrain ARGS`` in the background (after ``prefix``, e.g. ``ip netns exec NS``), output to ``log_path``."""
    return subprocess.Popen([*prefix, sys.executable, "-m", "p2ptrain", *args], stdout=open(log_path, "wb"),
                            stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                            start_new_session=True)


def wait_for_address(path: Path, proc: subprocess.Popen, timeout_s: float = 60.0) -> str:
    """The first multiaddr a bootstrap peer wrote to its ``--maddrs-file``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().split()[0]
        if proc.poll() is not None:
            raise DaemonError(f"the bootstrap peer exited with code {proc.returncode}")
        time.sleep(0.2)
    raise DaemonError(f"the bootstrap peer printed no address within {timeout_s:.0f}s")


def stop_daemons(procs: List[subprocess.Popen], timeout_s: float = 60.0) -> None:
    """SIGINT to each daemon's process group (one clean leave), then SIGKILL of whatever is left after
    ``timeout_s``."""
    for proc in procs:
        _signal_group(proc, signal.SIGINT)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
