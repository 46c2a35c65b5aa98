"""The all-reduce's own stream (protocol 10): a sender's parts to a reducer and the averages back, on one libp2p stream
that hivemind's p2pd opens, without hivemind's protobuf stream handler.

What goes over it, in order (all integers little-endian):

1. the sender's hello: ``HELLO`` (the magic ``b"p2ptpart"``, the stream's version, the group id's length), then the
   group id. A reducer that speaks another version answers one ``ERROR`` frame saying so, and hangs up;
2. frames both ways: ``FRAME`` (kind, meta length, payload length), then the meta, then the payload. A ``MESSAGE``
   frame is a hivemind ``AveragingData`` cut in two: the meta is the message serialized without its tensor's bytes
   (code, group id, signature, weight, shape, dtype, codec), the payload is the tensor's bytes (``buffer``), written
   straight from the encoded tensor's memory and received straight into a bytearray of its own (``frame_reader.py``),
   never copied into or out of a protobuf message (``wire_part.py``: the runner handles ``WireMessage``s), no 64 KiB
   chunks, no task and queue per message on the sender's side. ``END`` (sender only) says no more parts follow.
   ``ERROR`` (reducer only) carries a one-line reason in the meta;
3. the hang-up: the sender closes the stream once it holds every average of the reducer's range (protocol 6's order,
   ``ExactAllReduceRunner.rpc_aggregate_part``); a reducer that sees the stream end stops answering.

A frame that announces more than ``MAX_META_BYTES`` of meta or ``MAX_STREAM_MESSAGE_BYTES`` of payload, or a kind
it does not know, ends the stream at once: nothing that large is read into memory. The runner checks each part as
before (shape, weight, finiteness, norm, receipts): this module only moves the messages.
"""

from __future__ import annotations

import asyncio
import struct
from contextlib import closing
from typing import AsyncIterator, Protocol, Tuple, Union

from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger

from p2ptrain.averaging.frame_reader import FRAME, FrameReader
from p2ptrain.averaging.round import PROTOCOL_VERSION
from p2ptrain.averaging.wire_part import WireMessage
from p2ptrain.hivemind_compat import runner_for
from p2ptrain.security import MAX_STREAM_MESSAGE_BYTES

logger = get_logger(__name__)

STREAM_VERSION = PROTOCOL_VERSION
"""the version a sender's hello names: the protocol that brought this stream in (10)"""
MAGIC = b"p2ptpart"
HELLO = struct.Struct("<8sHH")
"""magic, version, length of the group id that follows"""
MESSAGE, END, ERROR = 1, 2, 3
MAX_META_BYTES = 1 << 20
"""an answer's meta carries the reducer's signature and receipt: about 600 bytes plus 49 per sender"""
MAX_GROUP_ID_BYTES = 1024
LINGER_S = 5.0
"""how long a reducer that refused a stream (BAD_GROUP_ID) waits for its sender to hang up"""
WRITE_BUFFER_BYTES = 4 << 20
"""how many bytes of frames a writer queues before it waits for the socket: several parts in flight per stream"""


async def linger_after_refusal() -> None:
    """Keep a refused stream open until its sender hangs up, as it does on reading the refusal (hivemind then cancels
    this wait), at most ``LINGER_S``: a handler that ended at once closed its socket, p2pd reset the stream, and the
    answer was lost (the rogue test's protocol-9 part got no code: once in each of the last two sessions' runs).
    The part stream's refusals linger the same way (``_answer_and_linger``)."""
    await asyncio.sleep(LINGER_S)


class PartStreamError(ConnectionError):
    """The other end broke this stream's format, refused it, or announced a frame too large to read."""


def handler_name(prefix: str) -> str:
    """The stream protocol an averager with this prefix serves its all-reduce on (one per run and version)."""
    return f"{prefix}::p2ptrain.parts.v{STREAM_VERSION}"


def hello(group_id: bytes, version: int = STREAM_VERSION) -> bytes:
    return HELLO.pack(MAGIC, version, len(group_id)) + group_id


async def read_hello(reader: asyncio.StreamReader) -> bytes:
    """The group id of a sender's hello; PartStreamError if it is not a hello of this version."""
    magic, version, group_id_length = HELLO.unpack(await reader.readexactly(HELLO.size))
    if magic != MAGIC:
        raise PartStreamError("its stream does not start with p2ptrain's all-reduce hello")
    if version != STREAM_VERSION:
        raise PartStreamError(f"it speaks p2ptrain's all-reduce stream version {version}, this peer "
                              f"{STREAM_VERSION}: run the same p2ptrain version on every peer")
    if group_id_length > MAX_GROUP_ID_BYTES:
        raise PartStreamError(f"its hello announces a {group_id_length}-byte group id")
    return await reader.readexactly(group_id_length)


