"""SparseLoCo's message: the top-k of each chunk of a peer's error-feedback accumulator, in 2 bits per value.

SparseLoCo (Sarfi, Therien, Lidin, Belilovsky 2025) replaces DiLoCo's dense pseudo-gradient and outer Nesterov
momentum by a decayed error-feedback accumulator of which each peer sends a sparse, 2-bit part each round. This
module is the math and the byte format, with no network: the rounds, the convergence benchmark and the tests share
it. Per peer and round, with the pseudo-gradient g (global parameters at the last sync minus the parameters now):

    e <- decay * e + g                       (the accumulator, the peer's own; zeros for a newcomer)
    m  = quantize(top_k(e, per chunk))       (the message this module packs into bytes)
    e <- e - decode(m)                       (what the message carried leaves the accumulator; the rest waits)
    g_avg = per entry, the mean of decode(m_i) over the peers whose message carried it
    global <- global - outer_lr * g_avg      (plain SGD; the decayed accumulator takes momentum's place)

**Chunks.** A 2-D tensor whose sides are multiples of ``TILE`` (64) is cut into 64x64 tiles; any other tensor,
flattened, into runs of ``TILE * TILE`` values (the last one shorter). A chunk of n values keeps
``min(n, ceil(k * n / 4096))`` of them, the largest in magnitude (``k`` = 128 by default: 3.1% of a full chunk).

**2-bit values.** Each kept value is a sign and one bit of magnitude: the chunk's kept magnitudes are split at
their (lower) median, and the message carries two fp16 scales per chunk, the mean magnitude at-or-below it and
above it.
A value decodes as sign x scale, one fp32 multiply of fp16 numbers: the same bytes give the same bits everywhere.

**Bytes** (little-endian, sizes fixed by the tensors' shapes and k, so a message of any other size is refused):
per chunk two fp16 scales (low, high); then every kept index (its position inside its chunk, < 4096) in 12 bits,
two to three bytes, in chunk order and ascending inside a chunk (one zero index pads an odd count); then the
2-bit codes (bit 1 the sign, bit 0 high magnitude), four to a byte, lowest bits first. A full chunk costs
4 + 192 + 32 = 228 bytes against fp16's 8192: 2.8%.

``decode`` checks a peer's message before it touches anything: the exact size, indices strictly ascending inside
each chunk (so in range and unique), scales finite and non-negative. Anything else is a ``WireFormatError``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np
import torch

from p2ptrain.averaging.compression import WireFormatError

TILE = 64
"""side of a 2-D tensor's tiles; other tensors are cut into runs of TILE * TILE values"""
CHUNK = TILE * TILE
DEFAULT_K = 128
"""values kept per full chunk (SparseLoCo's reference setting: 128 of each 64x64 tile)"""
DEFAULT_DECAY = 0.95
"""the accumulator's decay per round (SparseLoCo's reference setting)"""
DEFAULT_OUTER_LR = 1.0
"""the outer SGD's learning rate on the averaged messages (SparseLoCo's reference setting)"""


