"""A round's part size from its members' measured link rates (averaging/part_size.py)."""

from __future__ import annotations

import math

import pytest

from p2ptrain.averaging.compression import Int8Codec
from p2ptrain.averaging.part_size import MAX_PART_BYTES, MIN_PART_BYTES, PART_TIME_S, RATE_KEY, link_rate, \
    round_part_size
from p2ptrain.averaging.plan import RoundReport

DEFAULT = 1 << 19
MBIT = 1e6 / 8


@pytest.mark.parametrize("rates, expected", [
    ([100 * MBIT * 0.83] * 3, MIN_PART_BYTES),  # 100 Mbit/s links: 415 KB in 40 ms -> 256 KiB
    ([90e6, 95e6], MAX_PART_BYTES),  # loopback on 2 cores: 3.6 MB -> 2 MiB
    ([30e6], 1 << 20),  # 1.2 MB -> the power of two below it
    ([2e6, 500e6, 500e6], MIN_PART_BYTES),  # the slowest member sets it
    ([1e12], MAX_PART_BYTES),
    ([1.0], MIN_PART_BYTES),
])
def test_the_slowest_members_rate_sets_a_power_of_two_within_bounds(rates, expected):
    assert round_part_size([{RATE_KEY: rate} for rate in rates], DEFAULT) == expected


@pytest.mark.parametrize("entries", [
    [],
    [{RATE_KEY: 50e6}, {}],  # a member without a figure: its first round
    [{RATE_KEY: 50e6}, {RATE_KEY: 0}],
    [{RATE_KEY: 50e6}, {RATE_KEY: -1.0}],
    [{RATE_KEY: 50e6}, {RATE_KEY: math.nan}],
    [{RATE_KEY: 50e6}, {RATE_KEY: math.inf}],
    [{RATE_KEY: 50e6}, {RATE_KEY: "fast"}],
    [{RATE_KEY: 50e6}, "not a dict"],
])
def test_a_group_with_a_member_without_a_sound_figure_keeps_the_default(entries):
    assert round_part_size(entries, DEFAULT) == DEFAULT


def test_every_size_a_round_may_choose_cuts_whole_int8_blocks():
    """Error feedback rounds with the default cut: the same values only if every part is whole int8 blocks."""
    size = MIN_PART_BYTES
    while size <= MAX_PART_BYTES:
        values_per_part = int(size / (4 * Int8Codec().estimate_compression_ratio(None)))
        assert values_per_part % Int8Codec.BLOCK == 0
        size *= 2
    assert MAX_PART_BYTES >= 100 * MBIT * PART_TIME_S  # a 100 Mbit/s link stays off the top


def test_a_rounds_rate_is_its_busier_directions_and_reaches_the_host():
    assert link_rate(10, 30, 2.0) == 15.0
    assert link_rate(10, 30, 0.0) == 0.0
    report = RoundReport()
    assert report.link_bytes_s == 0.0
    report.record_link_rate(12.5e6)
    assert report.link_bytes_s == 12.5e6
