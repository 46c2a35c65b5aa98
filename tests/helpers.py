"""Running the real ``p2ptrain`` command in subprocesses, as a user would."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import psutil

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def p2ptrain(*args: str, env: Optional[Dict[str, str]] = None, **kwargs) -> subprocess.CompletedProcess:
    """Run ``p2ptrain ARGS`` to completion and capture its output; ``env`` adds variables."""
    kwargs.setdefault("timeout", 120)
    return subprocess.run([sys.executable, "-m", "p2ptrain", *args], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})), **kwargs)


def spawn(*args: str, log: Path, env: Optional[Dict[str, str]] = None, new_session: bool = False) -> subprocess.Popen:
    """Start ``p2ptrain ARGS`` in the background with stdout and stderr going to ``log``; ``env`` adds variables;
    ``new_session`` makes it the leader of a process group of its own, as a command typed in a terminal is."""
    return subprocess.Popen([sys.executable, "-m", "p2ptrain", *args], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})),
                            start_new_session=new_session)


def wait_for_file(path: Path, proc: subprocess.Popen, timeout_s: float = 60) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().split()[0]
        assert proc.poll() is None, f"process exited with {proc.returncode} before writing {path}"
        time.sleep(0.2)
    raise AssertionError(f"{path} was not written within {timeout_s}s")


def exit_code(proc: subprocess.Popen, timeout_s: float, log=None) -> int:
    """``proc.wait(timeout_s)``, but a process still running then fails the test with the end of ``log`` (a path,
    or a function that returns the text), so a run that hangs in CI says where it hung."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        tail = "" if log is None else log() if callable(log) else Path(log).read_text()
        raise AssertionError(f"{' '.join(map(str, proc.args[2:4]))} still running after {timeout_s}s; its log ends:\n"
                             f"{tail[-4000:]}") from None


def descendants(proc: subprocess.Popen) -> List[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def assert_all_gone(processes: List[psutil.Process], timeout_s: float = 10) -> None:
    """The given processes (a daemon's children, recorded while it ran) must all have exited."""
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    names = [f"{p.pid}:{p.name()}" for p in alive if p.is_running()]
    assert not names, f"orphaned processes after exit: {names}"


def sigkill_leaves_no_orphans(proc: subprocess.Popen, timeout_s: float = 10) -> None:
    """kill -9 a daemon that runs p2pd: every process it had started must exit on its own within ``timeout_s``."""
    children = descendants(proc)
    assert any(c.name() == "p2pd" for c in children), children
    proc.kill()
    proc.wait(timeout=10)
    assert_all_gone(children, timeout_s=timeout_s)


def start_bootstrap(tmp_path: Path, **kwargs) -> tuple:
    """A `p2ptrain bootstrap` on loopback; returns (process, its first multiaddr). No NAT on loopback, so no relay
    daemons (--relays 0: 1.6 s less per start on 2 cores); the relays' tests are test_reachability's and tests/netns."""
    proc = spawn("bootstrap", "--host-maddrs", LOOPBACK, "--maddrs-file", str(tmp_path / "maddrs"), "--relays", "0",
                 log=tmp_path / "boot.log")
    return proc, wait_for_file(tmp_path / "maddrs", proc, **kwargs)


def start_worker(tmp_path: Path, i: int, maddr: str, run_id: str, *extra: str,
                 env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
    """`p2ptrain join` number ``i`` on loopback: one torch thread, no progress bar, report w{i}.json, log w{i}.log."""
    return spawn("join", "--initial-peers", maddr, "--host-maddrs", LOOPBACK, "--run-id", run_id, "--threads", "1",
                 "--no-progress", "--report", str(tmp_path / f"w{i}.json"), *extra, log=tmp_path / f"w{i}.log",
                 env=env)


def stop_all(procs: List[subprocess.Popen]) -> None:
    """SIGINT whatever still runs (a graceful stop), SIGKILL what does not leave within 30 s."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
    for proc in procs:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def report(tmp_path: Path, i: int) -> dict:
    """Worker ``i``'s `--report` (rewritten after every sync), or {} before it first wrote one."""
    path = tmp_path / f"w{i}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def wait_until(condition, what: str, timeout_s: float, procs=()) -> float:
    """Poll ``condition`` until it holds and return when it did (time.time()); fail if it does not within
    ``timeout_s`` or if one of the (name, process) pairs in ``procs`` exits meanwhile."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return time.time()
        for name, proc in procs:
            assert proc.poll() is None, f"{name} exited with {proc.returncode} while waiting for: {what}"
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for: {what}")


def own_round(record: dict, min_group_size: int = 2) -> bool:
    """A report round in which the peer averaged its own pseudo-gradient with at least ``min_group_size`` peers
    (not a round it joined with weight 0 while taking the swarm's state)."""
    return record["averaged"] and not record["caught_up"] and record["group_size"] >= min_group_size
