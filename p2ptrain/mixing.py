"""Mixing groups for swarms larger than one all-reduce (``target_group_size`` G below the swarm's size): which peers
average together in which round. No torch, no network: the rounds, the convergence benchmark and tests share it.

Moshpit averaging (Ryabinin et al. 2021) averages in small groups whose membership changes every round, so that
every peer's state reaches every other's within a few rounds. Here every peer computes the round's groups alone,
from the progress records and the round's outer step t:

- the n live peers are sorted by a hash of (peer id, t // 2): an order that changes every other round and that no
  peer chooses (a peer cannot pick its partners, short of making identities until one lands where it wants);
- B = ceil(n / G) cells: in even rounds the rows, runs of consecutive peers in that order (k * B // n for the peer
  at place k), in odd rounds the columns of the same order (k mod B). Cells hold floor(n / B) or ceil(n / B) <= G
  peers. When n >= B * B (about n <= G * G: 64 peers with G = 8, 1024 with G = 32) every row holds a peer of every
  column, so a column round after a row round averages, in each group, states from every row: every peer's state
  has reached every other's within those 2 rounds. Past that, each pair of rounds mixes rows of a new random order;
- with n <= G there is one cell: the plain DiLoCo round of everybody.

Two peers that read different sets of records (a newcomer's record not stored yet) draw different cells for the
peers after the one they disagree about: a row round moves about B - 1 of them, a column round most. Those land in
smaller groups for that round, and a later round mixes them in again: nothing is lost, only that round's mixing is
less. The rounds (``swarm_view.mixing_group``) keep every peer seen during a round in its draw, which makes such
disagreements rare.
"""

from __future__ import annotations

import hashlib
from typing import Dict, Iterable, List, Optional, Sequence, Tuple


def num_cells(num_peers: int, group_size: Optional[int]) -> int:
    """How many groups ``num_peers`` peers form in a round with groups of at most ``group_size`` (1 or more)."""
    if not group_size or num_peers <= group_size:
        return 1
    return -(-num_peers // group_size)


def _order(peer_id: str, round_index: int) -> bytes:
    return hashlib.blake2b(f"{round_index}:{peer_id}".encode(), digest_size=8).digest()


def cells_of(peer_ids: Iterable[str], group_size: Optional[int], round_index: int) -> Dict[str, Tuple[int, int]]:
    """(cells, cell) of every peer of ``peer_ids`` (all the live peers of the round) in round ``round_index``, from
    one sort of them; empty when everybody is one group."""
    peers = set(peer_ids)
    cells = num_cells(len(peers), group_size)
    if cells == 1:
        return {}
    ranked = sorted(peers, key=lambda peer: (_order(peer, round_index // 2), peer))
    return {peer: (cells, place * cells // len(ranked) if round_index % 2 == 0 else place % cells)
            for place, peer in enumerate(ranked)}


def group_key(peer_id: str, peer_ids: Iterable[str], group_size: Optional[int],
              round_index: int) -> Optional[Tuple[int, int]]:
    """(cells, cell) of ``peer_id`` in round ``round_index`` among ``peer_ids`` (all the live peers of the round,
    itself included or not): equal for the members of one group; None when everybody is one group."""
    return cells_of({*peer_ids, peer_id}, group_size, round_index).get(peer_id)


def groups_of(peer_ids: Sequence[str], group_size: Optional[int], round_index: int) -> List[List[str]]:
    """Every group of round ``round_index`` when all ``peer_ids`` read the same records (each group's members
    sorted, groups in cell order)."""
    keys = cells_of(peer_ids, group_size, round_index)
    groups: Dict[Optional[tuple], List[str]] = {}
    for peer in peer_ids:
        groups.setdefault(keys.get(peer), []).append(peer)
    return [sorted(groups[key]) for key in sorted(groups, key=lambda key: key or (0, 0))]


def key_bits(key: Optional[Tuple[int, int]]) -> str:
    """``group_key`` as matchmaking key bits (appended to the outer step's): the number of cells, then the cell, 16
    bits each (peers that count a different number of cells never share a key). Empty for one group of everybody."""
    if key is None:
        return ""
    cells, cell = key
    return format(cells % 65536, "016b") + format(cell % 65536, "016b")
