"""The round policy as a pure function: what a peer at its sync point does next (wait, attempt a round with a planned
target and window, go alone, take the state, leave), from what the progress records show and the last attempt's
result. ``decide`` reads no clock, no DHT and no averager: ``Rounds.run`` (rounds.py) looks, asks it, and does what it
says. Each case is tested with a table (tests/unit/test_decide.py); docs/rounds.md says why each one is so."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Collection, FrozenSet, List, Mapping, Optional, Tuple, Union

from p2ptrain.averaging import RoundResult
from p2ptrain.diloco.records import Outcome, RoundOutcome, RoundOutlook
from p2ptrain.diloco.swarm_view import EVERYBODY, Position, mixing_group

FIRST_ROUND_WAIT_S = 30.0
"""the swarm's first round (outer step 0) with a ``target_group_size``: how long a peer at its sync point waits for
that many peers, counted from its first look. Peers started together still arrive seconds apart (imports, DHT,
the reachability probe: 8 workers started at once on 2 cores came up 8-17 s after their start); without this the
first ones averaged in a group of their own, and a peer that came later found the swarm a step ahead, took its state
and, one short phase later, was behind again"""
FORMING_LOOK_S = 1.0
"""mixing groups' first round: how often a peer whose cell still has members starting up reads the records again"""
MAX_INCOMPLETE_RETRIES = 2  # re-runs of a round that a member's failure left incomplete, under any policy
UNJOINABLE_ROUNDS = 3
"""peers at this sync point that did not group with us for this many times (averaging timeout + matchmaking window)
are stuck: this peer steps alone. Before that, only the first of them by id steps alone when a round cannot form
(``_first_to_go_alone``): the others take its state, so the swarm keeps one model"""
LATE_PEER_STALL_S = 30.0
"""a live peer of this outer step whose local step has not moved for this long is not waited for (it is stuck,
or still starting up: it catches up from the swarm's state when it gets to its sync)"""


@dataclass(frozen=True)
class RoundSettings:
    """How a peer looks for its group (the ``DiLoCoOptimizer`` arguments of the same names)."""

    no_group_policy: str
    matchmaking_time_s: float
    averaging_timeout_s: float
    late_peer_wait_s: Optional[float]
    min_group_size: int
    target_group_size: Optional[int]
    request_timeout_s: float
    """matchmaking requests time out well inside the matchmaking window (hivemind's deadlock breaker)"""
    mixing: bool = False
    """groups of at most ``target_group_size``, a new random partition each round (p2ptrain/mixing.py), so that
    every peer's state mixes with every other's within a few rounds; a group whose members start from different
    global parameters averages their stepped states (``RoundResult.mixed``)"""
    incomplete_settle_s: float = 1.0
    """after an incomplete round, how long the members that got every part have to say they committed it"""


def behind(outlook: RoundOutlook, settings: RoundSettings) -> bool:
    """Whether this round went on without this peer (then it takes the swarm's state instead of averaging). One group:
    any live peer ahead. Mixing groups: the other groups finish the round at their own pace, and members of our own cell
    that went on without us leave us to step alone (a later round mixes our state in: cheaper than throwing our inner
    steps away for a download); only two steps ahead, a whole phase, is behind. But a peer that may not step alone
    (``no_group_policy`` "wait") is behind as soon as the swarm is ahead and nobody is left at its outer step: nobody
    will ever average this round with it (it had waited for ever, and the peers a step ahead waited for it as late: seen
    when one member refused a reducer's range that the others committed)."""
    if not settings.mixing:
        return outlook.ahead
    if settings.no_group_policy == "wait" and outlook.ahead and not outlook.ready and not outlook.late:
        return True
    return outlook.far_ahead


def late_peer_wait_s(settings: RoundSettings, expected: int, phase_s: float, last: bool = False) -> float:
    """How long the ready peers wait for late ones. Waiting t seconds idles the ready peers, (expected - 1) * t compute-
    seconds; leaving a late peer out throws away its phase so far (``phase_s``), about phase - t: so the default waits
    up to a phase / expected (the break-even), and at least the matchmaking window. In the ``last`` round before this
    peer leaves, a whole phase: a late peer left out of the round that ends the run finds nobody to take the state
    from (docs/rounds.md). A bound the user set is kept."""
    if settings.late_peer_wait_s is not None:
        return settings.late_peer_wait_s
    return max(settings.matchmaking_time_s, phase_s if last else phase_s / max(expected, 2))