def frame(kind: int, meta: bytes = b"", payload: bytes = b"") -> Tuple[bytes, bytes]:
    """A frame's header and meta in one piece, and its payload."""
    return FRAME.pack(kind, len(meta), len(payload)) + meta, payload


def message_frame(message: Union[WireMessage, averaging_pb2.AveragingData]) -> Tuple[bytes, bytes]:
    """``message`` as a MESSAGE frame: its fields but the tensor's bytes, then those bytes (a ``WireMessage``'s
    as they are: no copy; a protobuf message's, such as hivemind's refusals, read out of it)."""
    if not isinstance(message, WireMessage):
        message = WireMessage.of(message, message.tensor_part.buffer)
    return frame(MESSAGE, message.meta().SerializeToString(), message.tensor_part.buffer)


def write_frame(writer: asyncio.StreamWriter, head: bytes, payload) -> int:
    """Queue one frame on ``writer``; the bytes it takes on the stream."""
    writer.write(head)
    if payload:
        writer.write(payload)
    return len(head) + len(payload)


def check_head(kind: int, meta_length: int, payload_length: int) -> None:
    """PartStreamError for a frame this end will not read: of a kind it does not know, or larger than the limits."""
    if kind not in (MESSAGE, END, ERROR):
        raise PartStreamError(f"a frame of unknown kind {kind}")
    if meta_length > MAX_META_BYTES or payload_length > MAX_STREAM_MESSAGE_BYTES:
        raise PartStreamError(f"a frame of {meta_length} + {payload_length} bytes; the limits are {MAX_META_BYTES} "
                              f"+ {MAX_STREAM_MESSAGE_BYTES}")


def frame_reader(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> FrameReader:
    """The rest of the stream read as frames (``frame_reader.py``), each checked by ``check_head`` before its bytes
    are read: ``read_frame`` raises IncompleteReadError where the stream ends, PartStreamError for a refused frame."""
    return FrameReader.install(reader, writer, check_head)


def message_of(meta: bytes, payload: bytes) -> WireMessage:
    """The message a MESSAGE frame carries, its payload held as read (PartStreamError if its meta does not parse)."""
    try:
        fields = averaging_pb2.AveragingData.FromString(meta)
    except Exception as e:  # protobuf's DecodeError, whatever its module
        raise PartStreamError(f"a message whose fields do not parse: {e!r}") from e
    return WireMessage.of(fields, payload)


class ByteCounter(Protocol):
    """Where a stream adds the bytes it moves, both ways (a runner: its ``bytes_sent`` and ``bytes_received``)."""

    bytes_sent: int
    bytes_received: int


async def open_part_stream(p2p, peer_id: PeerID, prefix: str, group_id: bytes,
                           messages: AsyncIterator[WireMessage],
                           counter: ByteCounter) -> AsyncIterator[WireMessage]:
    """Sender side: send ``messages`` to reducer ``peer_id`` (a task writes them as they come) and iterate its
    answers. Closing the iterator hangs up. An ERROR frame raises PartStreamError with the reducer's reason."""
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, handler_name(prefix))
    writer.transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
    frames = frame_reader(reader, writer)
    writer.write(hello(group_id))
    counter.bytes_sent += HELLO.size + len(group_id)

    async def write_messages() -> None:
        async for message in messages:
            counter.bytes_sent += write_frame(writer, *message_frame(message))
            await writer.drain()
        counter.bytes_sent += write_frame(writer, *frame(END))
        await writer.drain()

    async def answers() -> AsyncIterator[WireMessage]:
        with closing(writer):
            try:
                while True:
                    try:
                        kind, meta, payload = await frames.read_frame()
                    except (asyncio.IncompleteReadError, ConnectionResetError):  # the reducer hung up
                        break
                    counter.bytes_received += FRAME.size + len(meta) + len(payload)
                    if kind == ERROR:
                        raise PartStreamError(f"reducer {peer_id} refused the stream: "
                                              f"{meta.decode(errors='replace')[:300]}")
                    if kind != MESSAGE:
                        raise PartStreamError(f"reducer {peer_id} sent a frame of kind {kind}")
                    message = message_of(meta, payload)
                    yield message
                    if message.code != averaging_pb2.AVERAGED_PART:
                        break  # a refusal (BAD_GROUP_ID, ...) is a reducer's last word: hang up
                await writing  # its error, if writing failed before the reducer hung up
            finally:
                writing.cancel()

    writing = asyncio.create_task(write_messages())
    return answers()


