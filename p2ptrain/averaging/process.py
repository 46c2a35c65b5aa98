"""The averager's own process: what it sets up when it starts (it is forked from the host) and cleans at its end."""

from __future__ import annotations

import signal
import time
from functools import partial
from multiprocessing import resource_sharer

from p2ptrain.hivemind_compat import p2p_socket_paths
from p2ptrain.lifeline import exit_on_sigterm, follow_parent, leave_process_group, on_forced_exit, remove_files
from p2ptrain.swarm.pipe import WholeMessageReader


def enter_averager_process(averager) -> None:
    """In the averager process, before hivemind's ``run``. The parent owns SIGINT (first = graceful, second = force)
    and shuts us down; ignoring it here is what hivemind's run_in_background does too, but without touching the
    parent's handler."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    leave_process_group()  # signals meant for the host's group are not ours: the host shuts us down
    follow_parent()  # a SIGKILLed host must not leave this process behind
    # its control pipe is read as the DHT's is (swarm/pipe.py: hivemind's reading breaks on a large message)
    averager._inner_pipe = WholeMessageReader(averager._inner_pipe)
    # the replica of the DHT's P2P made in this process leaves its client socket in /tmp (hivemind removes it in
    # P2P.shutdown only, which a child process never reaches); p2ptrain's DHT removes it, a plain one does not
    on_forced_exit(partial(remove_replica_socket, averager))
    exit_on_sigterm()


def leave_averager_process(averager) -> None:
    """In the averager process, once hivemind's ``run`` has ended however it did."""
    wait_for_shared_fds()  # the DHT may still have to fetch the answer pipe of our last command
    remove_replica_socket(averager)


SHARED_FD_WAIT_S = 2.0
"""how long an ending averager process waits for other processes to fetch the file descriptors it shared"""


def wait_for_shared_fds(timeout_s: float = SHARED_FD_WAIT_S) -> bool:
    """Before this process exits: let other processes fetch the file descriptors it shared (True once none is left).
    A DHT command sent from here carries the pipe its answer comes back on (hivemind's ``MPFuture``), and the DHT
    process fetches that pipe from this process's ``multiprocessing`` resource sharer only when it reads the
    command. An averager that exited right after sending one (an optimizer closed just after it started) made that
    fetch fail in the DHT process (EOFError in ``rebuild_connection``), which killed a plain hivemind DHT and left its
    p2pd socket behind (seen once in CI, test_drop_in_optimizer). The sharer forgets a descriptor once it is fetched
    (stdlib ``multiprocessing.resource_sharer``: ``_cache``)."""
    deadline = time.monotonic() + timeout_s
    while resource_sharer._resource_sharer._cache:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def remove_replica_socket(averager) -> None:
    p2p = getattr(averager, "_p2p", None)
    if p2p is not None:
        remove_files(p2p_socket_paths(p2p))