def plan_round(settings: RoundSettings, ready: List[str], late: List[str],
               late_left_s: float) -> Tuple[Optional[int], float]:
    """(target group size, matchmaking window) for one attempt. The group starts the moment it holds every
    live peer we expect; the window bounds the wait for the ones that are late."""
    if late and (late_left_s > 0 or not ready):
        # wait for the late ones too: until the bound while others are ready, else in windows, re-planned
        target, window_s = 1 + len(ready) + len(late), max(settings.matchmaking_time_s, late_left_s)
    else:
        target, window_s = (1 + len(ready) if ready else None), settings.matchmaking_time_s
    if settings.target_group_size is not None and target is not None:
        target = min(target, settings.target_group_size)
    if target is not None:
        target = max(target, settings.min_group_size)  # a group of fewer could not start anyway
    return (target if target is not None else settings.target_group_size), window_s


def follower_window_s(settings: RoundSettings, window_s: float, phase_s: float) -> float:
    """A client-mode peer's search window while another peer of its round is in sight. A client only follows, and a
    leader refuses a follower whose request expires before the leader's own declared time (hivemind's
    BAD_EXPIRATION_TIME) unless it completes the group: next to a leader waiting 30 s for a first round's group of 3, a
    client looking in 3 s windows was refused for 27 s. A long search costs a follower nothing: it joins the first
    leader that takes it, whose group starts when it is full. Longer than any window a leader plans, by a matchmaking
    window (a leader that started its own a moment later still expires first). With nobody of its round in sight the
    caller keeps the short window: a leaving client is not held up by its search."""
    return max(window_s, FIRST_ROUND_WAIT_S, late_peer_wait_s(settings, 2, phase_s)) + settings.matchmaking_time_s


def _first_to_go_alone(me: str, ready: Collection[str]) -> bool:
    """Of this peer and the ``ready`` ones that cannot group with it, is it the one that steps alone (the
    smallest id)? Every one of them draws the same, so exactly one goes on and the rest follow it."""
    return me < min(ready)


@dataclass(frozen=True)
class Ask:
    """What one ``Rounds.run`` was asked for; the same at every look. ``me``: this peer's id (base58);
    ``client_mode``: it is behind NAT, so it only follows, never leads a group."""

    me: str
    position: Position
    weight: float
    single_attempt: bool = False
    client_mode: bool = False


@dataclass(frozen=True)
class Look:
    """One look at the swarm: the records (merged, ``SwarmView``), the monotonic clock when they were read, and when
    a look last showed another live peer (``ProgressPublisher.others_seen_at``). ``leaving``: the peer is leaving
    (``interrupted``) and stops looking for peers; no records were read then."""

    outlook: Optional[RoundOutlook] = None
    now_s: float = 0.0
    others_seen_at_s: float = float("-inf")
    record_period_s: float = 5.0
    averager_alive: bool = True
    leaving: bool = False


@dataclass(frozen=True)
class Memory:
    """What this run's earlier looks and attempts left; ``decide`` returns the next one."""

    forming_until: Optional[float] = None
    """the swarm's first round: until when it waits for ``target_group_size`` peers (monotonic)"""
    attempts: int = 0
    incomplete_retries: int = 0
    excluded: FrozenSet[str] = frozenset()
    """members whose range failed a round of this sync: not counted in the target again. They still keep this peer
    from stepping alone: a failed round can also name a live member (one stuck behind the dead one)"""
    late_deadline: Optional[float] = None  # until when late peers are waited for: set at the first look
    last_moved: Mapping[str, Tuple[int, float]] = field(default_factory=dict)  # late peer -> (step, first seen)
    drawn_from: FrozenSet[str] = frozenset()  # mixing groups: every peer seen in this round's looks
    unjoinable_since: Optional[float] = None  # when ready peers first failed to group with us
    following_first: bool = False  # said that this peer waits for the first of the unjoinable ready peers

    @staticmethod
    def start(ask: Ask, settings: RoundSettings, now_s: float) -> "Memory":
        # the swarm's first round waits (bounded) for the group size the user named: its peers are still starting
        first = ask.position.outer_step == 0 and (settings.target_group_size or 0) > 1 and not ask.single_attempt
        return Memory(forming_until=now_s + FIRST_ROUND_WAIT_S if first else None)


