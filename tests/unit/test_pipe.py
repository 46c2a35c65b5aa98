"""swarm/pipe.py: whole messages of any size over a control pipe whose reading end is non-blocking (as uvloop makes
hivemind's), from many writers at once, and no writer that waits forever on a reader that is gone."""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import struct
import threading
import time

import pytest

from p2ptrain.swarm.pipe import LockedWriter, PipeBroken, PipeClosed, WholeMessageReader

SIZES = [0, 100, 16_000, 17_000, 70_000, 300_000, 3_000_000]


def pipe():
    reading, writing = mp.Pipe(duplex=False)
    os.set_blocking(reading.fileno(), False)  # what uvloop's add_reader does to hivemind's reading end
    return reading, writing


def message(writer: int, size: int) -> tuple:
    body = os.urandom(size)
    return writer, size, body, hashlib.sha256(body).hexdigest()


def test_messages_of_every_size_from_four_threads_arrive_whole_on_a_non_blocking_reader():
    reading, writing = pipe()
    reader, sender = WholeMessageReader(reading), LockedWriter(writing)
    sent = {w: [message(w, size) for size in SIZES] for w in range(4)}

    def send_all(w):
        for m in sent[w]:
            sender.send(m)

    threads = [threading.Thread(target=send_all, args=(w,)) for w in sent]
    for t in threads:
        t.start()
    received = {w: [] for w in sent}
    for _ in range(sum(map(len, sent.values()))):
        while not reader.poll(0.05):
            pass
        writer, size, body, digest = reader.recv()
        assert len(body) == size and hashlib.sha256(body).hexdigest() == digest
        received[writer].append(size)
    for t in threads:
        t.join()
    assert received == {w: SIZES for w in sent}  # each writer's messages whole and in its order


def test_a_forked_writer_and_this_one_take_turns():
    """The averager process is a fork that inherits the DHT object: the lock is shared across the fork."""
    reading, writing = pipe()
    reader, sender = WholeMessageReader(reading), LockedWriter(writing)
    child = mp.get_context("fork").Process(target=lambda: [sender.send(message(1, 300_000)) for _ in range(5)])
    child.start()
    parent = threading.Thread(target=lambda: [sender.send(message(0, 300_000)) for _ in range(5)])
    parent.start()
    got = []
    for _ in range(10):
        assert reader.poll(10)
        writer, size, body, digest = reader.recv()
        assert hashlib.sha256(body).hexdigest() == digest
        got.append(writer)
    child.join(timeout=10)
    parent.join(timeout=10)
    assert sorted(got) == [0] * 5 + [1] * 5 and child.exitcode == 0


def test_a_message_cut_short_breaks_the_pipe_instead_of_desyncing_it():
    reading, writing = pipe()
    reader = WholeMessageReader(reading, timeout_s=0.3)
    os.write(writing.fileno(), struct.pack("!i", 1000) + b"x" * 10)  # a writer that died 10 bytes into a message
    started = time.monotonic()
    with pytest.raises(PipeBroken, match="10 of 1000 bytes"):
        reader.recv()
    assert time.monotonic() - started < 10  # the deadline, not a hang (pytest-timeout would be minutes)
    reading2, writing2 = pipe()  # and a writer that is gone: the reader sees the end at once
    os.write(writing2.fileno(), struct.pack("!i", 1000))
    writing2.close()
    with pytest.raises(PipeBroken, match="closed 0 bytes into a message of 1000"):
        WholeMessageReader(reading2).recv()


def test_a_writer_raises_at_once_when_the_reader_is_gone_and_never_blocks_on_one_that_stopped_reading():
    reading, writing = pipe()
    gone = LockedWriter(writing, reader_alive=lambda: False)
    with pytest.raises(PipeClosed, match="gone"):
        gone.send("hello")

    reading, writing = pipe()
    stuck = LockedWriter(writing, reader_alive=lambda: True, timeout_s=0.3)
    started = time.monotonic()
    with pytest.raises(PipeClosed, match="the pipe's reader took nothing for 0s"):
        stuck.send(b"x" * 1_000_000)  # over the pipe's 64 KiB, and nobody reads
    assert time.monotonic() - started < 10  # the deadline, not a hang (pytest-timeout would be minutes)
    assert stuck.broken
    with pytest.raises(PipeClosed):  # half a message is in the pipe: nothing after it could be read
        stuck.send("small")
