"""A round's averages decoded straight into one flat fp32 buffer that the averager keeps from round to round.

hivemind's ``TensorPartContainer`` collects each averaged part as a tensor of its own (the decoder's fresh memory),
then ``torch.cat``s a tensor's parts into new memory once they are all in: two model-sized allocations per sync,
most of whose cost is the kernel faulting in fresh pages (25M values: 61 ms into fresh memory, 10 ms into a buffer
written before; docs/bench/2026-11-28-sync-netns). ``FlatOutputs`` gives every part a slice of one buffer instead:
the runner decodes each average into its slice (``part_slice``), a failed reducer's range gets this peer's own values
copied in, and the outputs are views of the buffer, one per tensor, once every part has come.

The parts of all ranges, in reducer order, tile the flat vector of the tensors in order (hivemind assigns each
tensor's parts to reducers in order of the cumulative fractions), which is what makes one slice per part possible.
"""

from __future__ import annotations

import asyncio
import math
from typing import AsyncIterable, List, Optional, Tuple

import torch
from hivemind.averaging.partition import AllreduceException, TensorPartContainer

from p2ptrain.hivemind_compat import own_input_part, own_input_part_shapes


class FlatOutputs(TensorPartContainer):
    """hivemind's container whose outputs live in ``buffer`` (flat fp32, the tensors' total size). ``adopt`` makes
    the runner's container one, as ``Reducer.adopt`` does for its reducer."""

    buffer: torch.Tensor
    _slices: List[List[Tuple[int, int]]]
    """(offset, size) in the buffer of each part of each reducer's range"""
    _registered: List[int]
    _parts_missing: int
    _all_registered: asyncio.Event

    @classmethod
    def adopt(cls, container: TensorPartContainer, buffer: Optional[torch.Tensor]) -> "FlatOutputs":
        """Make ``container`` (a runner built it) this class, its outputs in ``buffer`` (a new one if None)."""
        if buffer is None:
            buffer = torch.empty(container.total_size, dtype=torch.float32)
        if buffer.dtype != torch.float32 or buffer.dim() != 1 or buffer.numel() != container.total_size:
            raise ValueError(f"an output buffer must be flat fp32 of {container.total_size} values, got "
                             f"{buffer.dtype} of shape {tuple(buffer.shape)}")
        container.__class__ = cls
        container.buffer = buffer
        container._slices, offset = [], 0
        for shapes in own_input_part_shapes(container):
            container._slices.append([])
            for shape in shapes:
                container._slices[-1].append((offset, math.prod(shape)))
                offset += math.prod(shape)
        container._registered = [0] * container.group_size
        container._parts_missing = sum(container.num_parts_by_peer)
        container._all_registered = asyncio.Event()
        if not container._parts_missing:
            container._all_registered.set()
        return container

    def part_slice(self, peer_index: int, part_index: int) -> torch.Tensor:
        """Where the average of part ``part_index`` of reducer ``peer_index``'s range goes (a flat view)."""
        offset, size = self._slices[peer_index][part_index]
        return self.buffer[offset:offset + size]

    def register_processed_part(self, peer_index: int, part_index: int, part: torch.Tensor):
        """hivemind's, with the part copied into its slice unless it was decoded there already."""
        if part_index != self._registered[peer_index]:
            raise ValueError(f"part #{part_index} of reducer #{peer_index} registered out of turn, expected part "
                             f"#{self._registered[peer_index]}")
        target = self.part_slice(peer_index, part_index)
        if part.data_ptr() != target.data_ptr() or part.numel() != target.numel():
            target.copy_(part.reshape(-1))
        self._registered[peer_index] += 1
        self._parts_missing -= 1
        if not self._parts_missing:
            self._all_registered.set()

    def register_failed_reducer(self, peer_index: int):
        """hivemind's: the rest of that reducer's range keeps this peer's own values (the runner's outputs are
        averages, not deltas), counted in ``failed_size``."""
        for part_index in range(self._registered[peer_index], len(self._slices[peer_index])):
            own = own_input_part(self, peer_index, part_index)
            self.register_processed_part(peer_index, part_index, own)
            self.failed_size += own.numel()

    async def iterate_output_tensors(self) -> AsyncIterable[torch.Tensor]:
        """Views of the buffer shaped like the tensors, once every part is in (the runner's caller collects them
        all before writing anything anyway: a round that fails half-way must change nothing)."""
        await self._all_registered.wait()
        if self._parts_missing:
            raise AllreduceException("All-reduce was terminated during iteration")
        offset = 0
        for tensor in self.local_tensors:
            yield self.buffer[offset:offset + tensor.numel()].view(tensor.shape)
            offset += tensor.numel()

    def finalize(self):
        super().finalize()
        self._all_registered.set()  # wakes iterate_output_tensors, which sees the parts still missing


class OutputBufferSlot:
    """The output buffer an averager keeps between its rounds: one, of the size of the last round that succeeded.

    A round takes it (``take``) and gives it back only once it succeeded (``keep``): then every write into it has
    ended, while after a failure a decode still running in an executor thread could write into the next round's
    averages. Rounds that run at the same time (never two of one fragment) each get a buffer of their own."""

    def __init__(self) -> None:
        self._buffer: Optional[torch.Tensor] = None

    def take(self, numel: int) -> Optional[torch.Tensor]:
        """The kept buffer if it holds ``numel`` values (it is then no longer kept), else None."""
        if self._buffer is None or self._buffer.numel() != numel:
            return None
        buffer, self._buffer = self._buffer, None
        return buffer

    def keep(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer
