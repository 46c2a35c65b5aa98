"""A reducer's audit inputs after its round: in a file without a name, not in the averager's memory (audit.py).

While a round runs, the inputs a reducer signs for are the received parts themselves (no copy). After it they wait
for the group's auditors, ``AUDIT_KEEP_S``, for the last ``KEPT_ROUNDS`` rounds: held in memory, that was up to
four copies of the vector in wire format in the averager process (4 x 243 MB at the 124m model in fp16, 4 x 2 GB
at 1B), of which each auditor reads one part. Over a memory budget (``audit.AUDIT_MEMORY_SHARE`` of the RAM),
``spill`` writes the oldest rounds', after the round and off the event loop, into an anonymous temporary file
(``tempfile.TemporaryFile``: O_TMPFILE on Linux, so no name exists that any exit, even a SIGKILL, could leave behind)
in the temporary directory (``TMPDIR``): the kernel's page cache holds them while memory is free and writes them to
disk when it is not. On a tmpfs ``TMPDIR`` they stay in memory (as shared memory
that swap can take). An input is read back with one ``pread`` when an auditor asks for it.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Dict, List, Mapping, Optional, Tuple, Union

from google.protobuf.internal.encoder import _VarintBytes  # protobuf's own varint writer
from hivemind.proto import runtime_pb2

from p2ptrain.averaging.wire_part import Buffer, WireTensor

Key = Tuple[int, int]
"""(part index, sender index)"""


class SpilledInputs:
    """One round's inputs in one anonymous file: ``get`` reads one back as its serialized ``runtime.Tensor``."""

    def __init__(self, file, index: Dict[Key, Tuple[int, int]]) -> None:
        self._file, self._index = file, index  # key -> (offset, length)
        self._lock = threading.Lock()  # close() against a read in flight (reads themselves need none: pread)

    def __contains__(self, key: Key) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    @property
    def size(self) -> int:
        """Bytes in the file."""
        return sum(length for _, length in self._index.values())

    def get(self, key: Key) -> Optional[bytes]:
        """The input's bytes as the sender sent them, or None if this file does not hold it (or was closed)."""
        with self._lock:
            if key not in self._index or self._file.closed:
                return None
            offset, length = self._index[key]
            data = os.pread(self._file.fileno(), length, offset)
        if len(data) != length:
            raise OSError(f"read {len(data)} of the {length} bytes of a kept audit input")
        return data

    def close(self) -> None:
        with self._lock:
            self._file.close()


def inputs_nbytes(inputs: Mapping[Key, Union[runtime_pb2.Tensor, WireTensor]]) -> int:
    """The bytes ``inputs`` hold (their buffers: a protobuf message's counted without copying them out)."""
    return sum(len(m.buffer) if isinstance(m, WireTensor) else m.ByteSize() for m in list(inputs.values()))


def serialized_pieces(message: Union[runtime_pb2.Tensor, WireTensor]) -> List[Buffer]:
    """The bytes of ``message`` serialized, in pieces whose concatenation is ``message.SerializeToString()``: for a
    ``WireTensor``, its buffer's field (tag, length, the buffer itself: no copy) then the other fields, in field
    order as protobuf writes them. Its ``SerializeToString`` copied a 2 MiB part three times into fresh memory,
    which made the writing of a round's inputs double the outer step beside it (2 peers of the 124m model)."""
    if not isinstance(message, WireTensor):
        return [message.SerializeToString()]
    buffer = memoryview(message.buffer).cast("B") if len(message.buffer) else b""
    head = _BUFFER_TAG + _VarintBytes(len(buffer)) if len(buffer) else b""
    return [head, buffer, message.meta().SerializeToString()]


_BUFFER_TAG = bytes([runtime_pb2.Tensor.BUFFER_FIELD_NUMBER << 3 | 2])  # field 1, length-delimited


def _write_all(fd: int, pieces: List[Buffer]) -> int:
    """Write ``pieces`` one after the other at the file's end; the bytes written (os.writev may write less)."""
    total = sum(len(piece) for piece in pieces)
    written = os.writev(fd, [piece for piece in pieces if len(piece)])
    if written < total:
        rest = memoryview(b"".join(bytes(piece) for piece in pieces))[written:]
        while rest:
            rest = rest[os.write(fd, rest):]
    return total


def spill(inputs: Mapping[Key, Union[runtime_pb2.Tensor, WireTensor]],
          directory: Optional[str] = None) -> SpilledInputs:
    """Write ``inputs`` (received parts: ``WireTensor``s, or ``runtime.Tensor`` messages) into a new anonymous file in
    ``directory`` (the temporary directory by default). Raises OSError (disk full, no such directory): the caller
    keeps them in memory then."""
    file = tempfile.TemporaryFile(dir=directory)
    try:
        index, offset = {}, 0
        for key, message in inputs.items():
            length = _write_all(file.fileno(), serialized_pieces(message))
            index[key] = (offset, length)
            offset += length
    except BaseException:
        file.close()
        raise
    return SpilledInputs(file, index)
