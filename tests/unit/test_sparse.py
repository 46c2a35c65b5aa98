"""The sparse codec's math and bytes (p2ptrain/averaging/sparse.py), in one process: what is kept, what the
message costs, what the accumulator keeps, and every malformed message refused."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.averaging.compression import WireFormatError
from p2ptrain.averaging.sparse import CHUNK, Layout, _pack, accumulate_, decode, encode, send_

SHAPES = ((128, 192), (100,), (5000,), (64, 64), (3,), (65, 64))


def tensors(seed: int = 0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for shape in shapes]


def layout(shapes=SHAPES, k: int = 128) -> Layout:
    return Layout(tuple(shapes), k=k)


def test_each_chunk_keeps_its_largest_values_with_their_signs():
    ts = tensors()
    message, carried = encode(ts, layout())
    for t, c, shape in zip(ts, carried, SHAPES):
        kept = c != 0
        if len(shape) == 2 and shape[0] % 64 == 0 and shape[1] % 64 == 0:  # tiles of 64x64: 128 of each
            tiles = kept.view(shape[0] // 64, 64, shape[1] // 64, 64).sum(dim=(1, 3))
            assert (tiles == 128).all()
        else:  # runs of 4096 values, the last shorter: ceil(128 * n / 4096) of n
            flat = kept.reshape(-1)
            for start in range(0, flat.numel(), CHUNK):
                n = min(CHUNK, flat.numel() - start)
                assert flat[start:start + n].sum() == min(n, math.ceil(128 * n / CHUNK))
        assert (torch.sign(c[kept]) == torch.sign(t[kept])).all()
    # in a tile, every kept magnitude is at least every dropped one
    tile, kept = ts[3], carried[3] != 0
    assert tile.abs()[kept].min() >= tile.abs()[~kept].max()


def test_two_magnitudes_per_chunk_the_means_below_and_above_the_median():
    t = torch.zeros(64, 64)
    t.view(-1)[:128] = torch.cat([torch.full((64,), 1.0), torch.full((64,), 3.0)]) * torch.tensor([1.0, -1.0]).repeat(64)
    _, (carried,) = encode([t], layout([(64, 64)]))
    assert torch.equal(carried, t)  # two magnitudes, each its own scale exactly (fp16 holds 1 and 3)
    t.view(-1)[:128] = torch.linspace(1.0, 2.0, 128)
    _, (carried,) = encode([t], layout([(64, 64)]))
    assert carried.view(-1)[:128].unique().tolist() == pytest.approx([1.25, 1.75], abs=2e-3)


def test_a_full_chunk_costs_about_140_bytes_1_7_percent_of_fp16():
    one = layout([(64, 64)])
    assert one.rice == [4]  # gaps average (4096 - 128) / 128 = 31 values
    assert one.fixed_bytes == 4 + 32 + 64  # scales, 2-bit codes, 4 low bits of each gap
    assert (one.min_message_bytes, one.max_message_bytes) == (100 + 16, 100 + -(-(128 + (4096 - 128) // 16) // 8))
    sizes = [len(encode(tensors(s, [(64, 64)]), one)[0]) for s in range(20)]
    assert all(one.min_message_bytes <= size <= one.max_message_bytes for size in sizes)
    # 12-bit places would take 4 + 192 + 32 = 228 bytes (2.8%); the places' entropy is about 103 bytes
    assert 0.016 < sum(sizes) / len(sizes) / one.dense_fp16_bytes < 0.018
    assert len(set(sizes)) > 1  # the size is each message's own, within the layout's bounds


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from([(64, 64), (1,), (7,), (100,), (4097,), (64, 128), (3, 5)]), min_size=1, max_size=4),
       st.sampled_from([1, 3, 64, 128, 1000, 2048, 4096]), st.integers(0, 2 ** 16))
def test_every_layout_and_k_round_trips_within_its_bounds(shapes, k, seed):
    lay = layout(shapes, k=k)
    message, carried = encode(tensors(seed, shapes), lay)
    assert lay.min_message_bytes <= len(message) <= lay.max_message_bytes
    assert all(torch.equal(a, b) for a, b in zip(carried, decode(message, lay)))
    assert [int((c != 0).sum()) for c in carried] <= [math.prod(shape) for shape in shapes]


def test_the_same_bytes_decode_to_the_same_bits_and_the_accumulator_keeps_the_rest():
    ts = tensors(1)
    before = [t.clone() for t in ts]
    message, carried = send_(ts, layout())
    again = decode(message, layout())
    assert all(torch.equal(a, b) for a, b in zip(carried, again))
    assert all(torch.equal(rest + c, b) or torch.allclose(rest + c, b, atol=1e-6)
               for rest, c, b in zip(ts, carried, before))
    # what a chunk's top-k carried is gone from it up to the 2-bit rounding: the accumulator shrank
    assert sum(t.norm() ** 2 for t in ts) < sum(b.norm() ** 2 for b in before)


def test_the_accumulator_decays_and_adds():
    e, g = [torch.ones(3)], [torch.full((3,), 2.0)]
    accumulate_(e, g, decay=0.5)
    assert torch.equal(e[0], torch.full((3,), 2.5))


def test_over_rounds_error_feedback_sends_what_the_peer_meant():
    """A constant pseudo-gradient, sent through the accumulator without decay: the messages sum to it round after
    round, every value of it on its way within a few rounds (what top-k alone would starve)."""
    g = tensors(2, [(64, 64)])
    e, total = [torch.zeros(64, 64)], torch.zeros(64, 64)
    rounds = 200
    for _ in range(rounds):
        accumulate_(e, g, decay=1.0)
        _, (carried,) = send_(e, layout([(64, 64)]))
        total += carried
    assert torch.allclose(total / rounds, g[0], atol=0.05 * g[0].abs().max().item())


def test_the_average_of_messages_is_each_entrys_mean_over_the_messages_that_carry_it():
    from p2ptrain.averaging.sparse_round import average_messages

    lay = layout(k=128)
    messages, carried = zip(*(encode(tensors(seed), lay) for seed in range(3)))
    average = average_messages(list(messages), lay)
    for i, value in enumerate(average):
        stacked = torch.stack([c[i] for c in carried])
        count = (stacked != 0).sum(dim=0).clamp(min=1)
        torch.testing.assert_close(value, stacked.sum(dim=0) / count, rtol=0, atol=1e-7)
        # an entry one message carries is that message's value, not a third of it
        only_first = (carried[0][i] != 0) & (carried[1][i] == 0) & (carried[2][i] == 0)
        assert only_first.any() and torch.equal(value[only_first], carried[0][i][only_first])
    # the same bytes in the same order: the same bits
    again = average_messages(list(messages), lay)
    assert all(torch.equal(a, b) for a, b in zip(average, again))
    with pytest.raises(WireFormatError):
        average_messages([messages[0], messages[1][:-1]], lay)


def corrupt(message: bytes, at: int, value: int) -> bytes:
    out = bytearray(message)
    out[at] = value
    return bytes(out)


def pack_places(lay: Layout, places, seed: int = 0) -> bytes:
    """A message of ``lay`` keeping the given places (a list per chunk, ascending), with random scales and codes."""
    rng = np.random.default_rng(seed)
    index = np.asarray([i for chunk in places for i in chunk], dtype=np.int64)
    scales = rng.random((lay.num_chunks, 2)).astype(np.float16)
    return _pack(scales, index, rng.integers(0, 4, index.size).astype(np.uint8), lay)


def test_malformed_messages_are_refused_before_anything_is_touched():
    two = layout([(64, 64), (100,)])  # chunks keep 128 and 4 values
    message, _ = encode(tensors(3, [(64, 64), (100,)]), two)
    assert decode(pack_places(two, [list(range(0, 4096, 32)), [0, 1, 2, 99]]), two)  # a sound hand-made one
    nan_scale = bytearray(message)
    nan_scale[0:2] = np.float16(np.nan).tobytes()
    negative = bytearray(message)
    negative[2:4] = np.float16(-1.0).tobytes()
    unary = np.unpackbits(np.frombuffer(message[two.fixed_bytes:], np.uint8), bitorder="little")
    one_short = unary.copy()
    one_short[np.flatnonzero(unary)[-1]] = 0  # the last value's 1 bit gone: 131 of 132
    one_more = np.append(unary, np.ones(8, np.uint8))  # a byte of 1 bits after the last value's
    cases = {
        "short": message[:-1] if len(message) > two.min_message_bytes else message[:two.min_message_bytes - 1],
        "long": message + bytes(two.max_message_bytes - len(message) + 1), "empty": b"",
        "padding after the last place": message + b"\0",
        "nan scale": bytes(nan_scale), "negative scale": bytes(negative),
        "a value's place missing": message[:two.fixed_bytes] + np.packbits(one_short, bitorder="little").tobytes(),
        "places past the last value": message[:two.fixed_bytes] + np.packbits(one_more, bitorder="little").tobytes(),
        # gaps that add up past the 100-value chunk, in a message of a size the layout allows
        "place past the chunk": pack_places(two, [list(range(0, 4096, 32)), [0, 1, 2, 100]]),
    }
    assert len(cases["place past the chunk"]) <= two.max_message_bytes
    for name, bad in cases.items():
        with pytest.raises(WireFormatError):
            decode(bytes(bad), two)
            pytest.fail(f"{name} was decoded")


@settings(max_examples=300, deadline=None)
@given(st.binary(min_size=0, max_size=600))
def test_any_bytes_decode_or_raise_wire_format_error(data):
    small = layout([(64, 64), (100,)], k=16)  # 17 values: small enough for the fuzzer to hit the sizes allowed
    size = small.min_message_bytes + len(data) % (small.max_message_bytes - small.min_message_bytes + 1)
    padded = (data * (1 + size // max(len(data), 1)))[:size] if data else data
    for candidate in (data, padded):
        try:
            out = decode(candidate, small)
        except WireFormatError:
            continue
        assert [tuple(t.shape) for t in out] == [(64, 64), (100,)]
        assert all(torch.isfinite(t).all() for t in out)


def test_the_sparse_round_in_one_process_trains_and_counts_its_bytes():
    from p2ptrain.bench.convergence import Setup, run_alone
    from p2ptrain.bench.convergence_sparse import run_sparse

    tiny = Setup(peers=3, steps=8, batch_size=4, eval_batches=2)
    result = run_sparse(tiny, local_steps=4)
    assert result["syncs"] == 2 and math.isfinite(result["eval_loss"])
    assert result["eval_loss"] < run_alone(Setup(peers=3, steps=0, batch_size=4, eval_batches=2))  # it trained
    assert result["twelve_bit_bytes"] / result["fp16_bytes"] == pytest.approx(0.028, abs=0.002)
    assert 0.015 < result["message_bytes"] / result["fp16_bytes"] < 0.02  # the places Rice-coded
    union = result["union"]
    assert union[0] == result["kept"] and union[0] <= union[1] <= union[2] <= 3 * result["kept"]


def test_bench_convergence_takes_sparse_rows_with_their_bytes_and_plot(tmp_path):
    import json

    from click.testing import CliRunner

    from p2ptrain.cli.bench import bench

    runner = CliRunner()
    result = runner.invoke(bench, ["--convergence", "8", "--peers", "2", "--local-steps", "4", "--batch-size", "4",
                                   "--model", "tiny", "--sparse-k", "64", "--no-swarm", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    runs = json.loads((tmp_path / "convergence.json").read_text())["runs"]
    assert [r["name"] for r in runs] == ["alone", "data_parallel", "diloco H=4 fp16", "sparse H=4 k=64"]
    report = (tmp_path / "convergence.md").read_text()
    assert "## Bytes: sparse against dense" in report and "| sparse H=4 k=64 | 8 |" in report
    assert "| diloco H=4 fp16 | 8 |" in report and "100.00%" in report  # fp16 against itself
    assert (tmp_path / "loss_per_byte.png").stat().st_size > 10_000
    refused = runner.invoke(bench, ["--sparse-k", "64", "--loopback"])
    assert refused.exit_code == 2 and "--sparse-k" in refused.output
