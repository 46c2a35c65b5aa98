"""How often one matchmaking step looks its group's declared leaders up in the DHT (``SteeredMatchmaking``'s pace)."""

from __future__ import annotations

from typing import Iterator

GROUP_LOOKUP_FIRST_GAP_S, GROUP_LOOKUP_INTERVAL_S = 0.05, 0.5
"""a matchmaking step's gap between its first two DHT lookups of its group's declared leaders, and the most any
later gap grows to (``group_lookup_gaps``)"""


def group_lookup_gaps() -> Iterator[float]:
    """The least gaps between one matchmaking step's lookups of its group's declared leaders: 0.05, 0.1, 0.2, 0.4,
    then 0.5 s for good. Peers that reach the sync point together declare within tens of milliseconds of each other,
    so a peer's first lookup often comes before the leader declared itself: with a flat 0.5 s gap such a round
    waited 0.5 s for the second (3 peers at 100 Mbit/s: matchmaking 0.53-0.56 s in 9 of 15 syncs)."""
    gap = GROUP_LOOKUP_FIRST_GAP_S
    while True:
        yield min(gap, GROUP_LOOKUP_INTERVAL_S)
        gap *= 2


def group_lookups_within(seconds: float) -> int:
    """The most lookups ``group_lookup_gaps`` lets one matchmaking step make in ``seconds``."""
    count, at, gaps = 1, 0.0, group_lookup_gaps()
    while (at := at + next(gaps)) <= seconds:
        count += 1
    return count
