"""Wire formats (codecs) for pseudo-gradients. Accumulation is always fp32; only what crosses the network is rounded.

=======  =====================  ==========================================================================
name     bytes per value        rounding
=======  =====================  ==========================================================================
none     4                      none (fp32)
fp16     2                      to the nearest fp16 (relative error <= 2**-11), clamped to +-65504
bf16     2                      to the nearest bf16 (relative error <= 2**-8), fp32's range
int8     1 + 4/1024             symmetric, per block of 1024 values: scale = absmax / 127 (fp32),
                                code = round(x / scale) in [-127, 127]; error <= scale / 2 per value
=======  =====================  ==========================================================================

How they cross the wire. An all-reduce part travels as a hivemind ``runtime_pb2.Tensor`` message (buffer, size,
dtype, compression). "none" and "fp16" are hivemind's own formats, byte for byte (``CompressionType.NONE`` and
``FLOAT16``), so they stay compatible with peers of earlier p2ptrain versions. "bf16" and "int8" have no slot in
hivemind's ``CompressionType`` enum (its 16-bit format converts bf16 to fp32 unless ``USE_LEGACY_BFLOAT16=0`` is set
before import, and ``BLOCKWISE_8BIT`` needs bitsandbytes), and reusing a slot of another format would let a peer
misread the payload. So their messages say ``compression = WIRE_TYPE`` (100, outside hivemind's enum: hivemind's
own ``deserialize_torch_tensor`` refuses such a message with a ValueError instead of misreading it) and carry the
exact format and version in ``dtype``, e.g. ``"p2ptrain.int8.v1"``. hivemind's registry of codecs is keyed by the
enum name, so they cannot be registered there; instead ``ExactAllReduceRunner`` encodes and decodes every part
itself, with the group's codec (``WireCodec.compress`` / ``WireCodec.extract``), in both directions.

Every ``WireCodec.extract`` checks a peer's message before it allocates anything: the format (``compression`` and
``dtype``) must be this codec's, the buffer must have exactly the bytes the shape needs, int8 scales must be finite
and non-negative and codes in [-127, 127]. Anything else raises ``WireFormatError`` (a ValueError); the reducer then
bans that sender for the round, a sender treats that reducer as failed. Peers with different codecs never meet in a
group anyway (the compression name is part of the averager's schema hash), so this is about broken or hostile peers.

Decoding is deterministic (bf16 -> fp32 is exact; int8 decodes as one fp32 multiply, code * scale), so the same
message gives the same bits on every peer: the exact all-reduce stays exact with every codec.

Error feedback (``DiLoCoOptions(error_feedback=...)``, the optimizer's ``options``, on by default for int8 only): a peer keeps what the wire
dropped from its own pseudo-gradient, ``residual = sent - decompress(compress(sent))`` computed part by part exactly
as the wire cuts and rounds it (``wire_residual_``), and adds it to its next pseudo-gradient, so that over many
rounds what it transmits sums to what it meant to send.
"""

from __future__ import annotations

import math
import sys
import warnings
from typing import ClassVar, Dict, List, Optional, Sequence, Type, Union

import numpy as np
import torch
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression, NoCompression
from hivemind.proto import runtime_pb2

from p2ptrain.averaging.wire_part import Buffer, WireTensor

WIRE_TYPE = 100
"""``runtime_pb2.Tensor.compression`` of p2ptrain's own formats: no value of hivemind's ``CompressionType`` enum
(proto3 enums are open, so the field carries it as is)."""


NATIVE_LITTLE_ENDIAN = sys.byteorder == "little"
"""Wire buffers are little-endian; on such a host (every x86 and ARM one) a buffer is read as a tensor in place"""

with warnings.catch_warnings():
    # torch warns once per process that a tensor over a read-only buffer (a message's bytes) could write to it; the
    # codecs only ever read such views, so spend that one warning here, unseen
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


def wire_values(buffer: bytes, dtype: torch.dtype, count: int = -1, offset: int = 0) -> torch.Tensor:
    """A read-only tensor view of little-endian values in a message's buffer (a copy on a big-endian host). Decoding
    with torch instead of numpy: numpy converts fp16 to fp32 25x slower, and a sync decodes the whole vector twice."""
    if len(buffer) == offset or count == 0:
        return torch.empty(0, dtype=dtype)  # torch.frombuffer refuses an empty view
    if NATIVE_LITTLE_ENDIAN:
        return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset)
    numpy_dtype = {torch.float32: "<f4", torch.float16: "<f2", torch.int16: "<i2", torch.int8: "i1"}[dtype]
    return torch.from_numpy(np.frombuffer(buffer, dtype=numpy_dtype, count=count, offset=offset).astype(
        numpy_dtype[1:]))


