"""The size of a round's all-reduce parts, from how fast its members' last rounds moved bytes (protocol 11).

A part is the unit of the butterfly's pipeline: a reducer answers part k once every sender's part k is in, so a round
ends about one part's transfer after its last bytes arrive, and every part costs a fixed amount of CPU on both ends
(a hand-off to a thread, a commitment, a signature, a norm check). Small parts suit slow links, large ones fast
links. Measured on the 2-core machine (docs/bench/2026-11-28-sync-netns): 3 peers on 100 Mbit/s links sync in
1.29-1.32x the bandwidth bound with 256 KiB parts, 1.34-1.42x with hivemind's 512 KiB and 1.72x with 2 MiB; two
peers on loopback all-reduce 25M values in 0.44 s with 2 MiB parts, 0.50-0.57 s with 512 KiB.

So each member tells its group (in its gathered data, ``link_bytes_s``) how many bytes per second its last butterfly
round sent or received, whichever is more, and every member cuts the round's parts from the slowest member's figure:
what it moves in ``PART_TIME_S``, rounded down to a power of two within [``MIN_PART_BYTES``, ``MAX_PART_BYTES``].
Every member reads the same gathered data, so all cut the same parts. A member without a figure (its first round)
leaves the round at hivemind's default; a false figure moves the size only within those bounds. Power-of-two sizes of
at least 256 KiB keep every part a whole number of the int8 codec's blocks: error feedback (which cuts with the
default size) rounds exactly as the wire does, whatever size a round chose.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES

PART_TIME_S = 0.04
"""how long one part should take on the slowest member's link"""
MIN_PART_BYTES = 1 << 18
MAX_PART_BYTES = 1 << 21
RATE_KEY = "link_bytes_s"
"""the gathered data's field of a member's measured rate"""


def round_part_size(gathered_entries: Iterable[Any], default: int = DEFAULT_PART_SIZE_BYTES) -> int:
    """The part size (bytes on the wire) of a round whose members gathered ``gathered_entries`` (their dicts)."""
    rates = [entry.get(RATE_KEY) if isinstance(entry, dict) else None for entry in gathered_entries]
    if not rates or not all(isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0 for rate in rates):
        return default
    wanted = min(rates) * PART_TIME_S
    if wanted < MIN_PART_BYTES:
        return MIN_PART_BYTES
    return min(1 << int(math.log2(wanted)), MAX_PART_BYTES)


def link_rate(bytes_sent: int, bytes_received: int, seconds: float) -> float:
    """A round's rate as ``link_bytes_s`` counts it: the busier direction's bytes per second (0 if unmeasurable)."""
    return max(bytes_sent, bytes_received) / seconds if seconds > 0 else 0.0
