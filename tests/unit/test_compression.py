"""Wire codecs for pseudo-gradients: error bounds, payload sizes, malformed messages, error feedback."""

from __future__ import annotations

import math

import pytest
import torch
from hivemind.averaging.partition import TensorPartContainer
from hivemind.compression import deserialize_torch_tensor
from hivemind.proto import runtime_pb2

from p2ptrain.averaging.compression import (
    COMPRESSIONS,
    WIRE_TYPE,
    Int8Codec,
    WireFormatError,
    get_compression,
    wire_parts,
    wire_residual_,
)

NAMES = list(COMPRESSIONS)
BLOCK = Int8Codec.BLOCK
SIZES = [1, 7, BLOCK, BLOCK + 1, 3 * BLOCK + 5, 20_000]


def sample(kind: str, size: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    normal = torch.randn(size, generator=gen)
    if kind == "normal":
        return normal
    if kind == "zeros":
        return torch.zeros(size)
    if kind == "large":  # 1e4: well inside fp16's range (65504)
        return normal.clamp(-5, 5) * 1e4
    if kind == "tiny":  # 1e-8: below fp16's smallest normal (6e-5), inside bf16's and int8's scales
        return normal * 1e-8
    if kind == "mixed":  # magnitudes from 1e-6 to 1e3 side by side, in the same int8 blocks
        return normal * torch.logspace(-6, 3, size)[torch.randperm(size, generator=gen)]
    raise ValueError(kind)


KINDS = ["normal", "zeros", "large", "tiny", "mixed"]


def error_bound(name: str, x: torch.Tensor) -> torch.Tensor:
    """The most each value may be off after a round trip through codec ``name``."""
    if name == "none":
        return torch.zeros_like(x)
    if name == "fp16":  # half an ulp: 2**-11 relative for normals, 2**-25 absolute in fp16's subnormal range
        return torch.maximum(x.abs() * 2.0**-11, torch.full_like(x, 2.0**-25))
    if name == "bf16":  # half an ulp of an 8-bit significand, fp32's exponent range
        return x.abs() * 2.0**-8
    if name == "int8":  # half the block's step (absmax / 127), plus fp32 rounding of code * scale
        blocks = torch.nn.functional.pad(x, (0, -x.numel() % BLOCK)).view(-1, BLOCK)
        scales = (blocks.abs().amax(dim=1) / 127).repeat_interleave(BLOCK)[: x.numel()]
        return scales / 2 + x.abs() * 2.0**-23
    raise ValueError(name)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_within_the_codecs_bound(name, kind):
    codec = get_compression(name)
    for size in SIZES:
        x = sample(kind, size, seed=size)
        msg = codec.compress(x)
        y = codec.extract(msg)
        assert y.dtype == torch.float32 and y.shape == x.shape
        err = (y - x).abs()
        bound = error_bound(name, x)
        worst = int((err - bound).argmax())
        assert (err <= bound).all(), (name, kind, size, float(x[worst]), float(err[worst]), float(bound[worst]))
        if kind == "zeros":
            assert torch.equal(y, x)
        assert torch.equal(codec.roundtrip(x), y)


def test_int8_bound_is_tight_and_blocks_are_independent():
    """One huge value coarsens only its own block; the error per value stays below half its block's step."""
    x = sample("normal", 4 * BLOCK, seed=1) * 1e-3
    x[5] = 100.0  # block 0 only
    y = get_compression("int8").roundtrip(x)
    step0 = 100.0 / 127
    assert (y[:BLOCK] - x[:BLOCK]).abs().max() <= step0 / 2
    # the other blocks keep their fine steps: error relative to their own absmax
    for b in range(1, 4):
        block = x[b * BLOCK:(b + 1) * BLOCK]
        assert (y[b * BLOCK:(b + 1) * BLOCK] - block).abs().max() <= block.abs().max() / 254 * (1 + 1e-6)
    # the block's absmax itself comes back exactly (code 127 * scale)
    assert math.isclose(float(y[5]), 100.0, rel_tol=1e-6)


@pytest.mark.parametrize(
    "name, bytes_per_value", [("none", 4.0), ("fp16", 2.0), ("bf16", 2.0), ("int8", 1.0 + 4 / BLOCK)]
)
def test_payload_bytes_per_value(name, bytes_per_value):
    n = 2**16
    msg = get_compression(name).compress(sample("normal", n))
    assert len(msg.buffer) == pytest.approx(bytes_per_value * n, abs=0)
    # the whole message (shape, dtype tag, field headers) adds a few dozen bytes, not a per-value cost
    assert msg.ByteSize() / n == pytest.approx(bytes_per_value, rel=1e-3)
    assert runtime_pb2.Tensor.FromString(msg.SerializeToString()) == msg


def test_none_and_fp16_are_hivemind_messages_byte_for_byte():
    """Peers of earlier p2ptrain versions (hivemind's own codecs) read and write the same "none"/"fp16" parts."""
    from hivemind.compression import serialize_torch_tensor

    x = sample("mixed", 5000)
    for name, ctype in [("none", runtime_pb2.CompressionType.NONE), ("fp16", runtime_pb2.CompressionType.FLOAT16)]:
        codec = get_compression(name)
        theirs = serialize_torch_tensor(x, ctype)
        assert codec.compress(x) == theirs
        assert torch.equal(codec.extract(theirs), deserialize_torch_tensor(theirs))


@pytest.mark.parametrize("name", ["bf16", "int8"])
def test_own_formats_are_refused_by_hivemind_not_misread(name):
    msg = get_compression(name).compress(sample("normal", 100))
    assert msg.compression == WIRE_TYPE and msg.dtype.startswith("p2ptrain.")
    with pytest.raises(ValueError):
        deserialize_torch_tensor(msg)


def _mutations(name: str, msg: runtime_pb2.Tensor):
    """(what is wrong, a malformed copy of msg)."""

    def changed(**fields):
        bad = runtime_pb2.Tensor()
        bad.CopyFrom(msg)
        for key, value in fields.items():
            if key == "size":
                del bad.size[:]
                bad.size.extend(value)
            else:
                setattr(bad, key, value)
        return bad

    n = math.prod(msg.size)
    yield "truncated", changed(buffer=msg.buffer[:-1])
    yield "half the buffer", changed(buffer=msg.buffer[: len(msg.buffer) // 2])
    yield "one byte too many", changed(buffer=msg.buffer + b"\0")
    yield "empty buffer", changed(buffer=b"")
    yield "more values than the buffer has", changed(size=[n + 1])
    yield "fewer values than the buffer has", changed(size=[n - 1])
    yield "a huge shape", changed(size=[2**31, 2**31])
    yield "no shape", changed(size=[])
    yield "unknown dtype", changed(dtype="p2ptrain.int3.v1")
    yield "numpy object dtype", changed(dtype="object")
    yield "float64 dtype", changed(dtype="float64")
    yield "no dtype", changed(dtype="")
    yield "unknown compression", changed(compression=77)
    for other in NAMES:
        if other != name:
            yield f"a {other} message", get_compression(other).compress(torch.ones(n))
    if name == "int8":
        nb = Int8Codec.num_blocks(n)
        scales = torch.frombuffer(bytearray(msg.buffer[: 4 * nb]), dtype=torch.float32)
        for what, value in [("NaN", float("nan")), ("infinite", float("inf")), ("negative", -1.0)]:
            bad_scales = scales.clone()
            bad_scales[1] = value
            yield f"{what} scale", changed(buffer=bad_scales.numpy().tobytes() + msg.buffer[4 * nb:])
        codes = bytearray(msg.buffer[4 * nb:])
        codes[3] = 0x80  # -128
        yield "code -128", changed(buffer=msg.buffer[: 4 * nb] + bytes(codes))


@pytest.mark.parametrize("name", NAMES)
def test_malformed_messages_raise_a_clean_error(name):
    codec = get_compression(name)
    msg = codec.compress(sample("normal", 3 * BLOCK + 5))
    cases = list(_mutations(name, msg))
    assert len(cases) >= 14
    for what, bad in cases:
        with pytest.raises(WireFormatError):
            codec.extract(bad)
            pytest.fail(f"{name}: {what} was accepted")
    assert issubclass(WireFormatError, ValueError)
    codec.extract(msg)  # the original is still fine


def test_garbage_bytes_never_crash_the_decoder():
    """Random messages: each either decodes to the announced shape or raises WireFormatError."""
    gen = torch.Generator().manual_seed(3)
    for name in NAMES:
        codec = get_compression(name)
        for trial in range(200):
            n = int(torch.randint(0, 300, (1,), generator=gen))
            size = [n] if trial % 3 else [n, 2]
            buffer = bytes(torch.randint(0, 256, (codec.num_bytes(math.prod(size)) + trial % 2,), generator=gen,
                                         dtype=torch.uint8).tolist())
            msg = runtime_pb2.Tensor(compression=codec.compression_type, dtype=codec.dtype_tag, size=size,
                                     buffer=buffer)
            try:
                out = codec.extract(msg)
            except WireFormatError:
                continue
            assert out.shape == tuple(size) and out.dtype == torch.float32


def test_compressing_non_finite_values_is_refused_for_int8():
    x = torch.ones(10)
    x[3] = float("nan")
    with pytest.raises(ValueError):
        get_compression("int8").compress(x)


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="use one of: none, fp16, bf16, int8"):
        get_compression("int3")


@pytest.mark.parametrize("name", ["int8", "bf16", "fp16"])
def test_error_feedback_transmits_the_sum(name):
    """A value the codec cannot represent: without feedback the same rounding error adds up every step; with
    feedback the sum of what was sent stays within one rounding step of the sum of what was meant."""
    codec = get_compression(name)
    steps = 2000
    if name == "int8":
        # next to a 1.0 in its block, the step is 1/127 and 1e-3 rounds to 0 every time
        x = torch.full((BLOCK + 10,), 1e-3)
        x[0] = 1.0
        step = torch.full_like(x, 1.0 / 127)
        step[BLOCK:] = 1e-3 / 127
    else:
        # 1 + a quarter of an ulp rounds down to 1 every time
        ulp = 2.0**-10 if name == "fp16" else 2.0**-7
        x = torch.full((100,), 1.0 + ulp / 4)
        step = torch.full_like(x, ulp)

    true_sum = x.double() * steps
    plain_sum = torch.zeros_like(x, dtype=torch.float64)
    fed_sum = torch.zeros_like(x, dtype=torch.float64)
    residual = [torch.zeros_like(x)]
    for _ in range(steps):
        plain_sum += codec.roundtrip(x).double()
        sent = x + residual[0]
        wire_residual_(residual, [sent], codec, part_size_bytes=2**19)
        fed_sum += codec.roundtrip(sent).double()
        assert torch.equal(sent - codec.roundtrip(sent), residual[0])

    assert ((fed_sum - true_sum).abs() <= step.double()).all()
    # without feedback, the small values are off by far more than one step
    assert ((plain_sum - true_sum).abs() > 100 * step.double()).any()
    assert (plain_sum - true_sum).abs().max() > 0.4


@pytest.mark.parametrize("name", NAMES)
def test_residual_is_exactly_what_the_wire_drops(name):
    """``wire_residual_`` cuts and rounds like hivemind's TensorPartContainer does, part by part."""
    codec = get_compression(name)
    tensors = [sample("mixed", 5000, seed=1).reshape(50, 100), sample("normal", 3, seed=2),
               sample("large", 4 * BLOCK + 7, seed=3)]
    part_size_bytes = 1500  # many parts, not a whole number of int8 blocks
    container = TensorPartContainer(tensors, peer_fractions=(0.3, 0.7), compression=codec,
                                    part_size_bytes=part_size_bytes)
    received = []
    for peer_parts in container._input_parts_by_peer:  # what iterate_input_parts_for compresses and sends
        received += [codec.extract(codec.compress(part, info)) for part, info in peer_parts]
    assert len(received) == sum(container.num_parts_by_tensor) > len(tensors)
    on_the_wire = torch.cat([r.view(-1) for r in received])

    residuals = [torch.full_like(t, float("nan")) for t in tensors]
    wire_residual_(residuals, tensors, codec, part_size_bytes)
    flat_sent = torch.cat([t.view(-1) for t in tensors])
    assert torch.equal(torch.cat([r.view(-1) for r in residuals]), flat_sent - on_the_wire)
    assert [len(wire_parts(t, codec, part_size_bytes)) for t in tensors] == container.num_parts_by_tensor
    if name == "none":
        assert all(not r.any() for r in residuals)
    else:
        assert any(r.any() for r in residuals)
