"""Running a swarm of local daemons for a benchmark (``bench --scale``, ``bench --crowd``): their process trees
measured, their JSON reports read while they are being rewritten, the whole swarm stopped (workers first), whatever
they left behind found, and SIGINT/SIGTERM turned into KeyboardInterrupt while a run goes on."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Sequence

import psutil

from p2ptrain.daemons import stop_daemons

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def loopback_join(initial_peer: str, run_id: str, report: Path | str, *, model: str, local_steps: int,
                  num_shards: int, extra: Sequence[str] = ()) -> List[str]:
    """A benchmark worker's ``p2ptrain join`` arguments: loopback, one torch thread, no bars, a report; ``extra``
    after them."""
    return ["join", "--initial-peers", initial_peer, "--host-maddrs", LOOPBACK, "--run-id", run_id,
            "--model", model, "--threads", "1", "--no-progress", "--report", str(report),
            "--local-steps", str(local_steps), "--num-shards", str(num_shards), *extra]


@contextlib.contextmanager
def interrupts_raised() -> Iterator[None]:
    """SIGTERM stops a run as a Ctrl-C does, and SIGINT does so even where it was inherited ignored (a job started in
    the background by a non-interactive shell, as CI starts it: Python then installs no KeyboardInterrupt handler of
    its own). The previous handlers come back after."""

    def terminate(signum, frame):
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, terminate) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class ProcessTree:
    """One daemon's process tree: peak RSS and PSS (sums over the tree), CPU seconds (every process ever seen in it,
    at its last sample; exact from the kernel when the harness reaps the daemon itself)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.cpu_by_pid: Dict[int, float] = {}
        self.peak_rss = 0
        self.peak_pss = 0
        self.cpu_s: Optional[float] = None  # from wait4, once reaped

    def sample(self) -> None:
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        rss = pss = 0
        for p in procs:
            try:
                with p.oneshot():
                    times = p.cpu_times()
                    self.cpu_by_pid[p.pid] = times.user + times.system
                    info = p.memory_full_info()
                rss += info.rss
                pss += getattr(info, "pss", info.rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        self.peak_rss = max(self.peak_rss, rss)
        self.peak_pss = max(self.peak_pss, pss)

    def poll(self) -> Optional[int]:
        """The exit code once the daemon exited; reaps it with wait4, whose CPU times include every descendant it
        waited for (its p2pd and averager), so nothing of its last seconds is missed."""
        if self.proc.returncode is not None:
            return self.proc.returncode
        try:
            pid, status, usage = os.wait4(self.proc.pid, os.WNOHANG)
        except ChildProcessError:
            return self.proc.poll()
        if pid == 0:
            return None
        self.cpu_s = usage.ru_utime + usage.ru_stime
        self.proc.returncode = os.waitstatus_to_exitcode(status)  # Popen.wait() now returns it without waiting
        return self.proc.returncode

    def figures(self) -> Dict[str, Any]:
        cpu = self.cpu_s if self.cpu_s is not None else sum(self.cpu_by_pid.values()) or None
        return {"cpu_s": cpu, "peak_rss": self.peak_rss or None, "peak_pss": self.peak_pss or None}


def read_json(path: Path) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def stop_swarm(procs: List[subprocess.Popen]) -> None:
    """The workers leave first, the bootstrap peer after them; a Ctrl-C while they leave kills what is left, so the
    harness never exits with a daemon behind it."""
    try:
        stop_daemons(procs[1:], timeout_s=60)
        stop_daemons(procs[:1], timeout_s=30)
    except KeyboardInterrupt:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for proc in procs:
            proc.wait()
        raise


def leftover_processes(procs: List[subprocess.Popen]) -> List[str]:
    """Processes of a stopped daemon's process group that outlived it by 10 s (a p2pd its worker did not take down):
    killed, and named as a problem. The kernel does not hand a group's id to a new process while the group has
    members, so these are the daemon's own."""
    groups = {proc.pid for proc in procs}
    left = []
    for p in psutil.process_iter(["pid", "name"]):
        try:
            if p.pid not in groups and os.getpgid(p.pid) in groups:
                left.append(p)
        except (ProcessLookupError, psutil.NoSuchProcess):
            continue
    _, left = psutil.wait_procs(left, timeout=10)  # a p2pd may still be on its way out
    for p in left:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=5)
    if not left:
        return []
    names = ", ".join(sorted({p.info["name"] or "?" for p in left}))
    return [f"killed {len(left)} process(es) the daemons left behind: {names}"]
