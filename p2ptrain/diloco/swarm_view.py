"""What the run's progress records say about this peer's round: where it stands (``Position``), the records sorted
for its round (``outlook_of``), its mixing group (``mixing_group``), and the merged reads of a round's looks
(``SwarmView``, the only part that reads the DHT)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Collection, Dict, FrozenSet, Iterable, List, Optional, Tuple

from p2ptrain.diloco.records import RoundOutlook
from p2ptrain.mixing import cells_of, key_bits, num_cells
from p2ptrain.swarm.progress import PeerProgress

@dataclass
class Position:
    """Where this peer stands when it averages: what a round plans from, and what it tells its group."""

    outer_step: int
    local_step: int
    phase_started: float
    """when this peer's current inner phase began (monotonic): bounds the wait for late peers"""
    last_group: Collection[str] = ()
    """the other members of this peer's last round that averaged (base58 ids)"""
    gather: Dict[str, Any] = field(default_factory=dict)
    """what this peer attaches to its join request: its outer step, samples, digest, norm scale"""
    fragment: int = 0
    """the fragment this round averages (streaming sync, ``fragments.FragmentPlan``; 0 of 1: all parameters)"""
    fragments: int = 1
    applied_by: Optional[int] = None
    """streaming sync: the local step at which this round's fragment is applied; a peer of this outer step past it
    applied it without us (we are behind)"""
    last: bool = False
    """this round is the last before this peer leaves (``PeerState.last_outer_step``)"""

    @property
    def group_bits(self) -> str:
        """The matchmaking key's bits: peers only group with peers at the same outer step (and fragment), so a peer
        that fell behind finds nobody and catches up instead of averaging against stale parameters."""
        bits = format(self.outer_step % 256, "08b")
        if self.fragments > 1:
            bits += format(self.fragment, f"0{(self.fragments - 1).bit_length()}b")
        return bits


class _Everybody:
    """Every peer is a member (the swarm is one group)."""

    def __contains__(self, peer: object) -> bool:
        return True

    def __len__(self) -> int:
        raise TypeError("everybody has no size")


EVERYBODY = _Everybody()


def mixing_group(me: str, outer_step: int, outlook: RoundOutlook, group_size: Optional[int],
                 drawn_from: FrozenSet[str] = frozenset()) -> Tuple[str, Collection[str], FrozenSet[str]]:
    """This round's mixing group (``RoundSettings.mixing``): its matchmaking key bits (added to the outer step's), its
    members, and the peers drawn from so far. The cells are drawn from every live peer that is in this round or its
    neighbours (ready or late at this outer step, stalled or excluded ones too, the ones still averaging the round
    before, and the ones whose group finished this round already), so that every peer of the round, whenever it reads
    the records, draws the same cells. ``drawn_from``: the peers of this round's earlier looks, added to (a member of
    another group that finished the round and left still counts, or every peer after it would change cells).
    ("", everybody) when there is one cell."""
    drawn_from = drawn_from | {me, *outlook.ready, *outlook.late, *outlook.next_step, *outlook.previous_step}
    keys = cells_of(drawn_from, group_size, outer_step)  # one sort, not one a peer
    if not keys:
        return "", EVERYBODY, drawn_from
    return key_bits(keys[me]), {peer for peer, key in keys.items() if key == keys[me]}, drawn_from


def may_mix_states(outer_step: int, outlook: RoundOutlook, last_group: Collection[str],
                   group_size: Optional[int]) -> bool:
    """Whether this round's group may hold a peer that starts from other global parameters than ours, so that it
    averages stepped states (mixing groups, ``averaging.round.mixes_states``): the swarm is more than one group, a
    live peer is a round ahead or behind, or a live peer of this outer step was not in our last round. Otherwise
    every other member averaged with us last time (at outer step 0: starts from the initial state) and holds our
    parameters, and filling the stepped state (``Contribution.fill_stepped_state``: two passes over the model, 0.19-
    0.27 s of a 124m sync on one core, a third of the sync's work outside the all-reduce) is not needed. Should a
    member start elsewhere after all (it applied its own pseudo-gradient after a failed round), the group averages
    pseudo-gradients and that member repairs (takes the state), as in a swarm without mixing groups."""
    others = {*outlook.ready, *outlook.late}
    if outlook.next_step or outlook.previous_step or num_cells(len(others) + 1, group_size) > 1:
        return True
    return outer_step > 0 and not others <= set(last_group)


