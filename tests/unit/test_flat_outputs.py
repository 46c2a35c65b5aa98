"""A round's averages decoded into one kept buffer (averaging/flat_outputs.py) and the codecs' decode into it."""

from __future__ import annotations

import asyncio

import pytest
import torch
from hivemind.averaging.partition import AllreduceException, TensorPartContainer

from p2ptrain.averaging.compression import COMPRESSIONS, WireFormatError, get_compression
from p2ptrain.averaging.flat_outputs import FlatOutputs, OutputBufferSlot
from p2ptrain.hivemind_compat import own_input_part


def container_of(tensors, fractions=(0.3, 0.0, 0.7), part_size_bytes=4096, buffer=None) -> FlatOutputs:
    """A container as a runner builds it (fp16 parts of 2048 values), made a FlatOutputs."""
    container = TensorPartContainer(tensors, fractions, compression=get_compression("fp16"),
                                    part_size_bytes=part_size_bytes, return_deltas=False)
    return FlatOutputs.adopt(container, buffer)


def every_part(container: FlatOutputs):
    for peer_index, count in enumerate(container.num_parts_by_peer):
        for part_index in range(count):
            yield peer_index, part_index


def outputs(container: FlatOutputs):
    async def collect():
        return [tensor async for tensor in container.iterate_output_tensors()]
    return asyncio.run(collect())


TENSORS = [torch.randn(3000), torch.randn(7, 500), torch.randn(1), torch.randn(20, 300)]


def test_the_parts_slices_tile_the_tensors_in_order():
    """Each part's slice is where its values sit in the flat vector of the tensors, whichever reducer has it."""
    container = container_of(TENSORS)
    flat = torch.cat([tensor.reshape(-1) for tensor in TENSORS])
    assert sum(container.num_parts_by_peer) > len(TENSORS) and container.num_parts_by_peer[1] == 0
    covered = 0
    for peer_index, part_index in every_part(container):
        target = container.part_slice(peer_index, part_index)
        own = own_input_part(container, peer_index, part_index)
        assert target.numel() == own.numel()
        offset = (target.data_ptr() - container.buffer.data_ptr()) // 4
        assert torch.equal(flat[offset:offset + own.numel()], own)
        covered += own.numel()
    assert covered == flat.numel()


def test_registered_parts_come_out_as_views_of_the_buffer_shaped_like_the_tensors():
    container = container_of(TENSORS)
    for peer_index, part_index in every_part(container):
        own = own_input_part(container, peer_index, part_index)
        container.register_processed_part(peer_index, part_index, own * 2)  # copied into its slice
    results = outputs(container)
    assert [r.shape for r in results] == [t.shape for t in TENSORS]
    for result, tensor in zip(results, TENSORS):
        assert torch.equal(result, tensor * 2)
        assert container.buffer.data_ptr() <= result.data_ptr() < container.buffer.data_ptr() + 4 * container.total_size
    assert container.failed_size == 0


def test_a_part_decoded_into_its_slice_is_not_copied_again():
    container = container_of(TENSORS)
    codec = get_compression("fp16")
    own = own_input_part(container, 0, 0)
    decoded = codec.extract(codec.compress(own), out=container.part_slice(0, 0))
    container.register_processed_part(0, 0, decoded)
    assert decoded.data_ptr() == container.buffer.data_ptr()
    assert torch.equal(container.buffer[:own.numel()], codec.roundtrip(own).reshape(-1))


def test_a_failed_reducers_range_keeps_this_peers_values_and_counts_as_failed():
    container = container_of(TENSORS)
    container.register_processed_part(2, 0, torch.zeros(own_input_part(container, 2, 0).numel()))
    for peer_index, part_index in every_part(container):
        if peer_index == 0:
            container.register_processed_part(peer_index, part_index, torch.zeros(
                own_input_part(container, peer_index, part_index).numel()))
    container.register_failed_reducer(2)
    failed = sum(own_input_part(container, 2, i).numel() for i in range(1, container.num_parts_by_peer[2]))
    assert container.failed_size == failed
    flat = torch.cat([tensor.reshape(-1) for tensor in TENSORS])
    result = torch.cat([r.reshape(-1) for r in outputs(container)])
    assert torch.equal(result[-failed:], flat[-failed:])
    assert not result[:-failed].any()


def test_parts_out_of_turn_are_refused():
    container = container_of(TENSORS)
    with pytest.raises(ValueError, match=r"part #1 of reducer #0 registered out of turn, expected part #0"):
        container.register_processed_part(0, 1, own_input_part(container, 0, 1))


def test_outputs_wait_for_every_part_and_a_finalized_round_yields_none():
    container = container_of(TENSORS)

    async def run():
        waiting = asyncio.create_task(outputs_of(container))
        await asyncio.sleep(0.05)
        assert not waiting.done()  # no part yet
        container.register_processed_part(0, 0, own_input_part(container, 0, 0))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        container.finalize()  # the round ended with parts missing
        with pytest.raises(AllreduceException):
            await waiting

    async def outputs_of(c):
        return [tensor async for tensor in c.iterate_output_tensors()]

    asyncio.run(run())


def test_a_kept_buffer_is_used_and_a_wrong_one_refused():
    total = sum(t.numel() for t in TENSORS)
    buffer = torch.full((total,), float("nan"))
    container = container_of(TENSORS, buffer=buffer)
    assert container.buffer is buffer
    with pytest.raises(ValueError, match=r"an output buffer must be flat fp32 of \d+ values"):
        container_of(TENSORS, buffer=torch.empty(total - 1))


def test_the_slot_keeps_one_buffer_and_gives_it_only_for_its_size():
    slot = OutputBufferSlot()
    assert slot.take(10) is None
    buffer = torch.empty(10)
    slot.keep(buffer)
    assert slot.take(11) is None  # another size: kept, not given
    assert slot.take(10) is buffer
    assert slot.take(10) is None  # taken: a round at the same time gets none


@pytest.mark.parametrize("name", sorted(COMPRESSIONS))
def test_decoding_into_a_buffer_gives_the_bits_of_decoding_into_new_memory(name):
    codec = get_compression(name)
    values = torch.randn(4, 777) * 3
    message = codec.compress(values)
    out = torch.full((values.numel(),), float("nan"))
    decoded = codec.extract(message, out=out)
    assert decoded.shape == values.shape and decoded.data_ptr() == out.data_ptr()
    assert torch.equal(decoded, codec.extract(message))


def test_a_message_of_another_size_is_refused_before_the_buffer_is_written():
    codec = get_compression("fp16")
    out = torch.zeros(100)
    with pytest.raises(WireFormatError, match=r"a fp16 part of shape \(101,\), where 100 values were expected"):
        codec.extract(codec.compress(torch.ones(101)), out=out)
    assert not out.any()
