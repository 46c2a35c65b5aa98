"""``FrameReader`` (frame_reader.py) over real socket pairs, on asyncio's loop and on uvloop (hivemind's averager runs
uvloop): every byte of every frame arrives, whatever pieces the socket cuts them into; bytes the StreamReader read
ahead are kept; the reading pauses while frames wait; the writing end still works; a stream that ends mid-frame or
breaks is an error, not a hang."""

from __future__ import annotations

import asyncio
import os
import random
import socket
import threading
import time

import pytest
import uvloop

from p2ptrain.averaging.frame_reader import FRAME, SCRATCH_BYTES, FrameReader


def accept_all(kind: int, meta_length: int, payload_length: int) -> None:
    if kind == 99:
        raise ValueError("kind 99 is refused")


def framed(kind: int, meta: bytes, payload: bytes) -> bytes:
    return FRAME.pack(kind, len(meta), len(payload)) + meta + payload


def run(loop_kind: str, main):
    if loop_kind == "uvloop":
        return uvloop.run(main())
    return asyncio.run(main())


async def connected(max_queued: int = 4):
    """(our FrameReader, our StreamWriter, their socket), the StreamReader's bytes taken over by the FrameReader."""
    ours, theirs = socket.socketpair()
    reader, writer = await asyncio.open_unix_connection(sock=ours)
    return FrameReader.install(reader, writer, accept_all, max_queued), writer, theirs


def send_in_pieces(sock: socket.socket, data: bytes, seed: int, end: bool = True) -> threading.Thread:
    """Send ``data`` from a thread in pieces of random sizes (1 byte to 300 KB), then end the stream."""

    def sending():
        rng, offset = random.Random(seed), 0
        while offset < len(data):
            size = rng.choice([1, 7, 100, 4096, SCRATCH_BYTES - 1, SCRATCH_BYTES + 1, 300_000])
            sock.sendall(data[offset:offset + size])
            offset += size
        if end:
            sock.shutdown(socket.SHUT_WR)

    thread = threading.Thread(target=sending, daemon=True)
    thread.start()
    return thread