def outlook_of(records: Iterable[PeerProgress], outer_step: int, local_step: int,
               last_group: Collection[str] = (), applied_by: Optional[int] = None,
               mixing: bool = False) -> RoundOutlook:
    """Sort the other live peers' records for the round at ``outer_step``: ready (at this sync point), late (still in
    their inner steps) or ahead. A member of our last round whose record still shows the step before counts as late:
    it stores its commit a moment after ours, and a peer that reads the records at once must not think it gone and
    step alone (seen with a fast peer next to a slow one). ``applied_by`` (a fragment's round, streaming sync): a peer
    of this outer step past this local step has applied the fragment already, so it is ahead too. ``mixing``
    (mixing groups): every peer still at the step before is late, as the groups of the round before finish at
    their own pace (CI: a cell of 4 started without a member 0.3 s away, still in its earlier group's round)."""
    ready, late, ahead = [], {}, False
    next_step, previous_step, far_ahead = [], [], False
    for record in records:
        if record.leaving:
            # a peer that finished this round and left: never waited for, but its cell stays as drawn
            if record.outer_step == outer_step + 1:
                next_step.append(record.peer_id)
            continue
        ahead |= record.outer_step > outer_step
        ahead |= applied_by is not None and record.outer_step == outer_step and record.local_step > applied_by
        far_ahead |= record.outer_step > outer_step + 1
        if record.outer_step == outer_step + 1:
            next_step.append(record.peer_id)
        if record.outer_step == outer_step - 1 and (mixing or record.peer_id in last_group):
            late[record.peer_id] = record.local_step
        elif record.outer_step == outer_step - 1:
            previous_step.append(record.peer_id)
        elif record.outer_step != outer_step:
            continue
        elif record.local_step >= local_step:
            ready.append(record.peer_id)
        else:
            late[record.peer_id] = record.local_step
    return RoundOutlook(ahead=ahead, ready=ready, late=late, next_step=next_step, previous_step=previous_step,
                        far_ahead=far_ahead)


class SwarmView:
    """A round's reads of the run's progress records (``progress``, a ``ProgressPublisher``), merged over one record
    period so that a read that missed a live peer does not hide it."""

    def __init__(self, progress):
        self.progress = progress
        self._recent: Dict[str, tuple] = {}  # peer id -> (its latest record read, when), for ``merged``
        self.peers_seen: List[int] = []
        """the other live peers each look saw since the caller last emptied it (once a sync): a short count is a
        partial view"""

    def outlook(self, position: Position, mixing: bool = False) -> RoundOutlook:
        """Read the run's progress records: is the swarm ahead, and who at this outer step is ready or late."""
        records = self.progress.others(5.0, leaving=True)
        if any(not r.leaving for r in records):
            self.progress.others_seen_at = time.monotonic()
        return outlook_of(self.merged(records), position.outer_step, position.local_step, position.last_group,
                          position.applied_by, mixing=mixing)

    def merged(self, records: List[PeerProgress]) -> List[PeerProgress]:
        """This read's records, plus the latest record of each peer that an earlier read within one record period
        saw and this one missed. A DHT read can return part of the swarm (a node that timed out under load is
        skipped): a peer that vanished from one read must not make this one step alone next to it. A kept record is
        never newer than the peer's true state (a fresh read replaces it), so it can only make this peer wait, never
        make it think the swarm went on. The count of each read is kept in ``peers_seen``."""
        now = time.monotonic()
        self.peers_seen.append(sum(1 for r in records if not r.leaving))
        for record in records:
            self._recent[record.peer_id] = (record, now)
        # one period: a stopped or dead peer's record already outlives it by up to 3 periods (its expiration)
        window = self.progress.period_s
        self._recent = {peer: (r, t) for peer, (r, t) in self._recent.items() if now - t < window}
        return [r for r, _ in self._recent.values()]

    def swarm_outer_step(self) -> int:
        """The highest outer step among the run's other live peers (from their progress records), or -1."""
        return max((r.outer_step for r in self.progress.others(5.0)), default=-1)
