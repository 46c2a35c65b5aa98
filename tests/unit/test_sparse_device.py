"""The sparse codec's encode on the accumulator's own device (p2ptrain/averaging/sparse.py, "Devices") sends the
bytes, and leaves the accumulator bits, of the CPU encode it replaced: ``reference_encode`` below is that encode,
frozen as it was (chunks, top-k, median split, scales and codes in numpy on the CPU, then ``decode`` of its own
message). On the CPU always, the GPU's branches forced onto the CPU, and on CUDA where there is one."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.averaging import sparse
from p2ptrain.averaging.compression import WireFormatError
from p2ptrain.averaging.sparse import CHUNK, TILE, Layout, _pack, accumulate_, decode, encode, send_

SHAPES = ((128, 192), (100,), (5000,), (64, 64), (3,), (65, 64), (8193,))
KS = (1, 3, 64, 128, 1000, 2048, 4096)
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")


# ------------------------------------------------------------------------------------ the reference, frozen

def _reference_chunks(tensor: torch.Tensor, layout: Layout) -> torch.Tensor:
    shape = tuple(tensor.shape)
    if layout.tiled(shape):
        rows, cols = shape
        return tensor.reshape(rows // TILE, TILE, cols // TILE, TILE).permute(0, 2, 1, 3).reshape(-1, CHUNK).float()
    flat = tensor.reshape(-1).float()
    padded = torch.full((-(-flat.numel() // CHUNK) * CHUNK,), float("nan"))
    padded[:flat.numel()] = flat
    return padded.view(-1, CHUNK)


def reference_encode(tensors, layout: Layout):
    counts = np.asarray(layout.counts, dtype=np.int64)
    all_chunks = [_reference_chunks(t.detach(), layout) for t in tensors]
    chunks = torch.cat(all_chunks) if all_chunks else torch.empty(0, CHUNK)
    magnitude = chunks.abs().nan_to_num(nan=-1.0)
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64) if len(counts) else counts
    index = np.zeros(int(counts.sum()), dtype=np.int64)
    code = np.zeros(int(counts.sum()), dtype=np.uint8)
    scales = np.zeros((len(counts), 2), dtype=np.float32)
    for count in np.unique(counts):
        rows = np.flatnonzero(counts == count)
        if count == 0:
            continue
        rows_t = torch.from_numpy(rows)
        idx = torch.topk(magnitude[rows_t], int(count), dim=1, sorted=False).indices.sort(dim=1).values
        value = torch.gather(chunks[rows_t], 1, idx)
        mag = value.abs()
        high = mag > mag.median(dim=1, keepdim=True).values
        scales[rows, 0] = ((mag * ~high).sum(dim=1) / (~high).sum(dim=1)).numpy()
        scales[rows, 1] = ((mag * high).sum(dim=1) / high.sum(dim=1).clamp(min=1)).numpy()
        at = (offsets[rows][:, None] + np.arange(count)[None, :]).reshape(-1)
        index[at] = idx.numpy().reshape(-1)
        code[at] = (((value < 0).to(torch.uint8) << 1) | high.to(torch.uint8)).numpy().reshape(-1)
    scales = np.minimum(scales, np.float32(np.finfo(np.float16).max)).astype(np.float16)
    message = _pack(scales, index, code, layout)
    return message, decode(message, layout)


def reference_round_(accumulator, pseudo_gradient, layout: Layout, decay: float) -> bytes:
    for e, g in zip(accumulator, pseudo_gradient):
        e.mul_(decay).add_(g)
    message, carried = reference_encode(accumulator, layout)
    for e, c in zip(accumulator, carried):
        e.sub_(c)
    return message


# ------------------------------------------------------------------------------------------------- helpers

def inputs(kind: str, shapes=SHAPES, seed: int = 0):
    """Tensors of ``kind``: normal values, zeros (every chunk a tie at the cut), a few integers (ties everywhere)
    with some NaN and -0.0, or normal values in bf16."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape in shapes:
        if kind == "zeros":
            t = torch.zeros(shape)
        elif kind == "ties":
            t = torch.randint(-3, 4, shape, generator=gen).float()
            t.view(-1)[::97] = float("nan")
            t.view(-1)[1::89] = -0.0
        else:
            t = torch.randn(shape, generator=gen)
        out.append(t.bfloat16() if kind == "bf16" else t)
    return out


def bits(tensors):
    return [t.detach().cpu().float().contiguous().view(torch.int32) for t in tensors]


def assert_same(expected, got):
    (message, carried), (ref_message, ref_carried) = got, expected
    assert message == ref_message
    assert all(torch.equal(a, b) for a, b in zip(bits(carried), bits(ref_carried)))  # -0.0 and 0.0 apart


def check(ts, k: int, device: str = "cpu") -> None:
    """encode on ``device`` gives the reference's message and bits, or refuses what the reference refuses (a NaN
    kept: k = 4096 keeps every value)."""
    lay = layout_of(ts, k)
    try:
        expected = reference_encode(ts, lay)
    except WireFormatError:
        with pytest.raises(WireFormatError):
            encode([t.to(device) for t in ts], lay)
        return
    message, carried = encode([t.to(device) for t in ts], lay)
    assert all(c.device.type == device for c in carried)
    assert_same(expected, (message, carried))


