"""The processes of a command: stopping on SIGINT/SIGTERM (graceful first, forced second), and a peer's local ranks
started through torchrun."""

from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
from typing import Callable

logger = logging.getLogger("p2ptrain.cli")  # the commands' log lines keep one name

EXIT_FORCED = 130


def install_stop_handlers(on_first: Callable[[], None]) -> None:
    """First SIGINT/SIGTERM: ``on_first`` (graceful stop). Second: stop our process tree, leaving no file behind, and
    exit 130 (``lifeline.force_exit``)."""
    main_pid = os.getpid()
    received = []
    # on_first runs in a thread of its own, never in the handler: a handler runs in the main thread between two of
    # its bytecodes, maybe while it holds the lock on_first takes (Event.set takes its Condition's plain Lock, which
    # Event.wait holds on its way in and out), and the main thread then waited on itself forever: a bootstrap peer
    # signalled as it entered its wait hung (tests/unit/test_stop_signals.py). Starting a thread in the handler would
    # take threading's own plain lock, which the main thread may hold too.
    stops: "queue.SimpleQueue[int]" = queue.SimpleQueue()

    def stop_when_asked() -> None:
        stops.get()
        on_first()

    threading.Thread(target=stop_when_asked, name="p2ptrain-stop", daemon=True).start()

    def handler(signum, _frame):
        if os.getpid() != main_pid:
            # a forked hivemind child inherited this handler: behave as the default would (terminate)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        received.append(signum)
        name = signal.Signals(signum).name
        if len(received) == 1:
            logger.warning(f"{name}: finishing the current step and leaving cleanly (send it again to force)")
            stops.put(signum)  # SimpleQueue.put is reentrant: the one handoff the docs allow in a signal handler
        else:
            logger.warning(f"{name} again: forcing exit")
            from p2ptrain.lifeline import force_exit

            force_exit(EXIT_FORCED)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def run_ranks(nproc: int) -> None:
    """Run ``torchrun --standalone --nproc-per-node N -m p2ptrain join ...`` with this command's other arguments,
    in this process, and exit with its outcome. torchrun's agent starts the ranks in sessions of their own (so a
    Ctrl-C reaches them once, through it), forwards SIGINT/SIGTERM, and stops them all when one fails."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            args.append(arg)
    logger.info(f"starting {nproc} local ranks with torchrun")
    try:
        torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "p2ptrain", *args])
    except SignalException as e:
        # the agent passed the signal on and waited for the ranks, which leave as a 1-rank peer does
        logger.info(f"the ranks were stopped by {signal.Signals(e.sigval).name}")
        sys.exit(0)
    except ChildFailedError as e:
        # torchrun already logged each failed rank; one line more, and no traceback of the agent's own
        logger.error(f"a rank of this peer failed: {e.get_first_failure()[1].message or 'see the log above'}")
        sys.exit(1)
    sys.exit(0)


