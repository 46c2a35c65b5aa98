"""Fixtures shared by every test: a reaper for the processes a test leaves behind, a check that the suite leaves no
files in the working tree, and each test file's seconds at the end of a run (where the suite's time goes)."""

from __future__ import annotations

import ctypes
import logging
import multiprocessing.process
import multiprocessing.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections import defaultdict
from contextlib import suppress
from pathlib import Path
from typing import Dict, List, Optional

import psutil
import pytest


def _tree_status(root: Path) -> Optional[List[str]]:
    """``git status --porcelain`` of the checkout holding ``root`` (untracked files one by one); None outside one."""
    try:
        out = subprocess.run(["git", "status", "--porcelain", "--untracked-files=all"], cwd=root,
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.splitlines() if out.returncode == 0 else None


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def _become_subreaper() -> None:
    """Orphans of this run (a p2pd whose peer was SIGKILLed, an averager whose host died) are re-parented to this
    process instead of to init, so that the reaper below sees them and fails the test that leaked them."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: orphans stay invisible, as before
        pass


HIVEMIND_SOCKETS = Path("/tmp")
"""where hivemind's P2P makes its unix sockets (``hivemind-p2pd-*.sock``, ``hivemind-p2pclient-*.sock``) whatever
TMPDIR says (``P2P._UNIX_SOCKET_PREFIX``)"""
LEFTOVER_PATTERNS = ("p2ptrain-identity-*", "pymp-*")
"""what a peer may leave in TMPDIR: a fresh identity key's folder, multiprocessing's folder of a process"""


SO_ACCEPTCON = 0x10000
"""the flag of a listening socket in /proc/net/unix"""


def _listening_unix_sockets() -> set:
    """The paths of the unix sockets some process of this network namespace listens on (/proc/net/unix)."""
    try:
        lines = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return set()
    fields = (line.split() for line in lines)
    return {f[7] for f in fields if len(f) >= 8 and int(f[3], 16) & SO_ACCEPTCON}


def _stale_socket(path: Path, listening: set) -> bool:
    """A unix socket file nobody listens on (a live peer's is not a leftover, whoever started it). A socket in
    ``listening`` (``_listening_unix_sockets()``) is not probed: connecting to a live peer's socket and hanging up
    made it log a traceback (asyncio's handler and multiprocessing's resource sharer), which a test that runs beside
    this check under ``pytest -n`` reads as its workers' failure."""
    if str(path) in listening:
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
        return False
    except FileNotFoundError:
        return False
    except OSError:
        return True
    finally:
        probe.close()


def _tmp_entries() -> set:
    """The entries of LEFTOVER_PATTERNS in this run's TMPDIR (not this process's own multiprocessing folder, which
    lives as long as it does) and hivemind's socket files."""
    own = multiprocessing.process.current_process()._config.get("tempdir")
    tmp = Path(tempfile.gettempdir())
    folders = [tmp, *tmp.glob("gw*")]  # the run's, and its workers' under -n (pytest_sessionstart)
    found = {p for folder in folders for pattern in LEFTOVER_PATTERNS for p in folder.glob(pattern) if str(p) != own}
    return found | set(HIVEMIND_SOCKETS.glob("hivemind-*.sock"))


def _in_use(path: Path, command_lines: str, listening: set, final: bool) -> bool:
    """Whether a live process may still use ``path`` (a module fixture's daemons live across tests: removing the
    multiprocessing folder of one broke its DHT). ``final``: at the end of the run, when no daemon is left."""
    if path.suffix == ".sock":
        return not _stale_socket(path, listening)
    if path.name.startswith("p2ptrain-identity-"):  # the key a live p2pd was started with (-id=...)
        return str(path) in command_lines
    listeners = list(path.glob("listener-*"))  # pymp-*: the socket a live process passes file descriptors through
    return any(not _stale_socket(listener, listening) for listener in listeners) or not listeners and not final


def _leftovers(before: set, final: bool = False) -> List[Path]:
    """New entries since ``before`` that no live process uses: folders in TMPDIR, hivemind sockets in /tmp."""
    new = _tmp_entries() - before
    if not new:
        return []
    command_lines = " ".join(" ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))
    listening = _listening_unix_sockets()  # once per look, not once per socket
    return sorted(p for p in new if p.exists() and not _in_use(p, command_lines, listening, final))


def _leftover_check_on() -> bool:
    return os.environ.get("P2PTRAIN_LEFTOVER_CHECK", "1") != "0"


def pytest_sessionstart(session: pytest.Session) -> None:
    _become_subreaper()
    if _leftover_check_on() and not hasattr(session.config, "workerinput"):
        # a TMPDIR of this run's own, for this process and every one it starts: what they leave there is theirs
        # (another suite or daemon on the host writes to /tmp); hivemind's sockets go to /tmp regardless
        # pytest's own tmp_path folders stay where they were (/tmp/pytest-of-USER): under a longer TMPDIR, a test's
        # TMPDIR=tmp_path made torch_shm_manager's socket path too long for a unix socket (EINVAL)
        factory = getattr(session.config, "_tmp_path_factory", None)
        if factory is not None:
            factory.getbasetemp()
        session.config._p2ptrain_tmpdir = tempfile.mkdtemp(prefix="p2pt-")
        os.environ["TMPDIR"] = session.config._p2ptrain_tmpdir
        tempfile.tempdir = None  # gettempdir() reads TMPDIR again
        session.config._p2ptrain_tmp_before = _tmp_entries()
    if _leftover_check_on() and hasattr(session.config, "workerinput"):
        # under -n each worker has a TMPDIR of its own inside the run's, so that what its tests leave is blamed on
        # them, not on a test another worker runs at the same time
        worker_tmp = Path(os.environ["TMPDIR"]) / session.config.workerinput["workerid"]
        worker_tmp.mkdir(exist_ok=True)
        os.environ["TMPDIR"] = str(worker_tmp)
        tempfile.tempdir = None
    # once per run, not in each xdist worker; P2PTRAIN_TREE_CHECK=0 turns it off where people edit the same
    # checkout while the tests run (their new files would count)
    if not hasattr(session.config, "workerinput") and os.environ.get("P2PTRAIN_TREE_CHECK", "1") != "0":
        session.config._p2ptrain_tree_before = _tree_status(session.config.rootpath)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fail the run if a test wrote into the working tree (logs, reports, benchmark output): 30 such files were once
    committed by accident. Files that .gitignore names do not count. And if a module's fixtures left files in TMPDIR
    or hivemind sockets in /tmp (a test's own are the test's failure: ``no_leftovers``)."""
    _check_session_leftovers(session)
    before = getattr(session.config, "_p2ptrain_tree_before", None)
    if before is None:
        return
    after = _tree_status(session.config.rootpath) or []
    new = [entry for entry in after if entry not in set(before)]
    if not new:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"the tests left {len(new)} new entr{'y' if len(new) == 1 else 'ies'} in the working tree (write to "
             "tmp_path, or add the path to .gitignore if it is meant to be there):", *(f"  {e}" for e in new)]
    for line in lines:
        if reporter is not None:
            reporter.write_line(line, red=True)
        else:
            print(line)
    if session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _check_session_leftovers(session: pytest.Session) -> None:
    before = getattr(session.config, "_p2ptrain_tmp_before", None)
    if before is None:
        return
    left = _wait_for_leftovers(before, final=True)
    folder = Path(session.config._p2ptrain_tmpdir)
    remove_leftovers(left)
    # the run's own TMPDIR: what is left in it (chromium's, torchelastic's, torchinductor's files) goes with the run,
    # after multiprocessing has removed this process's own folder in it (its finalizer runs at exit, priority -100)
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(folder,), kwargs={"ignore_errors": True},
                                  exitpriority=-200)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if _SLOW_LEFTOVERS and reporter is not None:
        reporter.section("files left by slow tests (reported, not failed: see no_leftovers)")
        for nodeid, paths in _SLOW_LEFTOVERS:
            reporter.write_line(f"{nodeid}: {', '.join(paths)}", yellow=True)
    if not left:
        return
    lines = [f"the tests left {len(left)} file(s) behind in TMPDIR or /tmp (removed now):", *(f"  {p}" for p in left)]
    for line in lines:
        if reporter is not None:
            reporter.write_line(line, red=not _SLOW_LEFTOVERS_RAN, yellow=_SLOW_LEFTOVERS_RAN)
    if session.exitstatus == pytest.ExitCode.OK and not _SLOW_LEFTOVERS_RAN:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def _wait_for_leftovers(before: set, grace_s: float = 10.0, final: bool = False) -> List[Path]:
    """``_leftovers(before)``, giving processes that are still exiting (or starting) ``grace_s`` to settle."""
    deadline = time.monotonic() + grace_s
    left = _leftovers(before, final)
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _leftovers(before, final)
    return left


def remove_leftovers(paths: List[Path]) -> None:
    for path in paths:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            with suppress(OSError):
                path.unlink()


_SLOW_LEFTOVERS: List[tuple] = []
"""(test id, paths) of the slow tests that left files: reported at the end of the run"""
_SLOW_LEFTOVERS_RAN = False
"""a slow test ran in this session (module fixtures' leftovers are then reported, not failed)"""


@pytest.fixture(autouse=True)
def no_leftovers(request):
    """Fail a test whose processes left an identity key's folder or a multiprocessing folder in TMPDIR, or a
    hivemind socket nobody listens on in /tmp (hundreds a day of work piled up in /tmp). Only what no live process
    uses counts, and only that is removed. The default suite (``make test``) fails on it; a slow test's leftovers
    are reported at the end of the run, unless it is marked ``leaves_nothing``: the SIGKILLed peers of the chaos
    and CLI tests leave files that a killed process cannot remove, which is their own issue."""
    if not _leftover_check_on():
        yield
        return
    slow = (request.node.get_closest_marker("slow") is not None
            and request.node.get_closest_marker("leaves_nothing") is None)
    before = _tmp_entries()
    yield
    left = _wait_for_leftovers(before)
    if left:
        remove_leftovers(left)
        if slow:  # reported by the process that reports the run (pytest_runtest_logreport): under -n, not this one
            request.node.user_properties.append(("slow_leftovers", [str(p) for p in left]))
        else:
            pytest.fail(f"the test left {len(left)} file(s) behind: {', '.join(str(p) for p in left)}")


_seconds_per_file: Dict[str, float] = defaultdict(float)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    global _SLOW_LEFTOVERS_RAN
    _seconds_per_file[report.nodeid.split("::", 1)[0]] += report.duration  # setup, call and teardown
    _SLOW_LEFTOVERS_RAN |= "slow" in report.keywords
    if report.when == "teardown":
        _SLOW_LEFTOVERS.extend((report.nodeid, paths) for name, paths in report.user_properties
                               if name == "slow_leftovers")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """Each test file's seconds, slowest first: the default suite must stay under 10 minutes on 2 cores."""
    if not _seconds_per_file:
        return
    terminalreporter.section("seconds per test file")
    for path, seconds in sorted(_seconds_per_file.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
    terminalreporter.write_line(f"{sum(_seconds_per_file.values()):8.1f}  in all")


def _is_torch_helper(proc: psutil.Process) -> bool:
    """torch's shared-memory manager serves this test process for its whole life and exits with it. A zombie is no
    helper, but it is dead: it holds no port (an orphan that exited on its own, re-parented here)."""
    try:
        return proc.name() == "torch_shm_manager" or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _started_by(proc: psutil.Process, pids: set) -> bool:
    try:
        return any(parent.pid in pids for parent in proc.parents())
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
    # a process started by one that was there before the test (a module fixture's daemon starting its DHT and
    # averager while the first test runs) is that daemon's to stop, not the test's: reaping it killed a module
    # swarm's live workers' averagers. An orphan is re-parented to this process (a subreaper), so it counts
    leftover = [p for p in me.children(recursive=True)
                if p.pid not in before and not _is_torch_helper(p) and not _started_by(p, before)]
    if not leftover:
        return
    # give processes that are already shutting down a moment before calling them leaks
    _, alive = psutil.wait_procs(leftover, timeout=float(os.environ.get("P2PTRAIN_REAP_GRACE_S", "10")))
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


@pytest.fixture(autouse=True)
def restore_logging():
    """Undo what a test's in-process CLI run did to the loggers (``cli.logs.setup_logging`` stops ``p2ptrain``,
    ``hivemind`` and ``asyncio`` from propagating and gives them handlers): later tests' ``caplog`` would see
    nothing (a test that passed alone failed after tests/unit/test_settings.py)."""
    names = ("", "p2ptrain", "hivemind", "asyncio")
    saved = {name: (lg.propagate, lg.level, list(lg.handlers)) for name in names
             for lg in [logging.getLogger(name)]}
    yield
    for name, (propagate, level, handlers) in saved.items():
        lg = logging.getLogger(name)
        lg.propagate, lg.handlers = propagate, handlers
        lg.setLevel(level)