def layout_of(tensors, k: int) -> Layout:
    return Layout(tuple(tuple(t.shape) for t in tensors), k=k)


@pytest.fixture
def gpu_branches(monkeypatch):
    """encode's off-CPU branches (ties chosen again by the CPU's topk, the scales' sums on the host), on the CPU."""
    monkeypatch.setattr(sparse, "_is_cpu", lambda device: False)


# ---------------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("kind", ["normal", "zeros", "ties", "bf16"])
def test_encode_sends_the_reference_bytes_and_bits_on_the_cpu(kind):
    for k in KS:
        check(inputs(kind), k)


@pytest.mark.parametrize("kind", ["normal", "zeros", "ties", "bf16"])
def test_the_gpu_branches_send_the_reference_bytes_and_bits(gpu_branches, kind):
    for k in KS:
        check(inputs(kind), k)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from([(64, 64), (1,), (7,), (100,), (4097,), (64, 128), (3, 5), (128, 64)]), min_size=1,
                max_size=5),
       st.sampled_from(KS), st.sampled_from(["normal", "zeros", "ties"]), st.integers(0, 2 ** 16), st.booleans())
def test_any_layout_encodes_as_the_reference(shapes, k, kind, seed, off_cpu):
    with pytest.MonkeyPatch.context() as patch:
        if off_cpu:
            patch.setattr(sparse, "_is_cpu", lambda device: False)
        check(inputs(kind, shapes, seed), k)


def test_a_device_topk_that_breaks_ties_its_own_way_is_overruled_by_the_cpus(monkeypatch):
    """A GPU's topk may keep other places among values tied at the cut: here one that keeps the lowest places. The
    rows with a tie at the cut are chosen again by the CPU's topk; the others keep the device's choice."""
    real_topk = torch.topk
    magnitude = torch.rand(4, CHUNK, generator=torch.Generator().manual_seed(0))
    magnitude[1] = 0.0  # all tied
    magnitude[2:] *= 0.4
    magnitude[2, ::2] = 0.5  # 2048 tied for 128 places
    magnitude[3, 1000:1100] += 1.0
    magnitude[3, 3000:3050] = 0.7  # 100 above the cut, 50 tied for the last 28 places
    expected = real_topk(magnitude, 128, dim=1, sorted=False).indices.sort(dim=1).values

    def lowest_first(values, count, dim, sorted):
        order = torch.sort(values, dim=dim, descending=True, stable=True)
        return torch.return_types.topk((order.values[:, :count], order.indices[:, :count]))

    calls = []

    def device_then_cpu(values, count, dim, sorted):
        calls.append(tuple(values.shape))
        return (lowest_first if len(calls) == 1 else real_topk)(values, count, dim=dim, sorted=sorted)

    monkeypatch.setattr(torch, "topk", device_then_cpu)
    chosen = sparse._top(magnitude, 128, recheck_ties=True)
    assert calls == [(4, CHUNK), (3, CHUNK)]  # the device's, then the CPU's on the three tied rows
    assert torch.equal(chosen, expected)
    assert not torch.equal(lowest_first(magnitude, 128, 1, False).indices.sort(dim=1).values, expected)


def test_send_and_accumulate_leave_the_reference_accumulator_bits(gpu_branches):
    shapes, lay = SHAPES, layout_of(inputs("normal"), 128)
    ours, ref = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
    for seed in range(4):
        g = inputs("normal" if seed % 2 else "ties", seed=seed)
        g = [t.nan_to_num() for t in g]
        accumulate_(ours, g, 0.95)
        message, _ = send_(ours, lay)
        assert message == reference_round_(ref, g, lay, 0.95)
        assert all(torch.equal(a, b) for a, b in zip(bits(ours), bits(ref)))


def test_an_infinite_accumulator_is_refused_as_before():
    ts = inputs("normal")
    ts[0][5, 7] = float("inf")
    for encoder in (reference_encode, encode):
        with pytest.raises(WireFormatError, match="scale that is not finite"):
            encoder(ts, layout_of(ts, 128))


@cuda
@pytest.mark.parametrize("kind", ["normal", "zeros", "ties", "bf16"])
def test_encode_on_cuda_sends_the_reference_bytes_and_bits(kind):
    for k in KS:
        check(inputs(kind), k, "cuda")


@cuda
def test_send_and_accumulate_on_cuda_leave_the_reference_accumulator_bits():
    shapes, lay = SHAPES, layout_of(inputs("normal"), 128)
    ours, ref = [torch.zeros(s, device="cuda") for s in shapes], [torch.zeros(s) for s in shapes]
    for seed in range(4):
        g = [t.nan_to_num() for t in inputs("normal" if seed % 2 else "ties", seed=seed)]
        accumulate_(ours, [t.pin_memory() for t in g], 0.95)  # the averager's host buffers, onto the device
        message, carried = send_(ours, lay)
        assert message == reference_round_(ref, g, lay, 0.95)
        assert all(e.is_cuda for e in ours) and all(c.is_cuda for c in carried)
        assert all(torch.equal(a, b) for a, b in zip(bits(ours), bits(ref)))
