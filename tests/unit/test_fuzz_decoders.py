"""Property tests (hypothesis) over every decoder of data that comes from other peers: wire codecs, DHT records,
state-transfer layouts and the protobuf messages. Each must accept what a sound peer sends (round trip) and turn
anything else into its documented clean rejection, without another exception, a hang or a large allocation."""

from __future__ import annotations

import math
import resource
import struct
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import DecodeError
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import ValueWithExpiration
from hivemind.utils.serializer import MSGPackSerializer

from p2ptrain.averaging.compression import (
    COMPRESSIONS,
    WIRE_TYPE,
    Int8Codec,
    WireFormatError,
    get_compression,
)
from p2ptrain.averaging.state_transfer import flatten_state, unflatten_state
from p2ptrain.data import ShardedBatches
from p2ptrain.diloco import _digest_of
from p2ptrain.diloco.state import check_downloaded_state
from p2ptrain.proto import p2ptrain_pb2
from p2ptrain.observe.telemetry import (MAX_BANNED, MAX_EVALS, MAX_LOSSES, MAX_RECORD_BYTES, MAX_ROUNDS,
                                        parse_telemetry)
from p2ptrain.proto.p2ptrain_pb2 import LossPoint, PeerProgress, PeerTelemetry, ShardCursor
from p2ptrain.swarm.progress import parse_progress
from p2ptrain.swarm.shards import cursor_state, parse_cursor

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

# no example database: a failure is reproduced from the example hypothesis prints (fresh random examples every run),
# not replayed from .hypothesis/. reap_children (autouse) checks for leftover processes once per test function, not
# per example, which is what these tests need. deadline=None: a slow CI runner must not turn into a flaky failure.
FUZZ = settings(database=None, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

NAMES = list(COMPRESSIONS)
BLOCK = Int8Codec.BLOCK
UINT32 = 2**32 - 1
UINT64 = 2**64 - 1
FP32_MAX = float(np.finfo(np.float32).max)
# what load_state_from_peers treats as "a malformed layout" (and _check_downloaded_state as malformed metadata)
LAYOUT_REJECTIONS = (KeyError, TypeError, ValueError)

PEER = PeerID.from_base58("QmSXUVsMGJFQBswMvF8D8Fmqy9QgjPzgfoqk3FUZv6ginu")
OTHER = PeerID.from_base58("QmTBBeeh2fDMz4PhTQGW9LthuufSNBV1ZigeB9TvTYXJW4")


def json_like(allow_infinity: bool = True) -> st.SearchStrategy:
    """Anything a DHT entry or a msgpack payload may hold (msgpack's integers are 64 bits)."""
    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**63), UINT64),
        st.floats(allow_nan=True, allow_infinity=allow_infinity), st.text(max_size=20), st.binary(max_size=40),
    )
    return st.recursive(
        scalars,
        lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
        max_leaves=12,
    )


objects = json_like()
dht_entries = st.one_of(
    objects,
    st.builds(ValueWithExpiration, value=st.binary(max_size=200), expiration_time=st.floats(allow_nan=True)),
    st.builds(ValueWithExpiration, value=objects, expiration_time=st.floats(allow_nan=True)),
)
doubles = st.floats(allow_nan=True, allow_infinity=True)


def entry(value: bytes) -> ValueWithExpiration:
    return ValueWithExpiration(value, 1e12)


# ------------------------------------------------------------------------------------------------ wire codecs

# values a sound peer sends through each codec, away from the ranges the codec does not claim a bound for: beyond
# fp16's max (clamped), and fp32 subnormals for bf16 and int8 (a block whose absmax / 127 is subnormal rounds its
# scale to a few bits)
MAGNITUDE_LIMITS = {"none": FP32_MAX, "fp16": 65504.0, "bf16": 2.0**126, "int8": 2.0**126}


def sound_values(name: str) -> st.SearchStrategy[float]:
    magnitude = st.floats(min_value=2.0**-100, max_value=MAGNITUDE_LIMITS[name], width=32)
    return st.one_of(st.just(0.0), magnitude, magnitude.map(lambda v: -v))


