"""What a peer leaves on the host after it is gone: no processes (torch_shm_manager included), no sockets in /tmp.

hivemind names its unix sockets /tmp/hivemind-p2pd-*.sock (p2pd's control socket) and /tmp/hivemind-p2pclient-*.sock
(the listen socket of each process that serves handlers: the DHT process, the averager's). Other test runs on the
host make and remove such files at the same time, so these tests follow the sockets and processes of their own
peer (found through its process tree while it runs) rather than counting files in /tmp.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Dict, Set

import psutil
import pytest

from p2ptrain.config import SwarmConfig
from p2ptrain.swarm.dht import start_dht, stop_dht
from tests.helpers import exit_code, p2ptrain, spawn, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(180)]

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
SOCKET_PREFIX = "/tmp/hivemind-"


def _sockets_of(proc: psutil.Process) -> Set[str]:
    """hivemind's unix socket files that ``proc`` listens on or (p2pd) was told to make."""
    try:
        connections = getattr(proc, "net_connections", proc.connections)(kind="unix")
        paths = {c.laddr for c in connections if isinstance(c.laddr, str) and c.laddr.startswith(SOCKET_PREFIX)}
        for arg in proc.cmdline():
            if arg.startswith("-listen=/unix" + SOCKET_PREFIX):
                paths.add(arg.split("=", 1)[1][len("/unix"):])
        return paths
    except psutil.Error:
        return set()


def _tree(root: psutil.Process) -> list:
    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def test_a_dht_leaves_no_socket_files():
    dht = start_dht(SwarmConfig(host_maddrs=[LOOPBACK]))
    try:
        me = psutil.Process()
        paths = set().union(*(_sockets_of(p) for p in me.children(recursive=True)))
    finally:
        stop_dht(dht)
    # the DHT process's client socket and p2pd's control socket
    assert any("p2pclient" in p for p in paths) and any("p2pd" in p for p in paths), paths
    left = sorted(p for p in paths if os.path.exists(p))
    assert not left, f"stop_dht left hivemind sockets behind: {left}"


LIBRARY_SCRIPT = textwrap.dedent("""
    import os, sys
    from functools import partial

    import torch

    from p2ptrain import DiLoCoOptimizer
    from p2ptrain.config import SwarmConfig
    from p2ptrain.swarm.dht import start_dht, stop_dht

    dht = start_dht(SwarmConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 2)
    opt = DiLoCoOptimizer(model.parameters(), dht=dht, run_id="library", local_steps=2,
                          inner_optimizer=partial(torch.optim.AdamW, lr=1e-2),
                          outer_optimizer=partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
                          matchmaking_time_s=1.0).start()
    for _ in range(4):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    print("outer steps", opt.outer_step, flush=True)
    if sys.argv[1] == "close":
        opt.close()
        stop_dht(dht)
    else:  # the script dies without any clean-up of its own (as under SIGKILL, or os._exit)
        os._exit(0)
""")


@pytest.mark.parametrize("ending", ["close", "abrupt"])
def test_a_library_script_leaves_no_process_or_socket(tmp_path: Path, ending: str):
    """A script that trains with DiLoCoOptimizer and exits leaves nothing running: not its DHT, averager or p2pd,
    nor the torch_shm_manager that torch starts for the first tensor shared through the file system (hivemind sets
    that strategy), which lives while any process of the script still holds its connection."""
    script = tmp_path / "train.py"
    script.write_text(LIBRARY_SCRIPT)
    proc = subprocess.Popen([sys.executable, str(script), ending], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path)
    root = psutil.Process(proc.pid)
    seen: Dict[int, psutil.Process] = {}
    names: Dict[int, str] = {}
    sockets: Set[str] = set()
    while proc.poll() is None:  # follow its processes and sockets while it runs (they are orphans after it exits)
        for p in _tree(root)[1:]:
            try:  # read again at every poll: a child caught between fork and exec still bears its parent's name
                names[p.pid] = p.name()  # (seen once: p2pd read as 'python3', and never read again)
            except psutil.Error:
                continue
            seen.setdefault(p.pid, p)
            sockets |= _sockets_of(p)
        time.sleep(0.2)
    output = proc.stdout.read()
    assert proc.returncode == 0 and "outer steps 2" in output, output
    # what this test is about did run. Names compared as the kernel keeps them (15 characters): psutil widens a cut
    # name from the command line, but not when that is unreadable, as for a process just exiting (seen once:
    # 'torch_shm_manag')
    assert {"torch_shm_manager"[:15], "p2pd"} <= {name[:15] for name in names.values()}, names

    # the shared-memory manager leaves 2 s after its last client; the rest follow their parent within a second
    _, alive = psutil.wait_procs(list(seen.values()), timeout=20)
    leftover = []
    for p in alive:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                leftover.append(f"{p.pid} {names[p.pid]} (parent {p.ppid()})")
                p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not leftover, f"the script left processes behind: {leftover}"
    assert any("p2pclient" in s for s in sockets), sockets  # the averager's and the DHT's, at least
    left = sorted(s for s in sockets if os.path.exists(s))
    assert not left, f"the script left hivemind sockets behind: {left}"