@dataclass(frozen=True)
class Seen:
    """What an attempt was planned from: the facts of its look that the decision after it needs."""

    looked_at_s: float
    alone: bool
    ready_members: Tuple[str, ...]
    moving: bool
    forming: bool


@dataclass(frozen=True)
class Finish:
    """The run ends with ``outcome``; ``reason`` (if any) is logged at ``level`` first."""

    outcome: RoundOutcome
    reason: str = ""
    level: int = logging.INFO


@dataclass(frozen=True)
class LookAgain:
    """Read the records anew (after ``sleep_s``) and decide again. ``explain``: say first why no group can form."""

    sleep_s: float = 0.0
    reason: str = ""
    level: int = logging.INFO
    explain: bool = False


@dataclass(frozen=True)
class Attempt:
    """One matchmaking + all-reduce attempt: the plan the averager gets (``set_round_plan``), the window of this
    peer's own search (longer for a client-mode follower), the mixing key bits ("" for one group), the ready and the
    late peers it expects (-> their local step)."""

    target: Optional[int]
    window_s: float
    search_window_s: float
    bits: str
    ready: Tuple[str, ...]
    late: Mapping[str, int]
    seen: Seen
    reason: str = ""


@dataclass(frozen=True)
class Settle:
    """After an incomplete round: wait ``sleep_s`` for the members that got every part to say they committed it,
    then read the records (``read_records``) or only the swarm's outer step, into ``Attempted.settled``."""

    sleep_s: float
    read_records: bool


Action = Union[Finish, LookAgain, Attempt, Settle]


@dataclass(frozen=True)
class Settled:
    """What the records showed after the settle wait: the outlook (mixing groups) or the swarm's outer step."""

    outlook: Optional[RoundOutlook] = None
    swarm_outer_step: int = -1


@dataclass(frozen=True)
class Attempted:
    """The last attempt's result: ``result`` if the group averaged; ``went_on``: the swarm finished the round without
    us while we looked (``Rounds._wait_for_round``); ``incomplete``: a group met and a member failed mid-round.
    ``ended_at_s``: monotonic, after the attempt (and after the settle wait)."""

    attempt: Attempt
    ended_at_s: float
    result: Optional[RoundResult] = None
    went_on: bool = False
    incomplete: bool = False
    failed_members: FrozenSet[str] = frozenset()
    settled: Optional[Settled] = None


def decide(look: Look, last: Optional[Attempted], memory: Memory, ask: Ask,
           settings: RoundSettings) -> Tuple[Action, Memory]:
    """What to do next, and the memory after it. ``last``: None right after ``look``; else the result of the attempt
    planned from it (``look`` is not read again then)."""
    if last is not None:
        return _after_attempt(last, memory, ask, settings)
    if look.leaving:
        return _gave_up(memory), memory
    return _after_look(look, memory, ask, settings)


def _gave_up(memory: Memory) -> Finish:
    return Finish(RoundOutcome(Outcome.ALONE if memory.attempts == 0 else Outcome.NO_GROUP, memory.attempts))


