"""What ``ExactAllReduceRunner`` wraps around hivemind's plumbing: its codec calls count time (``PhaseClock``), and a
reducer's first answer has a timeout of its own."""

from __future__ import annotations

import asyncio
from typing import Optional

import torch
from hivemind.compression import CompressionInfo

from p2ptrain.averaging.compression import WireCodec
from p2ptrain.averaging.wire_part import WireTensor
from p2ptrain.clock import PhaseClock


async def aiter_with_timeouts(iterable, first_s: Optional[float], next_s: Optional[float]):
    """hivemind's ``aiter_with_timeout``, with a timeout of its own for the first item."""
    iterator = iterable.__aiter__()
    timeout = first_s
    while True:
        try:
            item = await asyncio.wait_for(iterator.__anext__(), timeout=timeout)
        except StopAsyncIteration:
            break
        yield item
        timeout = next_s


class TimedCodec:
    """The runner's own calls of its codec, each counted in its clock: ``encode`` or ``decode``."""

    def __init__(self, codec: WireCodec, clock: PhaseClock) -> None:
        self._codec, self._clock = codec, clock

    def encode(self, tensor: torch.Tensor, info: Optional[CompressionInfo] = None) -> WireTensor:
        with self._clock("encode"):
            return self._codec.encode(tensor, info)

    def decode(self, message: WireTensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        with self._clock("decode"):
            return self._codec.extract(message, out)

    def roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a reducer receives of our own ``tensor`` (the codec's direct path: int8 builds no message)."""
        with self._clock("encode"):
            return self._codec.roundtrip(tensor)