async def serve_part_stream(averager, stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                            max_prefetch: int = 5) -> None:
    """Reducer side of one sender's stream (``averager``'s handler): read its hello, find the round's runner (none
    if this peer runs no such round: the sender gets one BAD_GROUP_ID answer), then feed its messages to
    ``runner.rpc_aggregate_part`` and write the answers. A stream refused or broken is logged and ends; the runner
    leaves out a sender whose parts stop short, as before.

    The reading and the answering run side by side, as in hivemind's stream handler: the sender's hang-up (the end
    of the stream after its END frame) cancels the answering, which is how a reducer's held stream ends."""
    remote_id = stream_info.peer_id

    def refused(reason: str) -> None:
        logger.warning(f"refused peer {remote_id}'s all-reduce stream: {reason}")

    with closing(writer):
        writer.transport.set_write_buffer_limits(high=WRITE_BUFFER_BYTES)
        try:
            group_id = await read_hello(reader)
        except PartStreamError as e:
            refused(str(e))
            write_frame(writer, *frame(ERROR, str(e).encode()))
            await _answer_and_linger(reader, writer, linger_s=1.0)  # not a sender of this version: one second
            return
        except asyncio.IncompleteReadError:
            return
        steered = averager.steered  # a peer whose matchmaking left the group as it formed answers at once
        runner = await runner_for(averager, group_id, steered.in_no_formed_group if steered else lambda: False)
        if runner is None:
            write_frame(writer, *message_frame(averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)))
            await _answer_and_linger(reader, writer)
            return
        runner.bytes_received += HELLO.size + len(group_id)
        context = P2PContext(handle_name=handler_name(averager.prefix), local_id=averager.peer_id, remote_id=remote_id)
        frames = frame_reader(reader, writer)
        requests: asyncio.Queue = asyncio.Queue(max_prefetch)

        async def read_requests() -> AsyncIterator[WireMessage]:
            while True:
                request = await requests.get()
                if request is None:
                    break
                yield request

        async def answer() -> None:
            try:
                async for response in runner.rpc_aggregate_part(read_requests(), context):
                    runner.bytes_sent += write_frame(writer, *message_frame(response))
                    await writer.drain()
            except (ConnectionError, OSError):
                logger.debug("the sender's stream broke while this reducer answered it", exc_info=True)
            except Exception as e:
                logger.warning(f"answering sender {remote_id} failed: {e!r}", exc_info=True)
                write_frame(writer, *frame(ERROR, str(e)[:300].encode()))
                await _drain_quietly(writer)

        answering = asyncio.create_task(answer())
        try:
            while True:
                receiving = asyncio.create_task(frames.read_frame())
                await asyncio.wait({answering, receiving}, return_when=asyncio.FIRST_COMPLETED)
                if answering.done():  # the runner is through with this sender (refused, or left it out): hang up,
                    receiving.cancel()  # so that a sender waiting for averages fails this reducer at once
                    return
                try:
                    kind, meta, payload = await receiving
                except PartStreamError as e:  # before ConnectionError, which it is
                    refused(str(e))
                    return
                except (asyncio.IncompleteReadError, ConnectionError, OSError):  # hung up, or gone
                    return
                runner.bytes_received += FRAME.size + len(meta) + len(payload)
                if kind == END:
                    await requests.put(None)
                    continue
                if kind != MESSAGE:
                    refused(f"a frame of kind {kind} from a sender")
                    return
                try:
                    message = message_of(meta, payload)
                except PartStreamError as e:
                    refused(str(e))
                    return
                await requests.put(message)  # the first carries the group id too: hivemind's checks read it there
        finally:
            answering.cancel()


async def _drain_quietly(writer: asyncio.StreamWriter) -> None:
    try:
        await writer.drain()
    except (ConnectionError, OSError):
        pass


async def _answer_and_linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             linger_s: float = LINGER_S) -> None:
    """Send what is queued, then let the sender hang up first (at most ``linger_s``, reading and dropping what it
    still sends): a reducer that closed its end at once had p2pd reset the stream, and a sender still writing its
    parts then lost the answer (a BAD_GROUP_ID or a refusal) and saw only a reset (1 run in 2 of the rogue test)."""
    await _drain_quietly(writer)

    async def until_hung_up() -> None:
        while await reader.read(1 << 16):
            pass

    try:
        await asyncio.wait_for(until_hung_up(), linger_s)
    except (asyncio.TimeoutError, ConnectionError, OSError):
        pass