@dataclass(frozen=True)
class Layout:
    """How a list of tensors is cut into chunks and how many values each keeps: fixed by the shapes and k, so
    sender and receiver agree on every size without sending any."""

    shapes: Tuple[Tuple[int, ...], ...]
    k: int = DEFAULT_K

    def tiled(self, shape: Tuple[int, ...]) -> bool:
        return len(shape) == 2 and shape[0] % TILE == 0 and shape[1] % TILE == 0

    def chunk_lengths(self, shape: Tuple[int, ...]) -> List[int]:
        n = math.prod(shape)
        if self.tiled(shape):
            return [CHUNK] * (n // CHUNK)
        return [min(CHUNK, n - start) for start in range(0, n, CHUNK)]

    def kept(self, length: int) -> int:
        return min(length, -(-self.k * length // CHUNK))

    @property
    def counts(self) -> List[int]:
        """Values kept per chunk, every tensor's chunks in order."""
        return [self.kept(n) for shape in self.shapes for n in self.chunk_lengths(shape)]

    @property
    def num_chunks(self) -> int:
        return sum(len(self.chunk_lengths(shape)) for shape in self.shapes)

    @property
    def message_bytes(self) -> int:
        kept = sum(self.counts)
        return 4 * self.num_chunks + 3 * (-(-kept // 2)) + -(-kept // 4)

    @property
    def dense_fp16_bytes(self) -> int:
        return 2 * sum(math.prod(shape) for shape in self.shapes)


def _chunks(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    """(chunks, CHUNK) fp32 view-copy of one tensor's chunks; a short last chunk padded with NaN."""
    shape = tuple(tensor.shape)
    if layout.tiled(shape):
        rows, cols = shape
        return tensor.reshape(rows // TILE, TILE, cols // TILE, TILE).permute(0, 2, 1, 3).reshape(-1, CHUNK).float()
    flat = tensor.reshape(-1).float()
    padded = torch.full((-(-flat.numel() // CHUNK) * CHUNK,), float("nan"))
    padded[:flat.numel()] = flat
    return padded.view(-1, CHUNK)


def _unchunk_(out: torch.Tensor, chunks: torch.Tensor, layout: Layout) -> None:
    shape = tuple(out.shape)
    if layout.tiled(shape):
        rows, cols = shape
        out.copy_(chunks.view(rows // TILE, cols // TILE, TILE, TILE).permute(0, 2, 1, 3).reshape(shape))
    else:
        out.view(-1).copy_(chunks.reshape(-1)[:out.numel()])


def encode(tensors: Sequence[torch.Tensor], layout: Layout) -> Tuple[bytes, List[torch.Tensor]]:
    """Pack the top-k of each chunk of ``tensors`` (the accumulator) in 2 bits. Returns the message and what it
    decodes to (fp32, dense, zeros elsewhere): the sender subtracts the latter from its accumulator."""
    counts = np.asarray(layout.counts, dtype=np.int64)
    all_chunks = [_chunks(t.detach(), layout) for t in tensors]
    chunks = torch.cat(all_chunks) if all_chunks else torch.empty(0, CHUNK)
    magnitude = chunks.abs().nan_to_num(nan=-1.0)  # padding is never kept
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if len(counts) else counts
    index = np.zeros(int(counts.sum()), dtype=np.uint16)
    code = np.zeros(int(counts.sum()), dtype=np.uint8)
    scales = np.zeros((len(counts), 2), dtype=np.float32)
    for count in np.unique(counts):  # one topk per distinct count: all full chunks together
        rows = np.flatnonzero(counts == count)
        if count == 0:
            continue
        rows_t = torch.from_numpy(rows)
        idx = torch.topk(magnitude[rows_t], int(count), dim=1, sorted=False).indices.sort(dim=1).values
        value = torch.gather(chunks[rows_t], 1, idx)
        mag = value.abs()
        high = mag > mag.median(dim=1, keepdim=True).values  # above the lower median: at most half are high
        scales[rows, 0] = ((mag * ~high).sum(dim=1) / (~high).sum(dim=1)).numpy()  # never empty: the median
        scales[rows, 1] = ((mag * high).sum(dim=1) / high.sum(dim=1).clamp(min=1)).numpy()  # 0 if none
        at = (offsets[rows][:, None] + np.arange(count)[None, :]).reshape(-1)
        index[at] = idx.numpy().reshape(-1)
        code[at] = (((value < 0).to(torch.uint8) << 1) | high.to(torch.uint8)).numpy().reshape(-1)
    scales = np.minimum(scales, np.float32(np.finfo(np.float16).max)).astype(np.float16)
    message = _pack(scales, index, code)
    return message, decode(message, layout)


def _pack(scales: np.ndarray, index: np.ndarray, code: np.ndarray) -> bytes:
    if index.size % 2:
        index = np.append(index, np.uint16(0))
    a, b = index[0::2], index[1::2]
    packed_index = np.stack([a >> 4, ((a & 15) << 4) | (b >> 8), b & 255], axis=1).astype(np.uint8).reshape(-1)
    code = np.append(code, np.zeros(-code.size % 4, np.uint8)).reshape(-1, 4)
    packed_code = (code[:, 0] | (code[:, 1] << 2) | (code[:, 2] << 4) | (code[:, 3] << 6)).astype(np.uint8)
    return scales.astype("<f2").tobytes() + packed_index.tobytes() + packed_code.tobytes()


def decode(message: bytes, layout: Layout) -> List[torch.Tensor]:
    """The dense fp32 tensors a message stands for (zeros where nothing was kept). Raises ``WireFormatError`` on
    a message of the wrong size, indices out of order (so out of range or repeated) or impossible scales."""
    at, value = decode_entries(message, layout)
    dense = torch.zeros(layout.num_chunks, CHUNK)
    dense.view(-1)[at] = value
    return unchunk(dense, layout)


def unchunk(dense: torch.Tensor, layout: Layout) -> List[torch.Tensor]:
    """The tensors of ``layout`` from their chunks (``[num_chunks, CHUNK]``, padding ignored)."""
    out, row = [], 0
    for shape in layout.shapes:
        n = len(layout.chunk_lengths(shape))
        tensor = torch.empty(shape)
        _unchunk_(tensor, dense[row:row + n], layout)
        out.append(tensor)
        row += n
    return out


def decode_entries(message: bytes, layout: Layout) -> Tuple[torch.Tensor, torch.Tensor]:
    """What a message carries, checked as ``decode`` does: each kept value's place in the chunks laid end to end
    (chunk x CHUNK + index, ascending) and its fp32 value."""
    counts = layout.counts
    if len(message) != layout.message_bytes:
        raise WireFormatError(f"sparse message of {len(message)} bytes, expected {layout.message_bytes}")
    kept, chunks = sum(counts), len(counts)
    buffer = np.frombuffer(message, dtype=np.uint8)
    scales = buffer[:4 * chunks].view("<f2").reshape(chunks, 2).astype(np.float32)
    if not np.isfinite(scales).all() or (scales < 0).any():
        raise WireFormatError("sparse message with a scale that is not finite and non-negative")
    at = 4 * chunks
    triples = buffer[at:at + 3 * (-(-kept // 2))].reshape(-1, 3).astype(np.uint16)
    at += triples.size
    index = np.empty(2 * len(triples), dtype=np.int64)
    index[0::2] = (triples[:, 0] << 4) | (triples[:, 1] >> 4)
    index[1::2] = ((triples[:, 1] & 15) << 8) | triples[:, 2]
    index = index[:kept]
    packed = buffer[at:]
    code = np.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], axis=1).reshape(-1)[:kept]

    ends = np.cumsum(counts)
    starts = ends - np.asarray(counts)
    lengths = [n for shape in layout.shapes for n in layout.chunk_lengths(shape)]
    chunk_of = np.repeat(np.arange(chunks), counts)
    first = np.zeros(kept, dtype=bool)
    first[starts[np.asarray(counts) > 0]] = True
    ascending = np.ones(kept, dtype=bool)
    ascending[1:] = index[1:] > index[:-1]
    if not (ascending | first).all() or (kept and (index >= np.asarray(lengths)[chunk_of]).any()):
        raise WireFormatError("sparse message with chunk indices out of range, out of order or repeated")

    magnitude = scales[chunk_of, (code & 1).astype(np.int64)]
    value = np.where(code & 2, -magnitude, magnitude).astype(np.float32)
    return torch.from_numpy(chunk_of * CHUNK + index), torch.from_numpy(value)


def accumulate_(accumulator: Sequence[torch.Tensor], pseudo_gradient: Sequence[torch.Tensor],
                decay: float = DEFAULT_DECAY) -> None:
    """e <- decay * e + g, in place."""
    for e, g in zip(accumulator, pseudo_gradient):
        e.mul_(decay).add_(g)


def send_(accumulator: Sequence[torch.Tensor], layout: Layout) -> Tuple[bytes, List[torch.Tensor]]:
    """This round's message from the accumulator, which keeps what the message did not carry."""
    message, carried = encode(accumulator, layout)
    for e, c in zip(accumulator, carried):
        e.sub_(c)
    return message, carried
