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

**Bytes** (little-endian; all sizes but the last part's fixed by the tensors' shapes and k):
1. per chunk two fp16 scales (low, high);
2. the 2-bit codes (bit 1 the sign, bit 0 high magnitude), four to a byte, lowest bits first;
3. the kept places (each value's position inside its chunk, ascending), Rice-coded: within a chunk, gap j is
   ``index[j] - index[j - 1] - 1`` (``index[0]`` for the first), and a chunk of n values keeping c codes each gap
   with ``r = floor(log2((n - c) // c))`` bits (``rice_bits``): its low r bits here, every value's in chunk order,
   packed lowest bit first;
4. the gaps' high parts (``gap >> r``) in unary: that many 0 bits, then a 1, every value's in chunk order, lowest
   bit first, zero-padded to a byte. Its length varies: between ``min_message_bytes`` and ``max_message_bytes``.

A full chunk keeping 128 values (r = 4) costs 4 + 32 + 64 bytes plus about 40 of unary: about 140 bytes against
fp16's 8192, **1.7%**. 12 bits per place (2.8% a chunk) would be 192 bytes; the places' entropy (128 of 4096 drawn
at random, log2 C(4096, 128) / 128) is 6.4 bits, about 103 bytes; the Rice code spends about 6.6.

``decode`` checks a peer's message before it touches anything: a size within the bounds, scales finite and
non-negative, exactly one unary 1 bit per kept value with nothing but padding after the last, and every place
inside its chunk (places ascend by construction, so they are unique). Anything else is a ``WireFormatError``.

**Devices.** ``encode`` selects on the accumulator's own device (a GPU's when the outer step runs there): chunks,
top-k, median split and codes are torch ops there, and so is what the message decodes to, which ``send_`` takes out
of the accumulator in place. Only the kept places (2 bytes each), codes (1 byte) and, off the CPU, the kept
magnitudes (4 bytes) cross to the host, which packs the bytes. Every device sends the CPU's bytes: the chunks where a
tie straddles the top-k's cut are chosen again by the CPU's topk (``_top``), and the scales' sums, whose last bit
depends on their order, are taken on the host (``_scales``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
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
    sender and receiver agree on every size without sending any. The per-chunk lists and sizes are computed once per
    layout (every message a round encodes or decodes reads them)."""

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

    @cached_property
    def lengths(self) -> List[int]:
        """Values per chunk, every tensor's chunks in order."""
        return [n for shape in self.shapes for n in self.chunk_lengths(shape)]

    @cached_property
    def counts(self) -> List[int]:
        """Values kept per chunk, every tensor's chunks in order."""
        return [self.kept(n) for n in self.lengths]

    @property
    def num_chunks(self) -> int:
        return len(self.lengths)

    @cached_property
    def rice(self) -> List[int]:
        """The Rice parameter of each chunk's gaps (``rice_bits``)."""
        return [rice_bits(n, c) for n, c in zip(self.lengths, self.counts)]

    @cached_property
    def fixed_bytes(self) -> int:
        """Scales, codes and the gaps' low bits: every part of a message but the unary one."""
        kept = sum(self.counts)
        low_bits = sum(c * r for c, r in zip(self.counts, self.rice))
        return 4 * self.num_chunks + -(-kept // 4) + -(-low_bits // 8)

    @cached_property
    def min_message_bytes(self) -> int:
        """Every gap below 2^r: one unary bit per kept value."""
        return self.fixed_bytes + -(-sum(self.counts) // 8)

    @cached_property
    def max_message_bytes(self) -> int:
        """A chunk's gaps add up to at most n - c, so their high parts to at most (n - c) >> r."""
        unary = sum(c + ((n - c) >> r) for n, c, r in zip(self.lengths, self.counts, self.rice))
        return self.fixed_bytes + -(-unary // 8)

    @property
    def dense_fp16_bytes(self) -> int:
        return 2 * sum(math.prod(shape) for shape in self.shapes)


def rice_bits(length: int, count: int) -> int:
    """The Rice parameter of a chunk of ``length`` values keeping ``count``: its gaps average about (length - count)
    / count, and r = floor(log2) of that codes such geometric gaps within a few percent of their entropy."""
    if count == 0 or length <= count:
        return 0
    return max(0, ((length - count) // count).bit_length() - 1)


def _chunks_into_(out: torch.Tensor, tensor: torch.Tensor, layout: Layout) -> None:
    """Write ``tensor``'s chunks into ``out`` (its rows of the (chunks, CHUNK) fp32 buffer, on the accumulator's
    device); a short last chunk padded with NaN."""
    shape = tuple(tensor.shape)
    if layout.tiled(shape):
        rows, cols = shape
        out.view(rows // TILE, cols // TILE, TILE, TILE).copy_(
            tensor.reshape(rows // TILE, TILE, cols // TILE, TILE).permute(0, 2, 1, 3))
    else:
        flat = out.view(-1)
        flat[:tensor.numel()].copy_(tensor.reshape(-1))
        flat[tensor.numel():] = float("nan")


def _unchunk_(out: torch.Tensor, chunks: torch.Tensor, layout: Layout) -> None:
    shape = tuple(out.shape)
    if layout.tiled(shape):
        rows, cols = shape
        out.copy_(chunks.view(rows // TILE, cols // TILE, TILE, TILE).permute(0, 2, 1, 3).reshape(shape))
    else:
        out.view(-1).copy_(chunks.reshape(-1)[:out.numel()])


def _groups(counts: np.ndarray):
    """The chunks of each distinct kept count (one topk each: all full chunks together), as (count, rows, where
    the rows' values go in the flat arrays of kept values): slices where the rows are consecutive (no copy)."""
    offsets = np.cumsum(counts) - counts
    for count in np.unique(counts):
        rows = np.flatnonzero(counts == count)
        if not count:
            continue
        if rows[-1] - rows[0] + 1 == rows.size:
            first = int(offsets[rows[0]])
            yield int(count), slice(int(rows[0]), int(rows[-1]) + 1), slice(first, first + rows.size * int(count))
        else:
            yield int(count), rows, (offsets[rows][:, None] + np.arange(count)).reshape(-1)


def _on(index, device: torch.device):
    return index if isinstance(index, slice) else torch.from_numpy(index).to(device)


def _is_cpu(device: torch.device) -> bool:
    """Whether ``encode`` takes the CPU's path (the tests run the other one on the CPU too)."""
    return device.type == "cpu"


def _top(magnitude: torch.Tensor, count: int, recheck_ties: bool) -> torch.Tensor:
    """The places of each row's ``count`` largest values, ascending. Where values tie at the cut, which of them are
    kept is topk's choice, and the CPU's (an nth_element) and a GPU's (a radix select) may choose differently. With
    ``recheck_ties`` (off the CPU), the rows where a tie straddles the cut (rare, but every row of a chunk of zeros)
    are chosen again by the CPU's topk, so every device keeps the places the CPU keeps and sends the same bytes."""
    top = torch.topk(magnitude, count, dim=1, sorted=False)
    index = top.indices
    if recheck_ties:
        cut = top.values.min(dim=1, keepdim=True).values
        tied = ((magnitude >= cut).sum(dim=1) > count).nonzero().view(-1)
        if tied.numel():
            index[tied] = torch.topk(magnitude[tied].cpu(), count, dim=1, sorted=False).indices.to(index.device)
    return index.sort(dim=1).values


def _scales(mag: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """(rows, 2) fp32: each row's mean kept magnitude at-or-below its median and above it (0 if none above; never
    empty below: the median). Always on the CPU: a sum's last bit depends on its order, which is each device's own."""
    return torch.stack([(mag * ~high).sum(dim=1) / (~high).sum(dim=1),
                        (mag * high).sum(dim=1) / high.sum(dim=1).clamp(min=1)], dim=1)


def encode(tensors: Sequence[torch.Tensor], layout: Layout) -> Tuple[bytes, List[torch.Tensor]]:
    """Pack the top-k of each chunk of ``tensors`` (the accumulator) in 2 bits. Returns the message and what it
    decodes to (fp32, dense, zeros elsewhere, on the tensors' device): the sender subtracts the latter from its
    accumulator.

    The selection (chunks, top-k, median split, codes) and the decoded tensors stay on the tensors' device; the
    kept places (int16), codes and, off the CPU, the kept magnitudes (for the scales' sums) come to the host, where
    the bytes are packed. Any device gives the CPU's bytes and bits (``_top``, ``_scales``)."""
    device = tensors[0].device if len(tensors) else torch.device("cpu")
    counts = np.asarray(layout.counts, dtype=np.int64)
    chunks = torch.empty(layout.num_chunks, CHUNK, device=device)
    row = 0
    for tensor, shape in zip(tensors, layout.shapes):
        n = len(layout.chunk_lengths(shape))
        _chunks_into_(chunks[row:row + n], tensor.detach(), layout)
        row += n
    magnitude = chunks.abs().nan_to_num_(nan=-1.0)  # padding is never kept
    kept = int(counts.sum())
    index = torch.empty(kept, dtype=torch.int16, device=device)  # a place in its chunk: below 4096
    code = torch.empty(kept, dtype=torch.uint8, device=device)
    on_cpu = _is_cpu(device)
    kept_mag = None if on_cpu else torch.empty(kept, device=device)
    scales = torch.zeros(layout.num_chunks, 2)
    groups = list(_groups(counts))
    for count, rows, at in groups:
        select, at = _on(rows, device), _on(at, device)
        idx = _top(magnitude[select], count, recheck_ties=not on_cpu)
        # (rows, count): the kept values, gathered without copying the rows' chunks first
        value = torch.gather(chunks[select], 1, idx) if isinstance(select, slice) else chunks[select[:, None], idx]
        mag = value.abs()
        high = mag > mag.median(dim=1, keepdim=True).values  # above the lower median: at most half are high
        index[at] = idx.view(-1).to(torch.int16)
        code[at] = (((value < 0).to(torch.uint8) << 1) | high.to(torch.uint8)).view(-1)
        if on_cpu:
            scales[rows] = _scales(mag, high)
        else:
            kept_mag[at] = mag.view(-1)
    del magnitude
    index_host, code_host = index.cpu(), code.cpu()
    if not on_cpu:  # the same (rows, count) sums as on the CPU, in the CPU's order
        kept_mag = kept_mag.cpu()
        for count, rows, at in groups:
            scales[rows] = _scales(kept_mag[at].view(-1, count), (code_host[at] & 1).bool().view(-1, count))
    scales16 = np.minimum(scales.numpy(), np.float32(np.finfo(np.float16).max)).astype(np.float16)
    if not np.isfinite(scales16).all():  # an inf or NaN in the accumulator: a message no peer would decode
        raise WireFormatError("sparse message with a scale that is not finite and non-negative")
    message = _pack(scales16, index_host.numpy().astype(np.int64), code_host.numpy(), layout)
    # what the message decodes to (decode_entries' values, the same bits), built where the accumulator is
    chunk_of = torch.repeat_interleave(torch.arange(layout.num_chunks, device=device),
                                       torch.from_numpy(counts).to(device))
    decoded = torch.from_numpy(scales16.astype(np.float32)).to(device)[chunk_of, (code & 1).long()]
    dense = chunks.zero_()  # the chunks are no longer needed: their memory holds the decoded values
    dense.view(-1)[chunk_of * CHUNK + index.long()] = torch.where((code & 2).bool(), -decoded, decoded)
    return message, unchunk(dense, layout)


def _pack(scales: np.ndarray, index: np.ndarray, code: np.ndarray, layout: Layout) -> bytes:
    """The message of these scales, places (ascending within each chunk) and 2-bit codes (see the module's
    docstring for the format)."""
    counts = np.asarray(layout.counts, dtype=np.int64)
    rice = np.repeat(np.asarray(layout.rice, dtype=np.int64), counts)
    first = np.zeros(index.size, dtype=bool)
    first[(np.cumsum(counts) - counts)[counts > 0]] = True
    gap = index - np.where(first, -1, np.concatenate([[-1], index[:-1]])) - 1
    code = np.append(code, np.zeros(-code.size % 4, np.uint8)).reshape(-1, 4)
    packed_code = (code[:, 0] | (code[:, 1] << 2) | (code[:, 2] << 4) | (code[:, 3] << 6)).astype(np.uint8)
    low = np.zeros(int(rice.sum()), dtype=np.uint8)  # the gaps' low bits, each gap's r of them in turn
    at = np.cumsum(rice) - rice
    for bit in range(int(rice.max(initial=0))):
        has = rice > bit
        low[at[has] + bit] = (gap[has] >> bit) & 1
    high = gap >> rice
    unary = np.zeros(int(high.sum() + high.size), dtype=np.uint8)
    unary[np.cumsum(high + 1) - 1] = 1  # high zeros, then the 1
    return (scales.astype("<f2").tobytes() + packed_code.tobytes() + np.packbits(low, bitorder="little").tobytes()
            + np.packbits(unary, bitorder="little").tobytes())


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
        tensor = torch.empty(shape, device=dense.device)
        _unchunk_(tensor, dense[row:row + n], layout)
        out.append(tensor)
        row += n
    return out


def decode_entries(message: bytes, layout: Layout) -> Tuple[torch.Tensor, torch.Tensor]:
    """What a message carries, checked as ``decode`` does: each kept value's place in the chunks laid end to end
    (chunk x CHUNK + index, ascending) and its fp32 value."""
    counts = np.asarray(layout.counts, dtype=np.int64)
    if not layout.min_message_bytes <= len(message) <= layout.max_message_bytes:
        raise WireFormatError(f"sparse message of {len(message)} bytes, expected {layout.min_message_bytes} to "
                              f"{layout.max_message_bytes}")
    kept, chunks = int(counts.sum()), len(counts)
    buffer = np.frombuffer(message, dtype=np.uint8)
    scales = buffer[:4 * chunks].view("<f2").reshape(chunks, 2).astype(np.float32)
    if not np.isfinite(scales).all() or (scales < 0).any():
        raise WireFormatError("sparse message with a scale that is not finite and non-negative")
    at = 4 * chunks
    packed = buffer[at:at + -(-kept // 4)]
    code = np.stack([(packed >> s) & 3 for s in (0, 2, 4, 6)], axis=1).reshape(-1)[:kept]
    at += packed.size
    rice = np.repeat(np.asarray(layout.rice, dtype=np.int64), counts)
    low_bits = np.unpackbits(buffer[at:layout.fixed_bytes], bitorder="little")
    starts = np.cumsum(rice) - rice
    gap = np.zeros(kept, dtype=np.int64)
    for bit in range(int(rice.max(initial=0))):
        has = rice > bit
        gap[has] |= low_bits[starts[has] + bit].astype(np.int64) << bit
    ones = np.flatnonzero(np.unpackbits(buffer[layout.fixed_bytes:], bitorder="little"))
    if ones.size != kept or len(message) != layout.fixed_bytes + (-(-(int(ones[-1]) + 1) // 8) if kept else 0):
        raise WireFormatError(f"sparse message whose places' unary part holds {ones.size} values, expected {kept} "
                              "and nothing after the last")
    gap |= (np.diff(ones, prepend=-1) - 1) << rice
    chunk_of = np.repeat(np.arange(chunks), counts)
    ends = np.cumsum(gap + 1)  # each place + 1, counted from the first chunk's start; a chunk's from its own:
    index = ends - 1 - np.concatenate([[0], ends])[(np.cumsum(counts) - counts)][chunk_of]
    if kept and (index >= np.asarray(layout.lengths)[chunk_of]).any():
        raise WireFormatError("sparse message with a place past the end of its chunk")

    magnitude = scales[chunk_of, (code & 1).astype(np.int64)]
    value = np.where(code & 2, -magnitude, magnitude).astype(np.float32)
    return torch.from_numpy(chunk_of * CHUNK + index), torch.from_numpy(value)


def accumulate_(accumulator: Sequence[torch.Tensor], pseudo_gradient: Sequence[torch.Tensor],
                decay: float = DEFAULT_DECAY) -> None:
    """e <- decay * e + g, in place, on the accumulator's device (``g`` is copied there if it is elsewhere, e.g. the
    averager's host buffers)."""
    for e, g in zip(accumulator, pseudo_gradient):
        e.mul_(decay).add_(g.to(e.device, non_blocking=e.device.type != "cpu"))


def send_(accumulator: Sequence[torch.Tensor], layout: Layout) -> Tuple[bytes, List[torch.Tensor]]:
    """This round's message from the accumulator, which keeps what the message did not carry."""
    message, carried = encode(accumulator, layout)
    for e, c in zip(accumulator, carried):
        e.sub_(c.to(e.device))
    return message, carried
