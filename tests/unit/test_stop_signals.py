"""The CLI's stop signals (cli/processes.py): the first SIGINT/SIGTERM asks for a graceful stop without ever waiting
on a lock the interrupted main thread holds."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_a_stop_signal_while_the_main_thread_holds_the_stop_events_lock_stops_it():
    """A bootstrap peer signalled as it entered ``stop.wait`` never left (the default suite's
    test_bootstrap_identity_is_stable, once): the handler ran ``stop.set()`` in the main thread, which held the
    Event's plain lock, and waited on itself. Here the main thread holds that lock when the signal comes, as
    ``Event.wait`` does on its way in and out; it runs in a process of its own, so a hang is a timeout, not a hung
    suite."""
    script = textwrap.dedent("""
        import os, signal, threading, time
        from p2ptrain.cli.processes import install_stop_handlers
        stop = threading.Event()
        install_stop_handlers(stop.set)
        with stop._cond:  # the lock Event.set takes; the handler runs in this thread, inside this block
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)
            assert not stop.is_set()  # the stop waits for the lock, not the other way round
        print("stopped" if stop.wait(10) else "not stopped", flush=True)
    """)
    try:
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:  # run() killed it
        raise AssertionError("the process hung: the stop handler waited on a lock its own thread held") from None
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "stopped"
    assert "SIGINT: finishing the current step and leaving cleanly" in result.stderr


def test_a_second_signal_forces_the_exit():
    script = textwrap.dedent("""
        import os, signal, time
        from p2ptrain.cli.processes import install_stop_handlers
        install_stop_handlers(lambda: None)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=30)
    assert result.returncode == 130, result.stderr
    assert "SIGINT again: forcing exit" in result.stderr