def _wire_bytes(tensor: torch.Tensor, little_endian_dtype: str) -> bytes:
    """The buffer of a message: ``tensor``'s values as little-endian bytes."""
    array = tensor.numpy()
    return (array if NATIVE_LITTLE_ENDIAN else array.astype(little_endian_dtype)).tobytes()


def _wire_view(tensor: torch.Tensor, little_endian_dtype: str) -> Buffer:
    """``_wire_bytes`` without the copy: a byte view of ``tensor``'s memory (which it keeps alive) on a
    little-endian host. Only for a tensor nothing writes to afterwards (a codec's fresh output)."""
    if not NATIVE_LITTLE_ENDIAN or tensor.numel() == 0:  # (memoryview casts no empty view)
        return _wire_bytes(tensor, little_endian_dtype)
    return memoryview(tensor.reshape(-1).numpy()).cast("B")


class WireFormatError(ValueError):
    """A message from a peer that does not decode with this group's codec: truncated, malformed or another format."""


class WireCodec(CompressionBase):
    """A codec for all-reduce parts: ``compress`` (local tensors, trusted) and ``extract`` (a peer's message, checked).

    ``extract`` returns a new fp32 tensor or raises ``WireFormatError``; it never returns something half-decoded."""

    name: ClassVar[str]
    dtype_tag: ClassVar[str] = "float32"
    """what ``runtime_pb2.Tensor.dtype`` must say"""
    lossless: ClassVar[bool] = False

    def num_bytes(self, numel: int) -> int:
        """The exact length of the buffer of a message with this many values."""
        raise NotImplementedError

    def _decode(self, buffer: bytes, numel: int) -> torch.Tensor:
        """The flat fp32 values of a buffer that has ``num_bytes(numel)`` bytes; raise ValueError if it is bad."""
        raise NotImplementedError

    def _decode_into(self, buffer: bytes, numel: int, out: torch.Tensor) -> None:
        """``_decode`` written into ``out`` (flat fp32 of ``numel`` values); codecs that can convert straight from the
        buffer do, without a tensor of their own in between."""
        out.copy_(self._decode(buffer, numel))

    def extract(self, serialized_tensor: Union[runtime_pb2.Tensor, WireTensor],
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The message's values as fp32 of its shape: a new tensor, or ``out`` (flat, as many values as the message
        says it has: WireFormatError otherwise, before anything is written) viewed in that shape."""
        msg = serialized_tensor
        if msg.compression != self.compression_type or msg.dtype != self.dtype_tag:
            raise WireFormatError(
                f"expected a {self.name} part ({self.dtype_tag!r}, compression {self.compression_type}); got "
                f"{msg.dtype!r}, compression {msg.compression}"
            )
        shape = tuple(msg.size)
        numel = math.prod(shape)
        expected = self.num_bytes(numel)
        buffer = msg.buffer  # a copy out of a protobuf message at each read: read once
        if len(buffer) != expected:
            raise WireFormatError(
                f"a {self.name} part of shape {shape} needs {expected} bytes, the message has {len(buffer)}"
            )
        if out is not None and out.numel() != numel:
            raise WireFormatError(f"a {self.name} part of shape {shape}, where {out.numel()} values were expected")
        try:
            if out is not None:
                self._decode_into(buffer, numel, out)
                return out.view(shape)
            return self._decode(buffer, numel).reshape(shape)
        except WireFormatError:
            raise
        except Exception as e:  # whatever numpy or torch say about a bad buffer: one clean error type
            raise WireFormatError(f"cannot decode a {self.name} part of shape {shape}: {e!r}") from e

    def encode(self, tensor: torch.Tensor, info: Optional[CompressionInfo] = None) -> WireTensor:
        """``compress``'s message as the part stream sends it (``wire_part.py``): the same fields and bytes, held
        without protobuf's copies; codecs that encode into a fresh tensor hand out a view of it. ``info``: as
        ``compress`` takes it (hivemind's of a part; None: the tensor's own)."""
        return WireTensor.of(self.compress(tensor, info or CompressionInfo.from_tensor(tensor)))

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        """``decompress(compress(tensor))``: exactly what a receiver of ``tensor`` gets, as fp32."""
        return self.extract(self.encode(tensor))

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.name!r})"


def _float32_input(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype != torch.float32:
        raise ValueError(f"pseudo-gradient parts are float32, got {tensor.dtype}")
    return tensor.detach().cpu().contiguous()


class NoneCodec(WireCodec, NoCompression):
    """fp32 as is: hivemind's ``NoCompression`` message."""

    name = "none"
    lossless = True

    def compress(self, tensor, info=None, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        return NoCompression.compress(self, _float32_input(tensor), info, allow_inplace)

    def num_bytes(self, numel: int) -> int:
        return 4 * numel

    def _decode(self, buffer: bytes, numel: int) -> torch.Tensor:
        return wire_values(buffer, torch.float32).clone()

    def _decode_into(self, buffer: bytes, numel: int, out: torch.Tensor) -> None:
        out.copy_(wire_values(buffer, torch.float32))


class Fp16Codec(WireCodec, Float16Compression):
    """fp16: hivemind's ``Float16Compression`` message (values clamped to fp16's finite range, then rounded)."""

    name = "fp16"

    def compress(self, tensor, info=None, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        return self.encode(tensor).to_proto()

    def encode(self, tensor: torch.Tensor, info: Optional[CompressionInfo] = None) -> WireTensor:
        # hivemind's message byte for byte (tests/unit/test_compression.py), a third faster: round first, then clamp
        # the infinities that only values beyond fp16's range round to (hivemind clamps a fp32 copy first: the same
        # bits, since every fp32 value that rounds to a finite fp16 lies within the clamp)
        tensor = _float32_input(tensor)
        half = tensor.to(torch.float16).clamp_(self.FP16_MIN, self.FP16_MAX)
        return WireTensor(_wire_view(half, "<f2"), tensor.shape, "float32", self.compression_type,
                          tensor.requires_grad)

    def num_bytes(self, numel: int) -> int:
        return 2 * numel

    def _decode(self, buffer: bytes, numel: int) -> torch.Tensor:
        return wire_values(buffer, torch.float16).to(torch.float32)

    def _decode_into(self, buffer: bytes, numel: int, out: torch.Tensor) -> None:
        out.copy_(wire_values(buffer, torch.float16))


class Bf16Codec(WireCodec):
    """bf16: the upper half of each fp32 value, rounded to nearest even; buffer = little-endian bf16 bit patterns."""

    name = "bf16"
    compression_type = WIRE_TYPE
    dtype_tag = "p2ptrain.bf16.v1"
    BF16_MAX = torch.finfo(torch.bfloat16).max

    def compress(self, tensor, info=None, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        return self.encode(tensor).to_proto()

    def encode(self, tensor: torch.Tensor, info: Optional[CompressionInfo] = None) -> WireTensor:
        tensor = _float32_input(tensor)
        # fp32 values within half a bf16 ulp of fp32's max would round to inf: clamp like fp16 does
        bits = tensor.clamp(-self.BF16_MAX, self.BF16_MAX).to(torch.bfloat16).view(torch.int16)
        return WireTensor(_wire_view(bits, "<i2"), tensor.shape, self.dtype_tag, self.compression_type)

    def num_bytes(self, numel: int) -> int:
        return 2 * numel

    def _decode(self, buffer: bytes, numel: int) -> torch.Tensor:
        return wire_values(buffer, torch.int16).view(torch.bfloat16).to(torch.float32)

    def _decode_into(self, buffer: bytes, numel: int, out: torch.Tensor) -> None:
        out.copy_(wire_values(buffer, torch.int16).view(torch.bfloat16))

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        return 0.5


class Int8Codec(WireCodec):
    """int8 with one fp32 scale per block of ``BLOCK`` values (absmax / 127), symmetric round-to-nearest-even.

    buffer = scales (``ceil(n / BLOCK)`` little-endian fp32) followed by codes (``n`` int8 in [-127, 127]). The
    last block of a part may be shorter. A block of zeros has scale 0; decoding is ``code * scale`` in fp32, so the
    error of every value is at most ``scale / 2`` of its block (plus fp32 rounding of the product, 2**-24
    relative). Blocks whose absmax is below ``127 * 2**-149`` (fp32's smallest subnormal) decode to zeros."""

    name = "int8"
    compression_type = WIRE_TYPE
    dtype_tag = "p2ptrain.int8.v1"
    BLOCK = 1024

    @classmethod
    def num_blocks(cls, numel: int) -> int:
        return -(-numel // cls.BLOCK)

    def num_bytes(self, numel: int) -> int:
        return 4 * self.num_blocks(numel) + numel

    def quantize(self, tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes int8 [n], scales fp32 [ceil(n / BLOCK)]) of a float32 tensor."""
        flat = _float32_input(tensor).reshape(-1)
        numel, num_blocks = flat.numel(), self.num_blocks(flat.numel())
        if numel % self.BLOCK == 0:  # every part but a tensor's last: no padded copy
            blocks = flat.view(num_blocks, self.BLOCK)
        else:
            blocks = torch.zeros(num_blocks * self.BLOCK, dtype=torch.float32)
            blocks[:numel] = flat
            blocks = blocks.view(num_blocks, self.BLOCK)
        scales = blocks.abs().amax(dim=1) / 127 if num_blocks else torch.zeros(0)
        if not torch.isfinite(scales).all():
            raise ValueError("int8 compression of a tensor with NaN or infinite values")
        divisors = torch.where(scales > 0, scales, torch.ones_like(scales))
        codes = torch.round(blocks / divisors[:, None]).clamp_(-127, 127).to(torch.int8)
        return codes.view(-1)[:numel], scales

    def compress(self, tensor, info=None, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        codes, scales = self.quantize(tensor)
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=_wire_bytes(scales, "<f4") + codes.numpy().tobytes(),
            size=tensor.shape,
            dtype=self.dtype_tag,
        )

    def _decode(self, buffer: bytes, numel: int) -> torch.Tensor:
        num_blocks = self.num_blocks(numel)
        scales = wire_values(buffer, torch.float32, count=num_blocks).clone()
        codes = wire_values(buffer, torch.int8, offset=4 * num_blocks)
        if not (torch.isfinite(scales).all() and (scales >= 0).all()):
            raise WireFormatError("int8 part with a NaN, infinite or negative scale")
        if numel and int(codes.min()) == -128:
            raise WireFormatError("int8 part with the code -128 (codes are in [-127, 127])")
        return self.dequantize(codes, scales)

    def dequantize(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The flat fp32 values of int8 ``codes`` with their block ``scales``: ``code * scale``, in fp32."""
        numel, num_blocks = codes.numel(), scales.numel()
        values = torch.zeros(num_blocks * self.BLOCK, dtype=torch.float32)
        values[:numel] = codes
        values = values.view(num_blocks, self.BLOCK).mul_(scales[:, None])
        return values.view(-1)[:numel].clone()

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        # the same arithmetic as decoding the message (the tests hold the two bit-equal), without building and
        # parsing one: error feedback rounds every part of the pseudo-gradient this way before each round
        codes, scales = self.quantize(tensor)
        return self.dequantize(codes, scales).view(tensor.shape)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        # the codes alone: hivemind then cuts parts of part_size_bytes values (2**19 by default), a whole number
        # of blocks; the scales add 4 / BLOCK = 0.4% on top
        return 0.25


# name -> codec. fp16 halves the bytes of fp32; DiLoCo's pseudo-gradients lose nothing measurable to it
# (OpenDiLoCo, section 4). A name added here is a valid diloco.compression / --compression at once.
COMPRESSIONS: Dict[str, Type[WireCodec]] = {
    "none": NoneCodec,
    "fp16": Fp16Codec,
    "bf16": Bf16Codec,
    "int8": Int8Codec,
}

SPARSE = "sparse"
"""SparseLoCo's 2-bit top-k messages with error feedback (``sparse.py``): not a codec of butterfly parts, its round
is an all-gather (``sparse_round.py``); the averager gives hivemind the fp32 codec, which no part of a sparse run
ever crosses"""
COMPRESSION_CHOICES = (*COMPRESSIONS, SPARSE)
"""every ``--compression``: the butterfly's codecs, then sparse"""

ERROR_FEEDBACK_BY_DEFAULT = ("int8",)
"""Codecs whose peers keep and re-send their rounding residual unless told otherwise (``error_feedback``)."""


def get_compression(name: str) -> WireCodec:
    try:
        return COMPRESSIONS[name]()
    except KeyError:
        raise ValueError(f"unknown compression {name!r}; use one of: {', '.join(COMPRESSIONS)}") from None


def wire_parts(tensor: torch.Tensor, codec: CompressionBase, part_size_bytes: int) -> Sequence[torch.Tensor]:
    """The parts hivemind's ``TensorPartContainer`` cuts one averaged tensor into (flat views, in order): the same
    formula (hivemind/averaging/partition.py), so a peer can round locally exactly what the wire rounds. Parts never
    span two tensors, and the cut does not depend on the group, only on the tensor, codec and part size."""
    bytes_per_value = tensor.element_size() * codec.estimate_compression_ratio(CompressionInfo.from_tensor(tensor))
    return tensor.detach().view(-1).split(int(part_size_bytes / bytes_per_value))


@torch.no_grad()
def wire_residual_(residuals: List[torch.Tensor], sent: Sequence[torch.Tensor], codec: WireCodec,
                   part_size_bytes: int) -> None:
    """``residuals[i] = sent[i] - decompress(compress(sent[i]))``, part by part as the all-reduce cuts and rounds
    them: what the wire drops of this peer's contribution. In place; ``residuals`` are fp32 tensors shaped like
    ``sent``."""
    for residual, tensor in zip(residuals, sent, strict=True):
        for res_part, part in zip(wire_parts(residual, codec, part_size_bytes),
                                  wire_parts(tensor, codec, part_size_bytes), strict=True):
            torch.sub(part, codec.roundtrip(part).view(-1), out=res_part)
