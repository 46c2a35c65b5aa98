"""Whole messages over hivemind's control pipes, whatever their size.

hivemind's DHT and averager each run in a process of their own and take commands (store, get, step ...) from a
``multiprocessing`` pipe. That process reads the pipe from its uvloop event loop: ``loop.add_reader`` makes libuv
set the read end non-blocking (``uv_poll_init``), and ``Connection.recv`` then reads a message with plain
``os.read`` calls. ``Connection.send`` writes a message of over 16 KiB in two writes (the 4-byte size, then the
body), and one of over the pipe's 64 KiB in many as the reader drains it; a reader that gets ahead of the writer
gets ``BlockingIOError`` (EAGAIN) mid-message. hivemind logs it and reads on from the middle of the message: the
next "size" is pickle bytes, and the process dies (``EOFError: Ran out of input``) or hangs on a size of gigabytes.
With hivemind 1.1.12 alone (``benchmarks/bench_dht_pipe.py``, docs/bench/2026-11-27-dht-pipe): a value of 15,000
bytes always lands, one of 16,000-70,000 bytes 3-9 times in 10, one of 300 KB or 1 MB 0-9 times in 10. Two writers
(the host's threads, the averager process: a fork that inherits the DHT object) can also interleave the halves of
their messages.

So both ends are replaced (``FollowingDHT``, ``PseudoGradientAverager``):

- ``WholeMessageReader``: reads the size and then the body, waiting with ``select`` whenever the pipe is empty
  mid-message. A message that does not complete within ``MESSAGE_TIMEOUT_S`` (its writer died mid-write) leaves
  the stream unreadable: the process says so and exits, rather than reading garbage.
- ``LockedWriter``: one message at a time across every process that writes to the pipe (a ``multiprocessing``
  lock inherited by fork), written whole before the lock is released; with ``reader_alive``, a writer never waits
  more than ``MESSAGE_TIMEOUT_S`` on a reader that is gone or stuck and raises ``PipeClosed`` instead, so no
  caller blocks forever on a dead DHT process.

The framing is ``multiprocessing.connection``'s (a signed 4-byte big-endian size, -1 then an 8-byte size for
messages over 2 GiB), so either end still works with the other's stock ``Connection``.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import select
import struct
import sys
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Optional

import psutil

logger = logging.getLogger(__name__)

RECORD_MAX_BYTES = 8 * 1024
"""the most any record p2ptrain stores in the DHT takes (tests/unit/test_record_bounds.py: every kind at its
largest). Half of the largest message the stock reader always takes whole (16 KiB, one write: a store's value plus
its key, subkey and future pickled), so a record is safe even where this module's reader is not in place; and a
DHT answer carries one record per peer of the run, so 32 peers' records of a key come to 256 KiB at most"""

MESSAGE_TIMEOUT_S = 30.0
"""the longest a reader waits for the rest of a message it began, and a writer for the reader to take one"""
_LOCK_POLL_S = 0.5


class PipeClosed(RuntimeError):
    """The process at the other end of a control pipe is gone or has stopped reading it."""


class PipeBroken(Exception):
    """A message began on the pipe and did not complete: the stream cannot be read any further.

    Not an OSError or RuntimeError on purpose: hivemind's command loops log those and read on."""


def _frame(obj: Any) -> bytes:
    body = bytes(ForkingPickler.dumps(obj))
    if len(body) > 0x7FFFFFFF:
        return struct.pack("!i", -1) + struct.pack("!Q", len(body)) + body
    return struct.pack("!i", len(body)) + body


def _wait(fd: int, for_write: bool, deadline: float) -> bool:
    """Wait until ``fd`` is ready (True) or ``deadline`` (monotonic) passes (False)."""
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        return False
    if for_write:
        return bool(select.select([], [fd], [], remaining)[1])
    return bool(select.select([fd], [], [], remaining)[0])


def read_exactly(fd: int, size: int, deadline: float) -> bytes:
    """``size`` bytes from ``fd`` (blocking or not); PipeBroken at ``deadline`` or at end of file."""
    chunks, remaining = [], size
    while remaining:
        try:
            chunk = os.read(fd, min(remaining, 1 << 20))
        except (BlockingIOError, InterruptedError):
            if not _wait(fd, False, deadline):
                raise PipeBroken(f"the pipe's writer sent {size - remaining} of {size} bytes of a message and "
                                 f"then nothing for {MESSAGE_TIMEOUT_S:.0f}s") from None
            continue
        if not chunk:
            raise PipeBroken(f"the pipe closed {size - remaining} bytes into a message of {size}")
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def write_all(fd: int, data: bytes, deadline: Optional[float]) -> None:
    """All of ``data`` to ``fd``; with a ``deadline``, the fd is non-blocking and PipeClosed is raised there."""
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except (BlockingIOError, InterruptedError):
            if deadline is None or not _wait(fd, True, deadline):
                raise PipeClosed("the reader took nothing") from None
            continue
        view = view[written:]


