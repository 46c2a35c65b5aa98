"""An ending averager process waits until the file descriptors it shared are fetched (averaging/process.py): a DHT
command's answer pipe is fetched from the sender's resource sharer only when the DHT process reads the command."""

from __future__ import annotations

import multiprocessing as mp
import time
from multiprocessing.reduction import ForkingPickler

from p2ptrain.averaging.process import wait_for_shared_fds


def _send_a_pipe_and_exit(queue_writer, wait: bool) -> None:
    _, answer_pipe = mp.Pipe(duplex=False)
    queue_writer.send_bytes(bytes(ForkingPickler.dumps(answer_pipe)))  # as an MPFuture's pipe travels in a command
    if wait:
        assert wait_for_shared_fds(timeout_s=20)


def _fetched_after_the_sender_ended(wait: bool) -> bool:
    ctx = mp.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    sender = ctx.Process(target=_send_a_pipe_and_exit, args=(writer, wait))
    sender.start()
    message = reader.recv_bytes()
    time.sleep(0.5)  # the reader (the DHT process) gets to the command late
    try:
        ForkingPickler.loads(message).close()
        return True
    except (EOFError, OSError):
        return False
    finally:
        sender.join(30)


def test_a_pipe_sent_by_a_process_that_ended_at_once_cannot_be_fetched():
    assert not _fetched_after_the_sender_ended(wait=False)


def test_a_process_that_waits_for_its_shared_fds_lets_the_reader_fetch_them():
    assert _fetched_after_the_sender_ended(wait=True)