@pytest.mark.slow  # 12 s on 2 cores, a whole worker: `make test-slow` (CI runs it)
def test_a_worker_whose_dht_process_dies_says_so_and_leaves_nothing_behind(tmp_path: Path):
    """A peer's DHT process can die under it (issue 40: hivemind's pipe killed it on a 300 KB record; a kill, the
    OOM killer). Without it the peer sees no other peer and would wait for ever in matchmaking, as this lone worker
    under no_group_policy=wait does: it must notice within a round, say so in one line, and leave (exit 1, for a
    supervisor to restart it) with its checkpoint written, its other processes and sockets gone."""
    log, checkpoints = tmp_path / "worker.log", tmp_path / "ckpt"
    proc = spawn("join", "--host-maddrs", LOOPBACK, "--run-id", "dht-lost", "--local-steps", "3", "--no-group-policy",
                 "wait", "--matchmaking-time", "2", "--threads", "1", "--no-progress", "--shard-index", "0",
                 "--checkpoint-dir", str(checkpoints), log=log)
    try:
        wait_until(lambda: "waiting for peers" in log.read_text(), "the worker waiting in its first sync", 90,
                   [("worker", proc)])
        tree = _tree(psutil.Process(proc.pid))
        sockets = set().union(*(_sockets_of(p) for p in tree))
        dht = [p for p in tree[1:] if any(child.name() == "p2pd" for child in p.children())]
        assert len(dht) == 1 and sockets, (tree, sockets)
        dht[0].kill()
        assert exit_code(proc, 60, log) == 1, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert f"the DHT process (pid {dht[0].pid}) exited with code -9: this peer can no longer reach the swarm" in text
    assert "left at outer step 0 after 0 sync(s) of its own (dht_lost)" in text and "Traceback" not in text, text
    assert (checkpoints / "dht-lost.pt").exists(), text
    _, alive = psutil.wait_procs(tree[1:], timeout=10)
    assert not [p for p in alive if p.is_running()], alive
    assert not [path for path in sockets if os.path.exists(path)]


@pytest.mark.slow  # a whole worker, 15 s on 2 cores: `make test-slow` (CI runs it)
def test_a_worker_that_trained_leaves_no_multiprocessing_folder_in_tmpdir():
    """A worker that trained ends with os._exit (hsdp.exit_rank), which skips multiprocessing's finalizers: each one
    left its pymp-*/listener-* socket in TMPDIR (990 of them after a day's runs, issue 35)."""
    # a short path, not tmp_path: torch_shm_manager's socket in it must fit a unix socket address (108 bytes), and
    # under pytest-xdist tmp_path (.../popen-gw1/test_a_worker_that_trained_leaves_no0/) did not (EINVAL)
    tmpdir = Path(tempfile.mkdtemp(prefix="t-"))
    try:
        done = p2ptrain("join", "--host-maddrs", LOOPBACK, "--run-id", "leftovers", "--model", "tiny", "--threads",
                        "1", "--no-progress", "--local-steps", "5", "--max-outer-steps", "1",
                        env={"TMPDIR": str(tmpdir)}, timeout=150)
        assert done.returncode == 0, done.stderr[-3000:]
        assert "left at outer step 1" in done.stderr, done.stderr[-3000:]
        assert not list(tmpdir.glob("pymp-*")) and not list(tmpdir.glob("p2ptrain-identity-*")), list(tmpdir.iterdir())
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
