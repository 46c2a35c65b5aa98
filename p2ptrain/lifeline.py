"""Child processes that follow their parent out.

A peer's main process owns hivemind's DHT and averager processes, and the DHT process owns p2pd. A clean exit shuts
them down in order; a SIGKILLed or crashed main process cannot, and they would live on as orphans (holding ports,
shared memory and a DHT identity). Each of those child processes therefore runs :func:`follow_parent`: a thread that
notices when its parent is gone and takes the child, and everything the child started, down with it.

Polling ``getppid`` is used rather than ``PR_SET_PDEATHSIG``: that signal fires when the *thread* that forked the
child exits, and hivemind's processes are started from worker threads as well as the main one.
"""

from __future__ import annotations

import multiprocessing.process
import multiprocessing.util
import os
import shutil
import signal
import sys
import threading
import time
from contextlib import suppress
from typing import Callable, Iterable, List, NoReturn, Tuple

import psutil

POLL_S = 0.5
TERM_GRACE_S = 2.0
FORCE_GRACE_S = 1.0
"""a forced exit's wait for its children's clean-up: they remove a few files, in well under a second"""


def leave_process_group() -> None:
    """Move this (child) process, and whatever it starts later (p2pd), out of its parent's process group. A Ctrl-C
    in a terminal signals the whole foreground group, and torchrun stops a rank with ``killpg``: either would hit
    p2pd and the hivemind processes at the same moment as the peer's main process, and take the swarm away from
    it while it is still leaving (finishing a round, withdrawing its records). The main process stops them itself,
    in order; :func:`follow_parent` covers a main process that cannot."""
    try:
        os.setpgid(0, 0)
    except OSError:  # a session leader cannot, and needs not
        pass


_forced_exit_callbacks: List[Tuple[int, Callable[[], None]]] = []


def on_forced_exit(callback: Callable[[], None]) -> None:
    """Call ``callback`` if :func:`follow_parent` ends this process: its os._exit skips atexit and multiprocessing's
    finalizers, so clean-up that must happen anyway (files in /tmp) registers here too."""
    _forced_exit_callbacks.append((os.getpid(), callback))


def run_forced_exit_callbacks() -> None:
    """Before an ``os._exit``: this process's :func:`on_forced_exit` callbacks, then multiprocessing's removal of
    its temporary folder (``pymp-*``, which holds the listener socket it passes file descriptors through), a
    finalizer that only a normal exit runs: every worker left one in TMPDIR (issue 35)."""
    for pid, callback in list(_forced_exit_callbacks):
        if pid == os.getpid():  # a forked child inherits the list, not the parent's files
            try:
                callback()
            except Exception:  # leaving matters more than tidying up
                pass
    remove_temp_dir = getattr(multiprocessing.util, "_remove_temp_dir", None)
    for finalizer in list(getattr(multiprocessing.util, "_finalizer_registry", {}).values()):
        if remove_temp_dir is not None and getattr(finalizer, "_callback", None) is remove_temp_dir:
            try:
                finalizer()  # a no-op in any process but the one that made the folder
            except Exception:
                pass


def remove_files(paths: Iterable[str]) -> None:
    """Remove what exists of ``paths`` (clean-up: a file already gone is fine)."""
    for path in paths:
        with suppress(OSError):
            os.remove(path)


def exit_now(code: int) -> NoReturn:
    """Flush stdio and end the process with ``code``, skipping the interpreter's finalization: for the ways out
    that ran their own clean-up first (``hsdp.exit_rank``, the CLI's ``leave``)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def exit_on_sigterm() -> None:
    """In a child process (the DHT's, the averager's): on SIGTERM (``stop_descendants`` of a rank or a peer that is
    being forced out), stop its own children and clean up as :func:`follow_parent` does, then exit with 143. The
    default action killed it on the spot, leaving its sockets in /tmp."""
    signal.signal(signal.SIGTERM, lambda signum, frame: _leave_now(128 + signum))


def force_exit(code: int) -> None:
    """A peer forced out (a second SIGINT/SIGTERM): its children get ``FORCE_GRACE_S`` to remove their sockets and
    key files (:func:`exit_on_sigterm`) before SIGKILL, then its own clean-up runs, and it exits with ``code``. Killed
    at once, they left their p2pd sockets in /tmp and the DHT's identity key in TMPDIR."""
    _leave_now(code, grace_s=FORCE_GRACE_S)


def _leave_now(code: int, shared_folder: bool = False, grace_s: float = TERM_GRACE_S) -> None:
    """The forced way out: stop this process's children, clean up (and with ``shared_folder``, once the parent is
    gone, the multiprocessing folder this process shared with it), exit with ``code``."""
    stop_descendants(grace_s)
    run_forced_exit_callbacks()
    if shared_folder:
        remove_inherited_temp_dir()
    os._exit(code)


def parent_gone(parent: int, wait_s: float = 0.0) -> bool:
    """Whether the process ``parent`` (this one's parent at start) is gone, waiting up to ``wait_s`` for it: a pipe
    from a dying parent reads as closed a moment before this process is given a new parent."""
    deadline = time.monotonic() + wait_s
    while os.getppid() == parent:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def remove_inherited_temp_dir() -> None:
    """The parent is gone (a SIGKILLed worker): remove the multiprocessing folder this forked child shares with it,
    which only the parent's normal exit would have removed (its siblings are leaving too)."""
    folder = multiprocessing.process.current_process()._config.get("tempdir")
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


def follow_parent(poll_s: float = POLL_S) -> None:
    """In a child process: exit (after stopping this process's own children and calling its
    :func:`on_forced_exit` callbacks) as soon as the parent is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        _leave_now(1, shared_folder=True)

    threading.Thread(target=watch, name="p2ptrain-follow-parent", daemon=True).start()


SPARED = ("torch_shm_manager",)
"""torch's shared-memory manager exits by itself once its last client has; killed under a live client, torch's C++
side throws on the broken pipe and aborts the process (SIGABRT instead of the forced exit's 130, seen in CI)"""


def stop_descendants(grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM every descendant of this process (a chance to exit cleanly), SIGKILL those left after ``grace_s``
    (0: SIGKILL at once); returns once they are gone (or after 5 s more). ``SPARED`` helpers are left to exit with
    their clients."""
    children = [c for c in psutil.Process().children(recursive=True) if not _spared(c)]
    alive = children
    if grace_s > 0:
        _signal_all(children, "terminate")
        _, alive = psutil.wait_procs(children, timeout=grace_s)
    _signal_all(alive, "kill")
    psutil.wait_procs(alive, timeout=5)


def _spared(proc: psutil.Process) -> bool:
    try:
        return proc.name() in SPARED
    except psutil.NoSuchProcess:
        return True


def _signal_all(processes, how: str) -> None:
    for proc in processes:
        try:
            getattr(proc, how)()
        except psutil.NoSuchProcess:
            pass