def error_bound(name: str, x: torch.Tensor) -> torch.Tensor:
    """The most each value may be off after a round trip through codec ``name`` (compression.py's table)."""
    if name == "none":
        return torch.zeros_like(x)
    if name == "fp16":
        return torch.maximum(x.abs() * 2.0**-11, torch.full_like(x, 2.0**-25))
    if name == "bf16":
        return x.abs() * 2.0**-8
    if name == "int8":
        blocks = torch.nn.functional.pad(x.reshape(-1), (0, -x.numel() % BLOCK)).view(-1, BLOCK)
        scales = (blocks.abs().amax(dim=1) / 127).repeat_interleave(BLOCK)[: x.numel()].view(x.shape)
        return scales / 2 + x.abs() * 2.0**-23
    raise ValueError(name)


@st.composite
def sound_tensors(draw, name: str) -> torch.Tensor:
    """A float32 tensor of a drawn shape (scalars, empty dimensions, several int8 blocks), filled by tiling a short
    drawn list of values: hypothesis picks the values that matter without drawing thousands of them."""
    shape = draw(st.lists(st.integers(0, 50), max_size=3))
    values = draw(st.lists(sound_values(name), min_size=1, max_size=40))
    numel = math.prod(shape)
    tiled = torch.tensor(values, dtype=torch.float32).repeat(-(-numel // len(values)))[:numel]
    return tiled.reshape(shape)


def message(codec, *, buffer: bytes, size, dtype=None, compression=None) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor(
        buffer=buffer, size=size, dtype=codec.dtype_tag if dtype is None else dtype,
        compression=codec.compression_type if compression is None else compression,
    )


def extract_or_reject(codec, msg: runtime_pb2.Tensor):
    """The decoded tensor, or None if the codec refused the message with its clean error (any other escapes)."""
    try:
        out = codec.extract(msg)
    except WireFormatError:
        return None
    assert out.dtype == torch.float32 and tuple(out.shape) == tuple(msg.size)
    assert codec.num_bytes(out.numel()) == len(msg.buffer)
    assert (msg.compression, msg.dtype) == (codec.compression_type, codec.dtype_tag)
    return out


@pytest.mark.parametrize("name", NAMES)
@settings(FUZZ, max_examples=60)
@given(data=st.data())
def test_codec_round_trip_stays_within_its_bound(name, data):
    codec = get_compression(name)
    x = data.draw(sound_tensors(name))
    msg = codec.compress(x)
    wire = runtime_pb2.Tensor.FromString(msg.SerializeToString())  # as the receiver gets it
    y = codec.extract(wire)
    assert y.dtype == torch.float32 and y.shape == x.shape
    if codec.lossless:
        assert torch.equal(y, x)
    err, bound = (y - x).abs(), error_bound(name, x)
    assert bool((err <= bound).all()), (name, x.shape, float((err - bound).max()))
    assert torch.equal(codec.roundtrip(x), y)


dtype_tags = st.one_of(
    st.sampled_from(["float32", "float16", "bfloat16", "int8", "", "p2ptrain.bf16.v1", "p2ptrain.int8.v1",
                     "p2ptrain.int8.v2", "p2ptrain.bf16.v0"]),
    st.text(max_size=24),
)
compression_types = st.one_of(
    st.sampled_from(list(runtime_pb2.CompressionType.values()) + [WIRE_TYPE]), st.integers(-(2**31), 2**31 - 1)
)
claimed_shapes = st.lists(st.one_of(st.integers(0, 9), st.integers(0, UINT32)), max_size=6)


@pytest.mark.parametrize("name", NAMES)
@settings(FUZZ, max_examples=150)
@given(buffer=st.binary(max_size=80), size=claimed_shapes, dtype=st.one_of(st.none(), dtype_tags),
       compression=st.one_of(st.none(), compression_types))
def test_extract_of_arbitrary_fields_decodes_or_raises_wire_format_error(name, buffer, size, dtype, compression):
    codec = get_compression(name)
    extract_or_reject(codec, message(codec, buffer=buffer, size=size, dtype=dtype, compression=compression))


@pytest.mark.parametrize("name", NAMES)
@settings(FUZZ, max_examples=60)
@given(size=st.lists(st.integers(2**16, UINT32), min_size=2, max_size=6), zero_at=st.none() | st.integers(0, 6),
       buffer=st.binary(max_size=64))
def test_a_huge_claimed_shape_is_refused_before_anything_is_allocated(name, size, zero_at, buffer):
    codec = get_compression(name)
    if zero_at is not None:  # an empty tensor with huge other dimensions: needs no bytes, allocates nothing
        size.insert(min(zero_at, len(size)), 0)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    msg = message(codec, buffer=buffer, size=size)
    if math.prod(size) == 0 and not buffer:
        out = extract_or_reject(codec, msg)
        assert out is None or out.numel() == 0
    else:
        with pytest.raises(WireFormatError, match="needs .* bytes"):  # the length check, not the decoder
            codec.extract(msg)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_kib < 64 * 1024


@st.composite
def well_framed(draw, codec) -> runtime_pb2.Tensor:
    """A message in the codec's format with exactly the bytes its shape needs, of random content: a drawn prefix
    (hypothesis controls the first scales and codes) over seeded random bytes."""
    shape = draw(st.lists(st.integers(0, 48), max_size=2))
    nbytes = codec.num_bytes(math.prod(shape))
    prefix = draw(st.binary(max_size=min(nbytes, 64)))
    rest = np.random.default_rng(draw(st.integers(0, 2**32))).bytes(nbytes - len(prefix))
    return message(codec, buffer=prefix + rest, size=shape)


def expected_values(name: str, buffer: bytes, numel: int):
    """What the format says the buffer holds (numpy, independently of the codec), or None where it must refuse."""
    if name == "none":
        return np.frombuffer(buffer, dtype="<f4").astype(np.float32)
    if name == "fp16":
        return np.frombuffer(buffer, dtype="<f2").astype(np.float32)
    if name == "bf16":
        return (np.frombuffer(buffer, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    if name == "int8":
        num_blocks = Int8Codec.num_blocks(numel)
        scales = np.frombuffer(buffer, dtype="<f4", count=num_blocks).astype(np.float32)
        codes = np.frombuffer(buffer, dtype=np.int8, offset=4 * num_blocks)
        if not (np.isfinite(scales).all() and (scales >= 0).all()) or (codes == -128).any():
            return None
        with np.errstate(over="ignore"):  # a scale above fp32's max / 127 is accepted and decodes to +-inf
            return codes.astype(np.float32) * np.repeat(scales, BLOCK)[:numel]
    raise ValueError(name)


@pytest.mark.parametrize("name", NAMES)
@settings(FUZZ, max_examples=100)
@given(data=st.data())
def test_a_well_framed_random_payload_decodes_exactly_or_is_refused(name, data):
    codec = get_compression(name)
    msg = data.draw(well_framed(codec))
    expected = expected_values(name, msg.buffer, math.prod(msg.size))
    out = extract_or_reject(codec, msg)
    if expected is None:
        assert out is None
    else:
        assert out is not None
        np.testing.assert_array_equal(out.numpy().reshape(-1), expected)


@pytest.mark.parametrize("name", NAMES)
@settings(FUZZ, max_examples=60)
@given(data=st.data(), cut=st.integers(1, 16), extra=st.binary(min_size=1, max_size=16), extend=st.booleans())
def test_a_truncated_or_extended_buffer_is_refused(name, data, cut, extra, extend):
    codec = get_compression(name)
    msg = codec.compress(data.draw(sound_tensors(name)))
    if extend:
        msg.buffer = msg.buffer + extra
    elif len(msg.buffer) == 0:
        return
    else:
        msg.buffer = msg.buffer[: max(0, len(msg.buffer) - cut)]
    with pytest.raises(WireFormatError):
        codec.extract(msg)


@settings(FUZZ, max_examples=100)
@given(numel=st.integers(1, 3 * BLOCK), block=st.integers(0, 2),
       scale=st.floats(width=32).filter(lambda s: not (s >= 0 and s < math.inf)))
@example(numel=5, block=0, scale=float("nan"))
@example(numel=5, block=0, scale=float("inf"))
@example(numel=5, block=0, scale=-1.0)
def test_int8_refuses_a_nan_infinite_or_negative_scale(numel, block, scale):
    codec = get_compression("int8")
    msg = codec.compress(torch.linspace(-1, 1, numel))
    block = min(block, Int8Codec.num_blocks(numel) - 1)
    buffer = bytearray(msg.buffer)
    buffer[4 * block: 4 * block + 4] = struct.pack("<f", scale)
    msg.buffer = bytes(buffer)
    with pytest.raises(WireFormatError, match="scale"):
        codec.extract(msg)


@settings(FUZZ, max_examples=60)
@given(numel=st.integers(1, 3 * BLOCK), at=st.integers(0, 3 * BLOCK))
def test_int8_refuses_the_code_minus_128(numel, at):
    codec = get_compression("int8")
    msg = codec.compress(torch.linspace(-1, 1, numel))
    buffer = bytearray(msg.buffer)
    buffer[4 * Int8Codec.num_blocks(numel) + at % numel] = 0x80
    msg.buffer = bytes(buffer)
    with pytest.raises(WireFormatError, match="-128"):
        codec.extract(msg)


@st.composite
def mangled(draw, serialized: bytes) -> bytes:
    """``serialized`` cut short, with bytes inserted, or with bytes overwritten."""
    at = draw(st.integers(0, len(serialized)))
    how = draw(st.sampled_from(["truncate", "insert", "overwrite"]))
    if how == "truncate":
        return serialized[:at]
    patch = draw(st.binary(min_size=1, max_size=12))
    if how == "insert":
        return serialized[:at] + patch + serialized[at:]
    return serialized[:at] + patch + serialized[at + len(patch):]


@pytest.mark.parametrize("name", NAMES)
@settings(FUZZ, max_examples=100)
@given(data=st.data())
def test_a_mangled_serialized_message_fails_to_parse_or_is_refused(name, data):
    codec = get_compression(name)
    serialized = codec.compress(data.draw(sound_tensors(name))).SerializeToString()
    raw = data.draw(st.one_of(mangled(serialized), st.binary(max_size=200)))
    try:
        msg = runtime_pb2.Tensor.FromString(raw)
    except DecodeError:
        return
    extract_or_reject(codec, msg)


# ----------------------------------------------------------------------------------------- telemetry records

@settings(FUZZ, max_examples=200)
@given(data=st.data(), subkey_peer=st.sampled_from([PEER.to_base58(), OTHER.to_base58(), None]),
       raw=st.one_of(st.none(), st.binary(max_size=300)), extra_losses=st.integers(0, 3))
def test_parse_telemetry_accepts_exactly_the_sound_records(data, subkey_peer, raw, extra_losses):
    """A dashboard reads other peers' telemetry records: a record is accepted only if it parses, names the peer whose
    subkey it is under and the run, and keeps to the window's limits; anything else is None, never an exception."""
    if raw is None:
        fields = data.draw(fields_of(PeerTelemetry))
        fields["run_id"] = data.draw(st.sampled_from(["r", "other"]))
        fields["peer_id"] = data.draw(st.sampled_from([PEER.to_base58(), OTHER.to_base58()]))
        record = PeerTelemetry(**fields)
        record.losses.extend([LossPoint(local_step=i) for i in range(MAX_LOSSES * (extra_losses == 3))])
        raw = record.SerializeToString()
    try:
        decoded = PeerTelemetry.FromString(raw)
    except DecodeError:
        decoded = None
    parsed = parse_telemetry(raw, "r", subkey_peer)
    sound = (decoded is not None and decoded.peer_id == subkey_peer and decoded.run_id == "r"
             and len(decoded.losses) <= MAX_LOSSES and len(decoded.evals) <= MAX_EVALS
             and len(decoded.rounds) <= MAX_ROUNDS and len(decoded.banned) <= MAX_BANNED)
    assert (parsed is not None) == sound
    assert parse_telemetry(b"\n" + b"\x00" * MAX_RECORD_BYTES, "r", subkey_peer) is None  # too large to read


# ----------------------------------------------------------------------------------------- progress records

@settings(FUZZ, max_examples=300)
@given(subkey=st.one_of(st.sampled_from([PEER.to_bytes(), OTHER.to_bytes()]), objects), entry=dht_entries,
       run_id=st.text(max_size=10))
def test_parse_progress_of_any_entry_returns_a_record_or_none(subkey, entry, run_id):
    record = parse_progress(subkey, entry, run_id)
    assert record is None or isinstance(record, PeerProgress)


@settings(FUZZ, max_examples=300)
@given(
    subkey=st.sampled_from([PEER, OTHER]),
    fields=st.fixed_dictionaries(
        {  # each field sound or not about half the time, so that every single unsound field comes up often
            "run_id": st.just("r") | st.text(max_size=8),
            "peer_id": st.just(PEER.to_base58()) | st.sampled_from([OTHER.to_base58(), ""]) | st.text(max_size=50),
            "samples_per_s": st.floats(min_value=0, allow_infinity=False) | doubles,
            "timestamp": st.floats(allow_nan=False, allow_infinity=False) | doubles,
        },
        optional={
            "outer_step": st.integers(0, UINT64), "local_step": st.integers(0, UINT64),
            "samples_since_sync": st.integers(0, UINT64), "client_mode": st.booleans(),
            "shard_index": st.integers(0, UINT32),
        },
    ),
)
def test_parse_progress_accepts_exactly_the_sound_records(subkey, fields):
    record = PeerProgress(**fields)
    parsed = parse_progress(subkey.to_bytes(), entry(record.SerializeToString()), "r")
    sound = (
        record.peer_id == subkey.to_base58() and record.run_id == "r"
        and math.isfinite(record.samples_per_s) and record.samples_per_s >= 0 and math.isfinite(record.timestamp)
    )
    if sound:
        assert parsed is not None
        assert parsed.SerializeToString(deterministic=True) == record.SerializeToString(deterministic=True)
    else:
        assert parsed is None


# -------------------------------------------------------------------------------------------- shard cursors

DATA = bytes(range(256)) * 64


def batches() -> ShardedBatches:
    return ShardedBatches(DATA, block_size=16, batch_size=4, shard_index=1, num_shards=2, seed=0)


@settings(FUZZ, max_examples=300)
@given(entry=dht_entries, run_id=st.text(max_size=10), shard_index=st.integers())
def test_parse_cursor_of_any_entry_returns_a_cursor_or_none(entry, run_id, shard_index):
    cursor = parse_cursor(entry, run_id, shard_index)
    assert cursor is None or isinstance(cursor, ShardCursor)


def this_or_any(value: int, bits: int) -> st.SearchStrategy[int]:
    return st.one_of(st.just(value), st.integers(0, 2**bits - 1))


@settings(FUZZ, max_examples=200)
@given(
    run_id=st.sampled_from(["r", "x"]),
    shard_index=this_or_any(1, 32), num_shards=this_or_any(2, 32), seed=this_or_any(0, 64),
    block_size=this_or_any(16, 32), samples_per_epoch=this_or_any(batches().samples_per_epoch, 64),
    epoch=st.one_of(st.integers(0, 5), st.integers(0, UINT64)),
    position=st.one_of(st.integers(0, 600), st.integers(0, UINT64)),
    outer_step=st.integers(0, UINT64), peer_id=st.text(max_size=50), timestamp=doubles,
)
def test_a_cursor_from_the_dht_resumes_the_iterator_or_is_refused(**fields):
    sent = ShardCursor(**fields)
    cursor = parse_cursor(entry(sent.SerializeToString()), "r", 1)
    if sent.run_id != "r" or sent.shard_index != 1:
        assert cursor is None
        return
    assert cursor is not None
    it = batches()
    try:
        it.load_state_dict(cursor_state(cursor))  # the peer refuses a cursor of another layout with a ValueError
    except ValueError:
        return
    assert (it.epoch, it.position) == (sent.epoch, sent.position)
    x, y = next(it)
    assert x.shape == y.shape == (4, 16)


# ------------------------------------------------------------------------------------------- state transfer

@settings(FUZZ, max_examples=100)
@given(shapes=st.lists(st.lists(st.integers(0, 6), max_size=3), max_size=6), seed=st.integers(0, 2**32))
def test_unflatten_state_round_trips_flattened_tensors(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(shape, generator=gen) for shape in shapes]
    out = unflatten_state(flatten_state(tensors), MSGPackSerializer.loads(MSGPackSerializer.dumps(shapes)))
    assert len(out) == len(tensors) and all(torch.equal(a, b) for a, b in zip(out, tensors))


def unflatten_or_reject(numel: int, shapes) -> None:
    try:
        out = unflatten_state(torch.zeros(numel), shapes)
    except LAYOUT_REJECTIONS:
        return
    assert sum(t.numel() for t in out) == numel
    assert [t.numel() for t in out] == [int(np.prod(shape)) for shape in shapes]


# dimensions a sane peer never sends but that stay inside int64 when multiplied (3 dims of at most 2**20)
odd_dims = st.one_of(st.integers(0, 8), st.integers(0, 2**20), st.none(), st.booleans(),
                     st.floats(allow_nan=True, allow_infinity=False), st.text(max_size=4), st.binary(max_size=4),
                     st.lists(st.integers(0, 4), max_size=2))


@settings(FUZZ, max_examples=300)
@given(numel=st.integers(0, 64),
       shapes=st.one_of(st.lists(st.one_of(st.lists(odd_dims, max_size=3), odd_dims), max_size=5),
                        json_like(allow_infinity=False)))
def test_unflatten_state_of_a_wrong_layout_is_refused_cleanly(numel, shapes):
    unflatten_or_reject(numel, shapes)


@settings(FUZZ, max_examples=100, report_multiple_bugs=False)
@given(numel=st.integers(0, 8),
       shapes=st.lists(st.lists(st.integers(-(2**40), 2**40) | st.integers(-2, 2) | st.floats(), max_size=3),
                       max_size=4))
@example(numel=1, shapes=[[-1, -1]])
@example(numel=1, shapes=[[2], [-1]])
@example(numel=0, shapes=[[2**32, 2**32]])
@example(numel=1, shapes=[[float("inf")]])
def test_unflatten_state_of_hostile_dimensions_is_refused_cleanly(numel, shapes):
    unflatten_or_reject(numel, shapes)


@settings(FUZZ, max_examples=300)
@given(raw=st.one_of(st.binary(max_size=300), objects.map(MSGPackSerializer.dumps).flatmap(mangled)))
def test_state_metadata_of_random_bytes_decodes_or_raises(raw):
    try:
        MSGPackSerializer.loads(raw)
    except Exception:  # noqa: BLE001 - _download_state turns any Exception into "no state": its clean rejection
        return


class Host(SimpleNamespace):
    """What ``check_downloaded_state`` reads of its host (a ``PeerState``): a 2-parameter model, 1 group."""


HOST = Host(global_params=[torch.zeros(3), torch.zeros(2, 2)], params=[torch.zeros(3), torch.zeros(2, 2)],
            param_groups=[{"lr": 0.1}])


def check(metadata, tensors) -> str:
    return check_downloaded_state(HOST, metadata, tensors)


@st.composite
def downloaded_states(draw, counters: st.SearchStrategy):
    """(metadata, tensors) as a donor may send them: mostly the layout HOST expects, with any field replaced."""
    has_momentum = draw(st.booleans())
    inner_names = draw(st.lists(st.lists(st.sampled_from(["exp_avg", "exp_avg_sq"]), max_size=2, unique=True),
                                min_size=2, max_size=2))
    shapes = [[3], [2, 2]] * (2 if has_momentum else 1)
    shapes += [shape for names, shape in zip(inner_names, ([3], [2, 2])) for _ in names]
    value = st.one_of(st.floats(-10, 10), st.just(float("nan")), st.just(float("inf")))
    tensors = [torch.tensor(draw(st.lists(value, min_size=math.prod(s), max_size=math.prod(s))),
                            dtype=torch.float32).view(s) for s in shapes]
    if draw(st.booleans()):  # a layout of another model
        tensors = [torch.zeros(s) for s in draw(st.lists(st.lists(st.integers(0, 4), max_size=2), max_size=8))]
    metadata = {
        "outer_step": draw(counters), "local_step": draw(counters), "in_round": draw(st.booleans()),
        "digest": _digest_of(tensors[:2]) if draw(st.booleans()) else draw(st.text(max_size=32)),
        "has_momentum": has_momentum,
        "inner": [{"tensors": names, "scalars": {"step": 3.0}} for names in inner_names],
        "lrs": [0.1], "shapes": [list(t.shape) for t in tensors],
    }
    for key in draw(st.lists(st.sampled_from(sorted(metadata)), max_size=3)):
        if draw(st.booleans()):
            metadata.pop(key, None)
        else:
            metadata[key] = draw(objects)
    if draw(st.integers(0, 9)) == 0:
        metadata = draw(objects)
    return metadata, tensors


finite_counters = st.one_of(st.integers(-3, UINT64), st.floats(allow_nan=True, allow_infinity=False),
                            st.text(max_size=5))


@settings(FUZZ, max_examples=300)
@given(state=downloaded_states(finite_counters))
def test_check_downloaded_state_names_a_problem_or_accepts(state):
    metadata, tensors = state
    metadata = MSGPackSerializer.loads(MSGPackSerializer.dumps(metadata))  # as the newcomer gets it
    problem = check(metadata, tensors)
    assert isinstance(problem, str)
    if not problem:  # accepted: then it is sound
        assert [t.shape for t in tensors[:2]] == [p.shape for p in HOST.global_params]
        assert all(bool(torch.isfinite(t).all()) for t in tensors)
        assert int(metadata["outer_step"]) >= 0 and int(metadata["local_step"]) >= 0
        assert metadata["digest"] == _digest_of(tensors[:2])


@settings(FUZZ, max_examples=100)
@given(seed=st.integers(0, 2**32), has_momentum=st.booleans(), outer_step=st.integers(0, UINT64),
       local_step=st.integers(0, UINT64))
def test_check_downloaded_state_accepts_a_sound_state(seed, has_momentum, outer_step, local_step):
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(p.shape, generator=gen) for p in HOST.global_params * (2 if has_momentum else 1)]
    tensors += [torch.randn(3, generator=gen)]
    metadata = {
        "outer_step": outer_step, "local_step": local_step, "in_round": False, "digest": _digest_of(tensors[:2]),
        "has_momentum": has_momentum, "inner": [{"tensors": ["exp_avg"], "scalars": {"step": 3.0}},
                                                {"tensors": [], "scalars": {}}],
        "lrs": [0.1], "shapes": [list(t.shape) for t in tensors],
    }
    metadata = MSGPackSerializer.loads(MSGPackSerializer.dumps(metadata))
    assert check(metadata, unflatten_state(flatten_state(tensors), metadata["shapes"])) == ""


@settings(FUZZ, max_examples=50, report_multiple_bugs=False)
@given(state=downloaded_states(st.floats(allow_nan=True, allow_infinity=True)))
@example(state=({"outer_step": float("inf"), "local_step": 0, "digest": _digest_of(HOST.params), "has_momentum": False,
                 "inner": [{"tensors": []}, {"tensors": []}], "lrs": [0.1]}, [torch.zeros(3), torch.zeros(2, 2)]))
def test_check_downloaded_state_refuses_infinite_step_counters_cleanly(state):
    metadata, tensors = state
    assert isinstance(check(metadata, tensors), str)


# ------------------------------------------------------------------------------------------ protobuf messages

MESSAGES = [getattr(p2ptrain_pb2, name) for name in p2ptrain_pb2.DESCRIPTOR.message_types_by_name]
SCALAR_FIELDS = {
    FieldDescriptor.TYPE_STRING: st.text(max_size=30),
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=60),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_DOUBLE: doubles,
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32, allow_nan=True),
    FieldDescriptor.TYPE_UINT64: st.integers(0, UINT64),
    FieldDescriptor.TYPE_UINT32: st.integers(0, UINT32),
    FieldDescriptor.TYPE_INT64: st.integers(-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_INT32: st.integers(-(2**31), 2**31 - 1),
}


def fields_of(message_type) -> st.SearchStrategy[dict]:
    """Any subset of the message's fields, each with any value of its type, a nested message's fields drawn the same
    way (a new field type fails here)."""
    optional = {}
    for field in message_type.DESCRIPTOR.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            nested = getattr(p2ptrain_pb2, field.message_type.name)
            value = fields_of(nested).map(lambda kwargs, nested=nested: nested(**kwargs))
        else:
            value = SCALAR_FIELDS[field.type]
        optional[field.name] = st.lists(value, max_size=4) if field.is_repeated else value
    return st.fixed_dictionaries({}, optional=optional)


@pytest.mark.parametrize("message_type", MESSAGES, ids=lambda m: m.DESCRIPTOR.name)
@settings(FUZZ, max_examples=150)
@given(raw=st.binary(max_size=200))
def test_every_message_type_parses_random_bytes_or_raises_decode_error(message_type, raw):
    try:
        msg = message_type.FromString(raw)
    except DecodeError:
        return
    again = message_type.FromString(msg.SerializeToString())
    assert again.SerializeToString(deterministic=True) == msg.SerializeToString(deterministic=True)


@pytest.mark.parametrize("message_type", MESSAGES, ids=lambda m: m.DESCRIPTOR.name)
@settings(FUZZ, max_examples=100)
@given(data=st.data())
def test_every_message_type_round_trips_and_survives_mangling(message_type, data):
    msg = message_type(**data.draw(fields_of(message_type)))
    serialized = msg.SerializeToString(deterministic=True)
    assert message_type.FromString(serialized).SerializeToString(deterministic=True) == serialized
    try:
        message_type.FromString(data.draw(mangled(serialized)))
    except DecodeError:
        pass
