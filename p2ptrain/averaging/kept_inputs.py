"""A reducer's audit inputs after its round: in a file without a name, not in the averager's memory (audit.py).

While a round runs, the inputs a reducer signs for are the received parts themselves (no copy). After it they wait
for the group's auditors, ``AUDIT_KEEP_S``, for the last ``KEPT_ROUNDS`` rounds: held in memory, that was up to
four copies of the vector in wire format in the averager process (4 x 243 MB at the 124m model in fp16, 4 x 2 GB
at 1B), of which each auditor reads one part. ``spill`` writes them, after the round and off the event loop, into
an anonymous temporary file (``tempfile.TemporaryFile``: O_TMPFILE on Linux, so no name exists that any exit, even
a SIGKILL, could leave behind) in the temporary directory (``TMPDIR``): the kernel's page cache holds them while
memory is free and writes them to disk when it is not. On a tmpfs ``TMPDIR`` they stay in memory (as shared memory
that swap can take). An input is read back with one ``pread`` when an auditor asks for it.
"""

from __future__ import annotations

import os
import tempfile
import threading
from typing import Dict, Mapping, Optional, Tuple

from hivemind.proto import runtime_pb2

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


def spill(inputs: Mapping[Key, runtime_pb2.Tensor], directory: Optional[str] = None) -> SpilledInputs:
    """Write ``inputs`` (received parts: ``runtime.Tensor`` messages or ``WireTensor``s) into a new anonymous file in
    ``directory`` (the temporary directory by default). Raises OSError (disk full, no such directory): the caller
    keeps them in memory then."""
    file = tempfile.TemporaryFile(dir=directory)
    try:
        index, offset = {}, 0
        for key, message in inputs.items():
            data = message.SerializeToString()
            view = memoryview(data)
            while view:  # os.write may write less than asked
                view = view[os.write(file.fileno(), view):]
            index[key] = (offset, len(data))
            offset += len(data)
    except BaseException:
        file.close()
        raise
    return SpilledInputs(file, index)
