"""Fixtures shared by every test: a reaper for the processes a test leaves behind."""

from __future__ import annotations

import logging

import psutil
import pytest


def _is_torch_helper(proc: psutil.Process) -> bool:
    """torch's shared-memory manager serves this test process for its whole life and exits with it."""
    try:
        return proc.name() == "torch_shm_manager"
    except psutil.NoSuchProcess:
        return True


@pytest.fixture(autouse=True)
def reap_children():
    """Fail a test that leaves child processes (hivemind DHTs, averagers, p2pd) running, after killing them.

    An orphaned p2pd outlives the test run and holds ports, so leaking one is a bug in the code under test.
    """
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    leftover = [p for p in me.children(recursive=True) if p.pid not in before and not _is_torch_helper(p)]
    if not leftover:
        return
    # give processes that are already shutting down a moment before calling them leaks
    _, alive = psutil.wait_procs(leftover, timeout=10)
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    if alive:
        names = ", ".join(f"{p.pid}" for p in alive)
        logging.getLogger(__name__).error(f"killed leftover child processes: {names}")
        pytest.fail(f"the test left {len(alive)} child process(es) running: {names}")
