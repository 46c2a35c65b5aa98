"""The all-reduce's part stream (part_stream.py, protocol 10): its bytes, and what a reader refuses before reading.
Frames are read by ``FrameReader`` over a real socket pair here; the streams between real peers are exercised by
every swarm test that averages (tests/swarm)."""

from __future__ import annotations

import asyncio
import socket

import pytest
import torch
from hivemind.compression import Float16Compression
from hivemind.proto import averaging_pb2, runtime_pb2

from p2ptrain.averaging import part_stream
from p2ptrain.averaging.audit import commitment
from p2ptrain.averaging.compression import Fp16Codec
from p2ptrain.averaging.part_stream import (END, ERROR, FRAME, MESSAGE, PartStreamError, frame, frame_reader, hello,
                                            message_frame, message_of, read_hello)
from p2ptrain.averaging.wire_part import WireMessage
from p2ptrain.security import MAX_STREAM_MESSAGE_BYTES


def read_hello_of(data: bytes):
    """``read_hello`` over a stream that holds ``data``, then ends."""

    async def reading():
        reader = asyncio.StreamReader()
        reader.feed_data(data)
        reader.feed_eof()
        return await asyncio.wait_for(read_hello(reader), 5)

    return asyncio.run(reading())


def read_frame(data: bytes, eof: bool = True):
    """The first frame a ``FrameReader`` reads off a socket that received ``data`` (then its end, with ``eof``)."""

    async def reading():
        ours, theirs = socket.socketpair()
        with theirs:
            reader, writer = await asyncio.open_unix_connection(sock=ours)
            theirs.sendall(data)
            if eof:
                theirs.shutdown(socket.SHUT_WR)
            try:
                return await asyncio.wait_for(frame_reader(reader, writer).read_frame(), 5)  # no waiting for more
            finally:
                writer.close()

    return asyncio.run(reading())


def a_part(**fields) -> averaging_pb2.AveragingData:
    tensor = runtime_pb2.Tensor(buffer=bytes(range(8)), size=[2, 2], dtype="float16", compression=1)
    return averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"g" * 4, weight=2.5,
                                       tensor_part=tensor, **fields)


def test_the_bytes_of_a_hello_and_a_frame_stay_the_same():
    """A deliberate change of these bytes is a new protocol version (averaging/round.py's PROTOCOL_VERSION)."""
    assert hello(b"gid") == b"p2ptpart" + (12).to_bytes(2, "little") + (3).to_bytes(2, "little") + b"gid"
    head, payload = message_frame(a_part())
    assert payload == bytes(range(8))
    meta = head[FRAME.size:]
    assert head[:FRAME.size] == bytes([MESSAGE]) + len(meta).to_bytes(4, "little") + (8).to_bytes(4, "little")
    # the meta is the message without its tensor's bytes: code, group id, shape, dtype, codec, weight
    assert meta.hex() == "0804120467676767220f120202022207666c6f617431362801290000000000000440"
    parsed = averaging_pb2.AveragingData.FromString(meta)
    assert parsed.tensor_part.buffer == b"" and list(parsed.tensor_part.size) == [2, 2]
    assert (parsed.code, parsed.group_id, parsed.weight) == (averaging_pb2.PART_FOR_AVERAGING, b"gggg", 2.5)
    assert frame(END) == (bytes([END, 0, 0, 0, 0, 0, 0, 0, 0]), b"")


def test_a_message_comes_back_whole_through_a_frame():
    message = a_part(peer_id=b"signature")
    head, payload = message_frame(message)
    kind, meta, body = read_frame(head + payload)
    assert kind == MESSAGE and message_of(meta, body).to_proto() == message
    # an answer with no tensor (BAD_GROUP_ID) stays one
    bare = averaging_pb2.AveragingData(code=averaging_pb2.BAD_GROUP_ID)
    kind, meta, body = read_frame(b"".join(message_frame(bare)))
    assert message_of(meta, body).to_proto() == bare and not message_of(meta, body).HasField("tensor_part")
    # read as a protobuf message would be: the tensor of a message without one is empty, and no codec decodes it
    assert message_of(meta, body).tensor_part.buffer == b"" and message_of(meta, body).tensor_part.size == ()


def test_a_part_goes_out_from_its_tensor_s_memory_in_the_same_bytes_as_the_message():
    """A part the runner encodes (``WireCodec.encode``) is framed without a copy of its bytes, and its frame is the
    frame of the protobuf message hivemind's codec makes of the same values."""
    values = torch.randn(3, 5)
    codec = Fp16Codec()
    encoded = codec.encode(values)
    assert isinstance(encoded.buffer, memoryview)
    as_message = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"g", weight=1.5,
                                             tensor_part=Float16Compression().compress(values, None))
    wire = WireMessage(code=averaging_pb2.PART_FOR_AVERAGING, group_id=b"g", weight=1.5, tensor_part=encoded)
    head, payload = message_frame(wire)
    assert payload is encoded.buffer and (head, bytes(payload)) == message_frame(as_message)
    assert commitment(encoded) == commitment(as_message.tensor_part)
    assert encoded.SerializeToString() == as_message.tensor_part.SerializeToString()
    assert torch.equal(codec.extract(message_of(head[FRAME.size:], bytes(payload)).tensor_part),
                       codec.extract(as_message.tensor_part))


def test_a_hello_of_another_version_or_kind_is_refused_in_words():
    assert read_hello_of(hello(b"group")) == b"group"
    with pytest.raises(PartStreamError, match="stream version 11, this peer 12: run the same p2ptrain version"):
        read_hello_of(hello(b"group", version=11))
    with pytest.raises(PartStreamError, match="does not start with p2ptrain's all-reduce hello"):
        read_hello_of(b"\x01" + bytes(100))
    with pytest.raises(PartStreamError, match="60000-byte group id"):
        read_hello_of(part_stream.HELLO.pack(part_stream.MAGIC, 12, 60000))


@pytest.mark.parametrize("header, problem", [
    (FRAME.pack(MESSAGE, 0, MAX_STREAM_MESSAGE_BYTES + 1), "the limits are"),
    (FRAME.pack(MESSAGE, (1 << 20) + 1, 0), "the limits are"),
    (FRAME.pack(7, 0, 0), "unknown kind 7"),
])
def test_a_frame_too_large_or_of_no_known_kind_is_refused_before_its_bytes_are_read(header, problem):
    with pytest.raises(PartStreamError, match=problem):
        read_frame(header, eof=False)  # no more bytes: one that waited for the announced ones would time out


def test_meta_that_does_not_parse_is_a_stream_error():
    with pytest.raises(PartStreamError, match="do not parse"):
        message_of(b"\xff\xff\xff", b"")


def test_an_error_frame_carries_its_reason():
    head, payload = frame(ERROR, "no such group".encode())
    assert read_frame(head + payload) == (ERROR, b"no such group", b"")