def _after_look(look: Look, memory: Memory, ask: Ask, cfg: RoundSettings) -> Tuple[Action, Memory]:
    """Behind, alone, a look again for a mixing cell still forming, or an attempt planned from the records."""
    outlook, now, position = look.outlook, look.now_s, ask.position
    # mixing groups: this round's group among every live peer of this outer step; only its members count
    bits, members = "", EVERYBODY
    if cfg.mixing:
        bits, members, drawn_from = mixing_group(ask.me, position.outer_step, outlook, cfg.target_group_size,
                                                 memory.drawn_from)
        memory = replace(memory, drawn_from=drawn_from)
    if behind(outlook, cfg):
        return Finish(RoundOutcome(Outcome.BEHIND, memory.attempts)), memory
    last_moved = dict(memory.last_moved)
    for peer, local_step in outlook.late.items():
        if last_moved.get(peer, (None,))[0] != local_step:
            last_moved[peer] = (local_step, now)
    moving = [peer for peer in outlook.late if peer in members and now - last_moved[peer][1] < LATE_PEER_STALL_S]
    ready = [peer for peer in outlook.ready if peer not in memory.excluded and peer in members]
    late = [peer for peer in moving if peer not in memory.excluded]
    late_deadline = memory.late_deadline
    if late_deadline is None:
        late_deadline = now + late_peer_wait_s(cfg, 1 + len(ready) + len(late), now - position.phase_started,
                                               position.last)
    memory = replace(memory, last_moved=MappingProxyType(last_moved), late_deadline=late_deadline)
    ready_members = [peer for peer in outlook.ready if peer in members]
    alone = not ready_members and not moving and not ask.single_attempt and cfg.no_group_policy == "apply_local"
    # ... but looks once when others may yet be there with no record to show for it: in a new swarm's first round
    # (they may still be starting), or when this peer saw another live peer recently (a record slow to store, or a
    # read that timed out, must not make it step alone next to that peer; not seen for two record periods, it is gone)
    recently = now - look.others_seen_at_s < 2 * look.record_period_s
    # while fewer than G are at the sync point: in the first round the late ones are peers still starting, and the
    # late-peer bound started the group without them (27 of 32 workers on 16 cores). Until a peer has finished that
    # round: then nobody is waiting to form it (a mixing cell whose other member stepped alone kept its partner
    # waiting out the 30 s)
    forming_until = memory.forming_until
    forming = forming_until is not None and now < forming_until and not outlook.next_step and \
        1 + len(ready) < min(cfg.target_group_size, len(members) if bits else cfg.target_group_size)
    # (a mixing cell of one has nobody to wait for either; members of our cell a step ahead averaged without us)
    lone_cell = bool(bits) and not [p for p in members if p not in outlook.next_step and p != ask.me]
    attempts = memory.attempts
    if alone and (lone_cell or position.outer_step > 0 and not recently or attempts > 0) and not forming:
        reason = ""
        if attempts == 0 and lone_cell:
            reason = (f"no other member of this peer's mixing group is left at outer step {position.outer_step}: "
                      "stepping alone (a later round mixes this state in)")
        elif attempts == 0:
            reason = f"no other live peer is at outer step {position.outer_step}: not looking for a group"
        elif not memory.excluded:
            why = "peers still starting" if position.outer_step == 0 else "a peer seen moments ago"
            reason = (f"looked once for {why}; no other live peer is at outer step {position.outer_step}: not "
                      "looking for a group")
        # (after a group that failed mid-round, going on alone is a round that did not form: NO_GROUP)
        return Finish(RoundOutcome(Outcome.NO_GROUP if memory.excluded else Outcome.ALONE, attempts), reason), memory
    if forming and bits and late:
        # mixing groups' first round: a cell member still starting is waited for without matchmaking, looking
        # again every second (the cells are drawn anew with each look, as more peers show up); a matchmaking
        # window would either start the group without it or hold a cell the next look no longer draws
        return LookAgain(sleep_s=min(FORMING_LOOK_S, max(forming_until - now, 0.0))), memory
    memory = replace(memory, attempts=attempts + 1)
    if not look.averager_alive:
        return Finish(RoundOutcome(Outcome.NO_GROUP, memory.attempts),
                      "the averager process is gone; this peer can no longer average", logging.ERROR), memory
    target, window_s = plan_round(cfg, ready, late, late_deadline - now)
    reason = ""
    if forming:
        if memory.attempts == 1:
            reason = (f"the swarm's first round: waiting up to {FIRST_ROUND_WAIT_S:.0f}s for {cfg.target_group_size} "
                      f"peers (--target-group-size); {1 + len(ready)} at the sync point, {len(late)} on their way")
        target = min(cfg.target_group_size, len(members)) if bits else cfg.target_group_size
        # mixing groups: the cells change as more peers show up, so look again after each matchmaking window
        # instead of waiting for a cell that the next look may no longer draw
        window_s = max(window_s, (forming_until - now) if not bits else min(forming_until - now,
                                                                             cfg.matchmaking_time_s))
    search_window_s = window_s
    if ask.client_mode and (ready or late):
        search_window_s = follower_window_s(cfg, window_s, now - position.phase_started)
    seen = Seen(looked_at_s=now, alone=alone, ready_members=tuple(ready_members), moving=bool(moving),
                forming=forming)
    return Attempt(target, window_s, search_window_s, bits, tuple(ready),
                   MappingProxyType({p: outlook.late[p] for p in late}), seen, reason), memory


