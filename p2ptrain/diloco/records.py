"""What a sync leaves behind and what a round sees before it starts: plain values, no network."""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional

import torch
import xxhash

from p2ptrain.averaging import RoundResult

NO_GROUP_POLICIES = ("apply_local", "wait")


class Outcome(enum.Enum):
    """How the rounds of one sync ended (``RoundOutcome.kind``)."""

    AVERAGED = "averaged"  # a group averaged: the averager's buffers hold the group's average
    BEHIND = "behind"  # the swarm is at a later outer step: this peer must take its state
    ALONE = "alone"  # no other live peer at this outer step (the swarm's first round looks once for starting ones)
    NO_GROUP = "no_group"  # attempts were made and none averaged (the policy gave up, the peer is leaving, ...)


@dataclass(frozen=True)
class RoundOutcome:
    """What ``Rounds.run`` came to: the sync's policy is a match over ``kind``."""

    kind: Outcome
    attempts: int
    """matchmaking attempts made"""
    result: Optional[RoundResult] = None
    """for AVERAGED: what the all-reduce did"""


@dataclass
class RoundOutlook:
    """What the run's progress records say about the round this peer is about to average, read just before it."""

    ahead: bool
    """a live peer holds a later outer step: this round went on without us"""
    ready: List[str]
    """the other live peers at this outer step that reached the sync point (they are averaging or about to)"""
    late: Dict[str, int]
    """the other live peers at this outer step still in their inner steps: peer id -> local step"""
    next_step: List[str] = field(default_factory=list)
    """the live peers one outer step ahead (mixing groups: another group that finished this round first)"""
    previous_step: List[str] = field(default_factory=list)
    """the live peers one outer step behind, not of our last group (mixing groups: another group still averaging
    the last round)"""
    far_ahead: bool = False
    """a live peer is two or more outer steps ahead"""


