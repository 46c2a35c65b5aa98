"""The averager's own process: what it sets up when it starts (it is forked from the host) and cleans at its end."""

from __future__ import annotations

import signal
from functools import partial

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


def remove_replica_socket(averager) -> None:
    p2p = getattr(averager, "_p2p", None)
    if p2p is not None:
        remove_files(p2p_socket_paths(p2p))