LOOPS = ["asyncio", "uvloop"]


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_every_frame_arrives_whole_whatever_pieces_the_socket_cuts(loop_kind):
    rng = random.Random(0)
    frames = [(1, b"", b""), (2, b"m" * 300, b""), (1, b"", b"x"), (3, os.urandom(10), os.urandom(2 << 20))]
    frames += [(1, os.urandom(rng.randrange(1000)), os.urandom(rng.choice([1, 100, SCRATCH_BYTES, 1 << 20])))
               for _ in range(20)]
    data = b"".join(framed(*f) for f in frames)

    async def main():
        reader, writer, theirs = await connected(max_queued=2)
        sending = send_in_pieces(theirs, data, seed=1)
        got = [await asyncio.wait_for(reader.read_frame(), 10) for _ in frames]
        with pytest.raises(asyncio.IncompleteReadError):
            await asyncio.wait_for(reader.read_frame(), 10)  # the end of the stream, between two frames
        sending.join()
        writer.close()
        theirs.close()
        return got

    got = run(loop_kind, main)
    assert [(kind, meta, bytes(payload)) for kind, meta, payload in got] == frames
    assert all(isinstance(payload, bytearray) for _, _, payload in got)  # writable: torch reads it without a copy


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_the_bytes_a_stream_reader_read_ahead_are_the_first_ones_read(loop_kind):
    """hivemind's handler reads the stream's info, and p2ptrain the hello, through a StreamReader, which reads ahead:
    what it holds of the frames after them must not be lost when the FrameReader takes over."""
    first, second = framed(1, b"meta", os.urandom(5000)), framed(2, b"", os.urandom(3 << 20))

    async def main():
        ours, theirs = socket.socketpair()
        reader, writer = await asyncio.open_unix_connection(sock=ours)
        theirs.sendall(b"HELLO" + first + second[:1000])
        assert await reader.readexactly(5) == b"HELLO"
        await asyncio.sleep(0.1)  # the StreamReader holds the first frame and a piece of the second now
        frames = FrameReader.install(reader, writer, accept_all)
        sending = send_in_pieces(theirs, second[1000:], seed=2)
        got = [await asyncio.wait_for(frames.read_frame(), 10) for _ in range(2)]
        sending.join()
        writer.close()
        theirs.close()
        return got

    got = run(loop_kind, main)
    assert [framed(kind, meta, bytes(payload)) for kind, meta, payload in got] == [first, second]


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_reading_pauses_while_frames_wait_and_resumes_as_they_are_taken(loop_kind):
    """At most ``max_queued`` whole frames are held for a reader that does not take them: the sender's bytes wait in
    the socket (its send blocks), not in this process's memory."""
    payload = os.urandom(1 << 20)
    data = b"".join(framed(1, b"", payload) for _ in range(12))

    async def main():
        reader, writer, theirs = await connected(max_queued=2)
        sending = send_in_pieces(theirs, data, seed=3)
        await asyncio.sleep(0.5)
        held = len(reader._frames)  # noqa: SLF001
        paused_with_sender_blocked = sending.is_alive()
        got = [await asyncio.wait_for(reader.read_frame(), 10) for _ in range(12)]
        sending.join(5)
        writer.close()
        theirs.close()
        return held, paused_with_sender_blocked, got

    held, blocked, got = run(loop_kind, main)
    assert held == 2 and blocked
    assert all(bytes(p) == payload for _, _, p in got)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_the_writer_still_waits_for_the_socket_after_the_reader_took_over(loop_kind):
    """The transport's pause and resume of writing reach the StreamWriter's protocol: 16 MiB written to an end that
    reads nothing for a while are held back by ``drain`` (at most the high-water mark and one write queued), and
    the other end gets every byte once it reads."""
    data = os.urandom(16 << 20)

    async def main():
        reader, writer, theirs = await connected()
        received = bytearray()

        def receiving():
            time.sleep(1.0)  # a slow reader: the writer's buffer fills up meanwhile
            while chunk := theirs.recv(1 << 16):
                received.extend(chunk)

        thread = threading.Thread(target=receiving, daemon=True)
        thread.start()
        writer.transport.set_write_buffer_limits(high=1 << 20)
        queued = []
        for offset in range(0, len(data), 1 << 20):
            writer.write(data[offset:offset + (1 << 20)])
            await asyncio.wait_for(writer.drain(), 10)
            queued.append(writer.transport.get_write_buffer_size())
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), 10)
        thread.join(10)
        theirs.close()
        return bytes(received), max(queued)

    received, most_queued = run(loop_kind, main)
    assert received == data
    assert most_queued <= 2 << 20


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_a_stream_that_ends_mid_frame_or_is_refused_is_an_error_not_a_hang(loop_kind):
    async def main():
        reader, writer, theirs = await connected()
        theirs.sendall(framed(1, b"meta", b"payload")[:-3])
        theirs.shutdown(socket.SHUT_WR)
        with pytest.raises(asyncio.IncompleteReadError):
            await asyncio.wait_for(reader.read_frame(), 5)
        writer.close()
        theirs.close()

        reader, writer, theirs = await connected()
        theirs.sendall(framed(1, b"", b"ok") + FRAME.pack(99, 0, 1 << 30))  # refused: its gigabyte is never read
        assert (await asyncio.wait_for(reader.read_frame(), 5))[2] == b"ok"  # the frame before it still comes
        with pytest.raises(ValueError, match="kind 99 is refused"):
            await asyncio.wait_for(reader.read_frame(), 5)
        writer.close()
        theirs.close()

    run(loop_kind, main)


@pytest.mark.parametrize("loop_kind", LOOPS)
def test_the_end_of_the_other_side_s_writing_leaves_ours_open(loop_kind):
    """As with asyncio's StreamReaderProtocol: once the other end is through writing, the reader sees the end of the
    stream, and this end can still write (the closing is the writer's)."""
    async def main():
        reader, writer, theirs = await connected()
        theirs.sendall(framed(1, b"", b"last"))
        theirs.shutdown(socket.SHUT_WR)
        assert (await asyncio.wait_for(reader.read_frame(), 5))[2] == b"last"
        with pytest.raises(asyncio.IncompleteReadError):
            await asyncio.wait_for(reader.read_frame(), 5)
        writer.write(b"answer")
        await asyncio.wait_for(writer.drain(), 5)
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), 5)
        received = b""
        while chunk := theirs.recv(1 << 16):
            received += chunk
        theirs.close()
        return received

    assert run(loop_kind, main) == b"answer"