def _after_attempt(last: Attempted, memory: Memory, ask: Ask, cfg: RoundSettings) -> Tuple[Action, Memory]:
    """What the attempt's result means: done, settle and retry an incomplete round, wait on, or go on alone."""
    attempts = memory.attempts
    if last.went_on:
        return Finish(RoundOutcome(Outcome.BEHIND, attempts)), memory
    if last.result is not None:
        return Finish(RoundOutcome(Outcome.AVERAGED, attempts, last.result)), memory
    if ask.single_attempt:
        return _gave_up(memory), memory
    if last.incomplete and last.settled is None:
        # a member died mid-round: nothing was applied here. Members that got every part may have committed
        # the round; give them a moment to say so (then we take their state), else run it again with the
        # survivors, without waiting for the members whose range failed. Never fall back to our own
        # pseudo-gradient here: the survivors would each apply a different one.
        # (a group met: the swarm is formed, and the survivors go again now, without the first round's wait)
        memory = replace(memory, excluded=memory.excluded | last.failed_members, forming_until=None)
        return Settle(cfg.incomplete_settle_s, read_records=cfg.mixing), memory
    if last.incomplete:
        if behind(last.settled.outlook, cfg) if cfg.mixing else \
                last.settled.swarm_outer_step > ask.position.outer_step:
            return Finish(RoundOutcome(Outcome.BEHIND, attempts)), memory
        if memory.incomplete_retries < MAX_INCOMPLETE_RETRIES:
            retries = memory.incomplete_retries + 1
            return LookAgain(reason=f"a group member failed mid-round; running the round again with the survivors "
                                    f"(retry {retries}/{MAX_INCOMPLETE_RETRIES})", level=logging.WARNING), \
                replace(memory, incomplete_retries=retries)
    seen = last.attempt.seen
    if seen.alone and not last.incomplete:
        return LookAgain(), memory  # the look made while nobody else was there: a fresh one says whether anybody came
    ready_members = seen.ready_members
    since = None if not ready_members else seen.looked_at_s if memory.unjoinable_since is None else \
        memory.unjoinable_since
    memory = replace(memory, unjoinable_since=since)
    if cfg.no_group_policy != "apply_local":
        return LookAgain(reason=f"no group formed (attempt {attempts}); waiting for peers (no_group_policy=wait)",
                         level=logging.WARNING, explain=True), memory
    if seen.moving and not ready_members or \
            seen.forming and memory.forming_until is not None and last.ended_at_s < memory.forming_until:
        return LookAgain(), memory  # the others are still training (or starting) and making progress: wait for them
    # peers at the sync point that did not group with us are in a round of their own (a failed one
    # takes at most the averaging timeout) or refuse us: wait that long, then go on
    # (a peer with weight 0 adds nothing: a group of such peers is refused by all its members alike, so
    # waiting for one is pointless)
    round_s = cfg.averaging_timeout_s + cfg.matchmaking_time_s
    unjoinable_s = seen.looked_at_s - since if ready_members else 0.0
    if ready_members and ask.weight > 0 and unjoinable_s < round_s:
        return LookAgain(), memory
    # never step alone next to a peer at this sync point (two models), but the first of us by id, whom
    # the others then follow by taking its state; a peer that stays unjoinable for longer is stuck
    if ready_members and not _first_to_go_alone(ask.me, ready_members) and unjoinable_s < UNJOINABLE_ROUNDS * round_s:
        if memory.following_first:
            return LookAgain(), memory
        return LookAgain(reason=f"{len(ready_members)} peer(s) at this sync point did not group with this one; "
                                "waiting for the first of them by id to step, then taking its state (one model)"), \
            replace(memory, following_first=True)
    return _gave_up(memory), memory