@dataclass
class SyncRecord:
    """The result of one sync, as this peer saw it."""

    outer_step: int
    """the outer step this sync completed (1 for the first sync)"""
    averaged: bool
    """False when no group formed and the peer applied its own pseudo-gradient"""
    group_size: int
    """peers in the group, this one included (1 when not averaged); a member whose parts the reducers refused (a
    bad or hostile peer, see averaging/allreduce.py) still counts, though nothing of it was averaged"""
    seconds: float
    """wall time of the whole sync: matchmaking, all-reduce and the outer step (streaming sync: the seconds the
    phase's fragment rounds held up training)"""
    bytes_sent: int = 0
    bytes_received: int = 0
    samples: int = 0
    """samples this peer trained on since the previous sync (its weight in the average)"""
    failed_fraction: float = 0.0
    """fraction of the vector whose reducer failed mid-round (those values are this peer's own)"""
    attempts: int = 1
    """matchmaking attempts (more than 1 only under the "wait" policy)"""
    group_outer_steps: List[int] = field(default_factory=list)
    """outer step each group member was on; differing values mean the peers were not in sync"""
    caught_up: bool = False
    """True when the peer was behind the swarm and took the state from live peers instead of averaging"""
    repaired: bool = False
    """True when the group's digests showed this peer's global parameters differed and it took the state anew"""
    mixed: bool = False
    """True when the group's members started from different global parameters (mixing groups, averaged in different
    groups last round) and averaged their stepped states (``RoundResult.mixed``)"""
    members: List[str] = field(default_factory=list)
    """the group's members (base58 ids, sorted, this peer included); empty when not averaged"""
    abandoned: bool = False
    """True when the peer was leaving and no group formed: no outer step was taken (``outer_step`` unchanged)"""
    digest: str = ""
    """digest of the global parameters after this sync: equal on every peer that committed the same round"""
    finished_at: float = 0.0
    """wall-clock time (time.time()) when the sync ended"""
    allreduce_s: float = 0.0
    """seconds of the all-reduce that was applied, from the group's forming; the rest of ``seconds`` is
    matchmaking (and earlier attempts), the outer step and the digest"""
    phases: Dict[str, float] = field(default_factory=dict)
    """where ``seconds`` went on this peer's critical path (``sync_phases``): publish, plan, pseudo_gradient,
    matchmaking, allreduce, outer_step, digest, record; and inside the all-reduce, the CPU seconds of its encode,
    decode, checks and write (``allreduce.*``, spread over threads that overlap the wire). A streaming sync's
    phase has: blocked (= ``seconds``), rounds (the fragments' rounds' wall time, mostly overlapped with training)
    and waited (for rounds still running at their apply step)"""
    inner_steps: int = 0
    """inner steps this peer took in the phase (fewer than local_steps with a stride, ``stride``)"""
    extra_steps: int = 0
    """streaming sync: of ``inner_steps``, those taken beyond the schedule while a round late at its apply step ran
    (they do not move the local step)"""
    stride: float = 1.0
    """the local steps one inner step counted for in the phase, on average: above 1 for a slow peer, which spreads
    the phase's local steps over fewer inner steps (p2ptrain/pace.py)"""
    step_s: Optional[float] = None
    """the median seconds of this peer's recent inner steps at the sync's end (what it publishes for the pace)"""
    fastest_step_s: Optional[float] = None
    """the shortest inner step among the other live peers' records then: a stride follows the ratio of the two"""
    peers_seen: List[int] = field(default_factory=list)
    """the other live peers each look at the progress records of this sync saw, in order (the last 16): the swarm as
    this peer saw it; a count below the others' is a partial view of the DHT"""
    fragments: List[dict] = field(default_factory=list)
    """streaming sync: each fragment's round in this phase (``StreamingSync._finish``): fragment, averaged,
    group_size, attempts, launched_at_step, applied_at_step, launched_at (wall clock), round_s, waited_s, blocked_s,
    allreduce_s, bytes_sent, bytes_received, weight, repaired. Empty for the blocking sync"""

    @classmethod
    def of(cls, result: Optional[RoundResult], **fields) -> "SyncRecord":
        """The record of a sync that applied ``result`` (None: nothing averaged), with the peer's own ``fields``."""
        if result is None:
            return cls(averaged=False, group_size=1, finished_at=time.time(), **fields)
        return cls(
            averaged=True, group_size=result.group_size, bytes_sent=result.bytes_sent,
            bytes_received=result.bytes_received, failed_fraction=result.failed_fraction,
            group_outer_steps=sorted(m.get("outer_step", -1) for m in result.gathered.values()),
            finished_at=time.time(), allreduce_s=result.allreduce_s, mixed=result.mixed,
            members=sorted(result.gathered), **fields,
        )

    def log(self, logger: logging.Logger, tag: str) -> None:
        if self.failed_fraction > 0:
            logger.warning(f"{tag} {self.failed_fraction:.1%} of the vector was not averaged (peer failure)")
        if len(set(self.group_outer_steps)) > 1:
            logger.warning(f"{tag} group members were at different outer steps {self.group_outer_steps}")
        logger.info(f"{tag} sync: group_size={self.group_size} seconds={self.seconds:.2f} "
                    f"sent={self.bytes_sent}B received={self.bytes_received}B")

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def sync_phases(seconds: Dict[str, float], result: Optional[RoundResult]) -> Dict[str, float]:
    """``SyncRecord.phases`` from a sync's clock: the rounds' wall time ("round"), less the all-reduce that was
    applied, is matchmaking (and failed attempts); the all-reduce's own split comes from ``result``."""
    phases = dict(seconds)
    if "round" in phases:
        phases["matchmaking"] = max(phases.pop("round") - (result.allreduce_s if result else 0.0), 0.0)
    if result is not None:
        phases["allreduce"] = result.allreduce_s
        phases.update({f"allreduce.{name}": value for name, value in result.phases.items()})
    return phases


def is_digest(value: Any) -> bool:
    """Whether ``value`` is what ``_digest_of`` returns: 32 lower-case hex digits."""
    return isinstance(value, str) and len(value) == 32 and all(c in "0123456789abcdef" for c in value)


def _digest_of(tensors: Iterable[torch.Tensor]) -> str:
    """A digest of the exact bits of ``tensors`` (their bytes, in order, shapes not included): 32 hex digits.

    xxh3-128, not a cryptographic hash: it only has to tell peers whose global parameters differ by as little as
    one bit (a bug, a bad copy), never to resist an adversary, who could send any digest it likes anyway. It hashes
    about 16 GB/s on one core against sha256's 1.5 GB/s (with the SHA extensions): 0.03 s instead of 0.3 s for the
    124m model's 486 MB, on every peer after every sync (benchmarks/bench_sync.py measures it)."""
    digest = xxhash.xxh3_128()
    for t in tensors:
        digest.update(_bytes_of(t))
    return digest.hexdigest()


def _bytes_of(tensor: torch.Tensor):
    """The raw bytes of a CPU tensor of any dtype (bf16 included), without a copy when it is contiguous."""
    return tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()


class Throughput:
    """Samples per second between two looks: ``samples`` is added to as the peer trains, ``update()`` closes the
    stretch (at a sync, or a progress refresh)."""

    def __init__(self):
        self.since, self.samples, self.per_s = time.monotonic(), 0, 0.0

    def update(self) -> None:
        now = time.monotonic()
        if now > self.since and self.samples:
            self.per_s = self.samples / (now - self.since)
        self.since, self.samples = now, 0