def process_alive(pid: Optional[int]) -> bool:
    """Whether process ``pid`` runs (not yet started, None: yes), from any process, the parent or a sibling."""
    if pid is None:
        return True
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


class WholeMessageReader:
    """The reading end of a control pipe (a ``multiprocessing`` Connection) whose ``recv`` returns whole messages
    even when the fd is non-blocking; ``poll``, ``send``, ``fileno`` and ``close`` are the Connection's."""

    def __init__(self, conn: Any, timeout_s: float = MESSAGE_TIMEOUT_S):
        self.conn, self.timeout_s = conn, timeout_s

    def recv(self) -> Any:
        fd = self.conn.fileno()
        deadline = time.monotonic() + self.timeout_s
        size, = struct.unpack("!i", read_exactly(fd, 4, deadline))
        if size == -1:
            size, = struct.unpack("!Q", read_exactly(fd, 8, deadline))
        return ForkingPickler.loads(read_exactly(fd, size, deadline))

    def __getattr__(self, name: str) -> Any:
        if name == "conn":  # not set yet (an object being built or copied)
            raise AttributeError(name)
        return getattr(self.conn, name)


class LockedWriter:
    """The writing end of a control pipe: ``send`` writes each message whole, one writer at a time across the
    processes forked after it was made. With ``reader_alive`` (a check that works in any of those processes), the
    fd is made non-blocking and a send raises PipeClosed, instead of blocking, once the reader is gone or has taken
    nothing for ``timeout_s``; a send after that raises at once."""

    def __init__(self, conn: Any, reader_alive: Optional[Callable[[], bool]] = None,
                 timeout_s: float = MESSAGE_TIMEOUT_S, reader: str = "the pipe's reader",
                 on_closed: Optional[Callable[[Any, PipeClosed], bool]] = None):
        self.conn, self.reader_alive, self.timeout_s, self.reader = conn, reader_alive, timeout_s, reader
        self.on_closed = on_closed
        """called with a message that could not be sent and the error; True: it was dealt with, send returns"""
        self._lock = mp.Lock()
        self._broken = mp.Value("b", 0, lock=False)  # set under the lock, in whichever process saw it
        if reader_alive is not None:
            os.set_blocking(conn.fileno(), False)

    def send(self, obj: Any) -> None:
        try:
            self._send(obj)
        except PipeClosed as e:
            if self.on_closed is None or not self.on_closed(obj, e):
                raise

    def _send(self, obj: Any) -> None:
        data = _frame(obj)  # pickled before the lock: a slow pickle holds up no other writer
        if self.reader_alive is None:
            with self._lock:
                write_all(self.conn.fileno(), data, None)
            return
        gone = f"{self.reader} is gone"
        deadline = time.monotonic() + self.timeout_s
        while not self._lock.acquire(timeout=_LOCK_POLL_S):
            # another writer holds the pipe; it gives up by its own deadline, or died holding the lock
            if not self.reader_alive() or time.monotonic() > deadline:
                raise PipeClosed(gone if not self.reader_alive() else
                                 f"another writer held the pipe to {self.reader} for {self.timeout_s:.0f}s")
        try:
            if self._broken.value or not self.reader_alive():
                self._broken.value = 1
                raise PipeClosed(gone)
            try:
                write_all(self.conn.fileno(), data, deadline)
            except (PipeClosed, BrokenPipeError) as e:
                self._broken.value = 1  # a message may be half-written: nothing after it could be read
                raise PipeClosed(gone if isinstance(e, BrokenPipeError) else f"{self.reader} took nothing for "
                                 f"{self.timeout_s:.0f}s") from None
        finally:
            self._lock.release()

    @property
    def broken(self) -> bool:
        return bool(self._broken.value)

    def __getattr__(self, name: str) -> Any:
        if name == "conn":  # not set yet (an object being built or copied)
            raise AttributeError(name)
        return getattr(self.conn, name)


def quiet_shared_fd_resets() -> None:
    """Log, instead of printing a traceback for, a peer process that dies while it fetches a file descriptor from this
    one. A DHT command carries the pipe its answer comes back on, which the DHT process fetches from this process's
    ``multiprocessing`` resource sharer; a DHT process killed mid-fetch (SIGKILL, the OOM killer) resets the
    connection, and the sharer's thread hands that to ``sys.excepthook``, which printed a traceback on the daemon's
    output (CI, test_a_worker_whose_dht_process_dies_says_so_and_leaves_nothing_behind, once). The sharer serves on,
    and the peer's DHT watch says in one line that the DHT process is gone."""
    previous = sys.excepthook
    if getattr(previous, "_p2ptrain_quiet_resets", False):
        return

    def hook(kind, value, tb):
        if issubclass(kind, (ConnectionError, EOFError)) and _in_resource_sharer(tb):
            logger.debug(f"a process died while fetching a shared descriptor from this one: {value!r}")
            return
        previous(kind, value, tb)

    hook._p2ptrain_quiet_resets = True
    sys.excepthook = hook


def _in_resource_sharer(tb) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.endswith("multiprocessing/resource_sharer.py"):
            return True
        tb = tb.tb_next
    return False
