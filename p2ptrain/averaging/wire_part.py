"""A part of the all-reduce as the part stream carries it: a ``runtime_pb2.Tensor``'s fields, its bytes held as they
are instead of copied into and out of protobuf.

upb's protobuf copies a bytes field at every write and at every read. Built as messages, a 2 MiB part was copied
into the message, out of it for its frame, out again for its BLAKE3 commitment and once more for its decode: four
copies into fresh memory, whose pages the kernel faults in one by one (1.2-1.4 ms per 2 MiB copy on the 2-core
machine, against 0.2 ms for a conversion into memory written before). ``WireTensor`` and ``WireMessage`` carry the
fields of ``runtime_pb2.Tensor`` and ``averaging_pb2.AveragingData`` under the same names, so the codecs,
commitments, receipts and checks read them as they read the messages; a part we encode holds a view of its fp16
tensor (``WireCodec.encode``), and a part we receive holds the bytes the stream read. They become protobuf messages
only where one is stored or sent on (``SerializeToString``: audit inputs, evidence). The stream's bytes are the same
as with the messages (``part_stream.message_frame``).
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from hivemind.proto import averaging_pb2, runtime_pb2

Buffer = Union[bytes, memoryview]


class WireTensor:
    """A ``runtime_pb2.Tensor`` whose ``buffer`` is bytes or a byte-format memoryview, read without a copy."""

    __slots__ = ("buffer", "size", "dtype", "compression", "requires_grad", "chunks")

    def __init__(self, buffer: Buffer, size: Sequence[int], dtype: str, compression: int,
                 requires_grad: bool = False, chunks: int = 0) -> None:
        if isinstance(buffer, memoryview) and (buffer.format != "B" or not buffer.c_contiguous):
            raise ValueError(f"a part's buffer must be contiguous bytes, got a memoryview of format {buffer.format!r}")
        self.buffer, self.size, self.dtype = buffer, tuple(size), dtype
        self.compression, self.requires_grad, self.chunks = compression, requires_grad, chunks

    @classmethod
    def of(cls, message: runtime_pb2.Tensor, buffer: Optional[Buffer] = None) -> "WireTensor":
        """The fields of ``message``, with ``buffer`` as its bytes (the message's own if None: one copy)."""
        return cls(message.buffer if buffer is None else buffer, message.size, message.dtype, message.compression,
                   message.requires_grad, message.chunks)

    def meta(self) -> runtime_pb2.Tensor:
        """The message without its bytes: what a frame's meta holds of the tensor."""
        return runtime_pb2.Tensor(size=self.size, dtype=self.dtype, compression=self.compression,
                                  requires_grad=self.requires_grad, chunks=self.chunks)

    def to_proto(self) -> runtime_pb2.Tensor:
        message = self.meta()
        message.buffer = bytes(self.buffer)
        return message

    def SerializeToString(self) -> bytes:  # noqa: N802 (protobuf's name: the part stands in for a message)
        return self.to_proto().SerializeToString()

    def ByteSize(self) -> int:  # noqa: N802
        return self.to_proto().ByteSize()


class WireMessage:
    """An ``averaging_pb2.AveragingData`` whose tensor is a ``WireTensor``. As in protobuf, a message without one
    still reads as an empty tensor (which no codec decodes), and ``HasField`` tells the two apart."""

    __slots__ = ("code", "group_id", "peer_id", "weight", "tensor_part", "_has_tensor")

    def __init__(self, code: int = 0, group_id: bytes = b"", peer_id: bytes = b"", weight: float = 0.0,
                 tensor_part: Optional[WireTensor] = None) -> None:
        self.code, self.group_id, self.peer_id, self.weight = code, group_id, peer_id, weight
        self._has_tensor = tensor_part is not None
        self.tensor_part = tensor_part if tensor_part is not None else WireTensor(b"", (), "", 0)

    def HasField(self, name: str) -> bool:  # noqa: N802
        if name != "tensor_part":
            raise ValueError(f"WireMessage has no message field {name!r}")
        return self._has_tensor

    def meta(self) -> averaging_pb2.AveragingData:
        """The message without its tensor's bytes."""
        meta = averaging_pb2.AveragingData(code=self.code, group_id=self.group_id, peer_id=self.peer_id,
                                           weight=self.weight)
        if self._has_tensor:
            meta.tensor_part.CopyFrom(self.tensor_part.meta())
        return meta

    def to_proto(self) -> averaging_pb2.AveragingData:
        message = self.meta()
        if self._has_tensor:
            message.tensor_part.buffer = bytes(self.tensor_part.buffer)
        return message

    @classmethod
    def of(cls, meta: averaging_pb2.AveragingData, payload: Buffer = b"") -> "WireMessage":
        """A frame's message: ``meta`` (the message without its tensor's bytes) and ``payload`` (those bytes; a
        payload makes a tensor, as it did set one in the protobuf message)."""
        has_tensor = meta.HasField("tensor_part") or len(payload) > 0
        return cls(meta.code, meta.group_id, meta.peer_id, meta.weight,
                   WireTensor.of(meta.tensor_part, payload) if has_tensor else None)
