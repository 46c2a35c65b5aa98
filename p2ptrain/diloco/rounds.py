"""How a sync finds its group: the round's plan from the live peers' progress records, the matchmaking and
all-reduce attempts, and what their results mean (``Rounds``: ``DiLoCoOptimizer`` holds one and asks it for an
outcome; it knows the optimizer only through what each call passes in)."""

from __future__ import annotations

import logging
import time
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, Iterable, List, Optional

from hivemind.averaging.control import AveragingStage
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.utils import get_dht_time

from p2ptrain.averaging import RoundResult
from p2ptrain.diloco.records import Outcome, RoundOutcome, RoundOutlook
from p2ptrain.mixing import cells_of, key_bits
from p2ptrain.swarm.progress import PeerProgress

logger = logging.getLogger(__package__)  # one logger name for the whole optimizer, as users grep for it

FIRST_ROUND_WAIT_S = 30.0
"""the swarm's first round (outer step 0) with a ``target_group_size``: how long a peer at its sync point waits for
that many peers, counted from its first look. Peers started together still arrive seconds apart (imports, DHT,
the reachability probe: 8 workers started at once on 2 cores came up 8-17 s after their start); without this the
first ones averaged in a group of their own, and a peer that came later found the swarm a step ahead, took its state
and, one short phase later, was behind again"""
FORMING_LOOK_S = 1.0
"""mixing groups' first round: how often a peer whose cell still has members starting up reads the records again"""
MAX_INCOMPLETE_RETRIES = 2  # re-runs of a round that a member's failure left incomplete, under any policy
BEHIND_POLL_S = 0.5
"""while a peer looks for its group, how often it reads the records to see whether the swarm went on without it. A
round of the tiny model takes 0.1 s and a phase 0.6 s on 2 cores: a newcomer that waited out a 3-5 s matchmaking
window for a round that had already started fell 6-7 outer steps behind each time, and never averaged (CI); two
newcomers waiting for the same stale round formed a group of their own after it (a second model, CI)"""
UNJOINABLE_ROUNDS = 3
"""peers at this sync point that did not group with us for this many times (averaging timeout + matchmaking window)
are stuck: this peer steps alone. Before that, only the first of them by id steps alone when a round cannot form
(``Rounds._first_to_go_alone``): the others take its state, so the swarm keeps one model"""
LATE_PEER_STALL_S = 30.0
"""a live peer of this outer step whose local step has not moved for this long is not waited for (it is stuck,
or still starting up: it catches up from the swarm's state when it gets to its sync)"""


class _Everybody:
    """Every peer is a member (the swarm is one group)."""

    def __contains__(self, peer: object) -> bool:
        return True

    def __len__(self) -> int:
        raise TypeError("everybody has no size")


_EVERYBODY = _Everybody()
_WENT_ON = object()  # an attempt stopped because the swarm moved past its round (Rounds._wait_for_round)


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

    @property
    def group_bits(self) -> str:
        """The matchmaking key's bits: peers only group with peers at the same outer step (and fragment), so a peer
        that fell behind finds nobody and catches up instead of averaging against stale parameters."""
        bits = format(self.outer_step % 256, "08b")
        if self.fragments > 1:
            bits += format(self.fragment, f"0{(self.fragments - 1).bit_length()}b")
        return bits


class Rounds:
    """Runs one sync's rounds over an averager and returns an outcome value; it holds no training state."""

    def __init__(self, averager, dht, run_id: str, progress, settings: RoundSettings,
                 interrupted: threading.Event, tag: Callable[[], str]):
        self.averager, self.dht, self.run_id, self.progress = averager, dht, run_id, progress
        self.settings = settings
        self._interrupted = interrupted  # set: the peer is leaving, stop looking for peers
        self._tag = tag
        self._explained_no_group_at = -math.inf
        self._recent: Dict[str, tuple] = {}  # peer id -> (its latest record read, when), for ``_merged``
        self.peers_seen: List[int] = []
        """the other live peers each look saw since the caller last emptied it (once a sync): a short count is a
        partial view"""

    def run(self, weight: float, position: Position, *, single_attempt: bool = False,
            outlook: Optional[RoundOutlook] = None) -> RoundOutcome:
        """Run averaging attempts until a group averages, or this peer must go on without one.

        Each attempt is planned from the progress records (``_plan_round``): its group starts as soon as every live
        peer of this outer step is in, and waits a bounded time for those still in their inner steps. Under
        "apply_local", a peer goes on alone only when no other live peer is at its outer step: a solo outer step
        next to such a peer would throw all of that peer's inner steps away (it would have to take our state).
        Under "wait" it never goes on alone. ``outlook``: the records as the caller just read them (else read here).
        """
        cfg = self.settings
        attempts, incomplete_retries = 0, 0
        following_first = False  # said that this peer waits for the first of the unjoinable ready peers
        unjoinable_since: Optional[float] = None  # when ready peers first failed to group with us
        # members whose range failed a round of this sync: not counted in the target again. They still keep this
        # peer from stepping alone: a failed round can also name a live member (one stuck behind the dead one)
        excluded: set = set()
        late_deadline = None  # set at the first look, from how many peers are expected
        # mixing groups: every peer seen in this round's looks. A member of another group that finished the round and
        # left (its record withdrawn) still counts, or every peer after it in the round's order would change cells
        drawn_from: set = set()
        last_moved: Dict[str, tuple] = {}  # late peer -> (its local step, when we first saw it there)
        # the swarm's first round waits (bounded) for the group size the user named: its peers are still starting
        forming_until = time.monotonic() + FIRST_ROUND_WAIT_S \
            if position.outer_step == 0 and (cfg.target_group_size or 0) > 1 and not single_attempt else None
        while not self._interrupted.is_set():
            outlook = outlook if outlook is not None and attempts == 0 else self.outlook(position)
            # mixing groups: this round's group among every live peer of this outer step; only its members count
            bits, members = self._mixing_group(position, outlook, drawn_from)
            if self.behind(outlook):
                return RoundOutcome(Outcome.BEHIND, attempts)
            now = time.monotonic()
            for peer, local_step in outlook.late.items():
                if last_moved.get(peer, (None,))[0] != local_step:
                    last_moved[peer] = (local_step, now)
            moving = [peer for peer in outlook.late
                      if peer in members and now - last_moved[peer][1] < LATE_PEER_STALL_S]
            ready = [peer for peer in outlook.ready if peer not in excluded and peer in members]
            late = [peer for peer in moving if peer not in excluded]
            if late_deadline is None:
                late_deadline = now + self._late_peer_wait_s(1 + len(ready) + len(late), position.phase_started)
            ready_members = [peer for peer in outlook.ready if peer in members]
            alone = not ready_members and not moving and not single_attempt and cfg.no_group_policy == "apply_local"
            # ... but looks once when others may yet be there with no record to show for it: in a new swarm's first
            # round (they may still be starting), or when this peer saw another live peer recently (a record that
            # was slow to store, or a read that timed out, must not make it step alone next to that peer)
            # (a live peer refreshes its record every period: not seen for two of them, it is gone)
            recently = time.monotonic() - self.progress.others_seen_at < 2 * self.progress.period_s
            # while fewer than G are at the sync point: in the first round the late ones are peers still starting,
            # and the late-peer bound started the group without them (27 of 32 workers on 16 cores)
            # ... until a peer has finished that round: then the round is under way, and nobody is waiting to form it
            # (a mixing cell whose other member stepped alone kept its partner waiting out the 30 s)
            forming = forming_until is not None and now < forming_until and not outlook.next_step and \
                1 + len(ready) < min(cfg.target_group_size, len(members) if bits else cfg.target_group_size)
            # (a mixing group of one, this peer alone in its cell, has nobody to wait for either)
            # (members of our cell one step ahead averaged without us: they are not coming)
            lone_cell = bool(bits) and not [p for p in members if p not in outlook.next_step and p != self._me()]
            if alone and (lone_cell or position.outer_step > 0 and not recently or attempts > 0) and not forming:
                if attempts == 0 and lone_cell:
                    logger.info(f"{self._tag()} no other member of this peer's mixing group is left at outer step "
                                f"{position.outer_step}: stepping alone (a later round mixes this state in)")
                elif attempts == 0:
                    logger.info(f"{self._tag()} no other live peer is at outer step {position.outer_step}: not "
                                "looking for a group")
                elif not excluded:
                    why = "peers still starting" if position.outer_step == 0 else "a peer seen moments ago"
                    logger.info(f"{self._tag()} looked once for {why}; no other live peer is at outer step "
                                f"{position.outer_step}: not looking for a group")
                # (after a group that failed mid-round, going on alone is a round that did not form: NO_GROUP)
                return RoundOutcome(Outcome.NO_GROUP if excluded else Outcome.ALONE, attempts)
            if forming and bits and late:
                # mixing groups' first round: a cell member still starting is waited for without matchmaking, looking
                # again every second (the cells are drawn anew with each look, as more peers show up); a matchmaking
                # window would either start the group without it or hold a cell the next look no longer draws
                time.sleep(min(FORMING_LOOK_S, max(forming_until - now, 0.0)))
                outlook = None
                continue
            attempts += 1
            if not self.averager.is_alive():
                logger.error(f"{self._tag()} the averager process is gone; this peer can no longer average")
                break
            target, window_s = self._plan_round(ready, late, late_deadline - now)
            if forming:
                if attempts == 1:
                    logger.info(f"{self._tag()} the swarm's first round: waiting up to {FIRST_ROUND_WAIT_S:.0f}s for "
                                f"{cfg.target_group_size} peers (--target-group-size); {1 + len(ready)} at the sync "
                                f"point, {len(late)} on their way")
                target = min(cfg.target_group_size, len(members)) if bits else cfg.target_group_size
                # mixing groups: the cells change as more peers show up, so look again after each matchmaking window
                # instead of waiting for a cell that the next look may no longer draw
                window_s = max(window_s, (forming_until - now) if not bits else
                               min(forming_until - now, cfg.matchmaking_time_s))
            self.averager.set_round_plan(target, window_s, expected=[*ready, *late],
                                         max_group_size=cfg.target_group_size, fragment=position.fragment)
            logger.debug(f"{self._tag()} attempt {attempts}: ready {[p[-8:] for p in ready]}, late "
                         f"{ {p[-8:]: outlook.late[p] for p in late} } at local step {position.local_step}: "
                         f"target {target}, window {window_s:.1f}s")
            incomplete_before = self.averager.incomplete_rounds
            if self.averager.client_mode and (ready or late):
                window_s = self._follower_window_s(window_s, position)
            result = self._attempt(weight, position, target, window_s, attempts, mixing_bits=bits)
            if result is _WENT_ON:
                return RoundOutcome(Outcome.BEHIND, attempts)
            if result is not None:
                return RoundOutcome(Outcome.AVERAGED, attempts, result)
            if single_attempt:
                break
            incomplete = self.averager.incomplete_rounds != incomplete_before
            if incomplete:
                # a member died mid-round: nothing was applied here. Members that got every part may have committed
                # the round; give them a moment to say so (then we take their state), else run it again with the
                # survivors, without waiting for the members whose range failed. Never fall back to our own
                # pseudo-gradient here: the survivors would each apply a different one.
                excluded |= self.averager.last_failed_members
                forming_until = None  # a group met: the swarm is formed, and the survivors go again now
                time.sleep(cfg.incomplete_settle_s)
                if self.behind(self.outlook(position)) if cfg.mixing else \
                        self.swarm_outer_step() > position.outer_step:
                    return RoundOutcome(Outcome.BEHIND, attempts)
                if incomplete_retries < MAX_INCOMPLETE_RETRIES:
                    incomplete_retries += 1
                    logger.warning(f"{self._tag()} a group member failed mid-round; running the round again with "
                                   f"the survivors (retry {incomplete_retries}/{MAX_INCOMPLETE_RETRIES})")
                    continue
            if alone and not incomplete:
                continue  # the look made while nobody else was there: a fresh one says whether anybody came
            if not ready_members:
                unjoinable_since = None
            elif unjoinable_since is None:
                unjoinable_since = now
            if cfg.no_group_policy == "apply_local":
                if moving and not ready_members or forming and time.monotonic() < forming_until:
                    continue  # the others are still training (or starting) and making progress: wait for them
                # peers at the sync point that did not group with us are in a round of their own (a failed one
                # takes at most the averaging timeout) or refuse us: wait that long, then go on
                # (a peer with weight 0 adds nothing: a group of such peers is refused by all its members alike, so
                # waiting for one is pointless)
                unjoinable_s = now - unjoinable_since if ready_members else 0.0
                if ready_members and weight > 0 and unjoinable_s < cfg.averaging_timeout_s + cfg.matchmaking_time_s:
                    continue
                # never step alone next to a peer at this sync point (two models), but the first of us by id, whom
                # the others then follow by taking its state; a peer that stays unjoinable for longer is stuck
                if ready_members and not self._first_to_go_alone(ready_members) and \
                        unjoinable_s < UNJOINABLE_ROUNDS * (cfg.averaging_timeout_s + cfg.matchmaking_time_s):
                    if not following_first:
                        following_first = True
                        logger.info(f"{self._tag()} {len(ready_members)} peer(s) at this sync point did not group "
                                    "with this one; waiting for the first of them by id to step, then taking its "
                                    "state (one model)")
                    continue
                break
            self.explain_no_group()
            logger.warning(
                f"{self._tag()} no group formed (attempt {attempts}); waiting for peers (no_group_policy=wait)"
            )
        return RoundOutcome(Outcome.ALONE if attempts == 0 else Outcome.NO_GROUP, attempts)

    def _first_to_go_alone(self, ready: Collection[str]) -> bool:
        """Of this peer and the ``ready`` ones that cannot group with it, is it the one that steps alone (the
        smallest id)? Every one of them draws the same, so exactly one goes on and the rest follow it."""
        return self._me() < min(ready)

    def _follower_window_s(self, window_s: float, position: Position) -> float:
        """A client-mode peer's search window while another peer of its round is in sight. A client only follows, and
        a leader refuses a follower whose request expires before the leader's own declared time (hivemind's
        BAD_EXPIRATION_TIME) unless it completes the group: next to a leader waiting 30 s for a first round's group
        of 3, a client looking in 3 s windows was refused for 27 s. A long search costs a follower nothing: it joins
        the first leader that takes it, whose group starts when it is full. Longer than any window a leader plans, by
        a matchmaking window (a leader that started its own a moment later still expires first). With nobody of its
        round in sight the caller keeps the short window: a leaving client is not held up by its search."""
        return max(window_s, FIRST_ROUND_WAIT_S, self._late_peer_wait_s(2, position.phase_started)) + \
            self.settings.matchmaking_time_s

    def _late_peer_wait_s(self, expected: int, phase_started: float) -> float:
        """How long the ready peers wait for late ones. Waiting t seconds idles the ready peers, (expected - 1) * t
        compute-seconds; leaving a late peer out throws away its phase so far, about phase - t: so the default waits
        up to a phase / expected (the break-even), and at least the matchmaking window."""
        if self.settings.late_peer_wait_s is not None:
            return self.settings.late_peer_wait_s
        return max(self.settings.matchmaking_time_s, (time.monotonic() - phase_started) / max(expected, 2))

    def _plan_round(self, ready: List[str], late: List[str], late_left_s: float) -> tuple[Optional[int], float]:
        """(target group size, matchmaking window) for one attempt. The group starts the moment it holds every
        live peer we expect; the window bounds the wait for the ones that are late."""
        cfg = self.settings
        if late and (late_left_s > 0 or not ready):
            # wait for the late ones too: until the bound while others are ready, else in windows, re-planned
            target, window_s = 1 + len(ready) + len(late), max(cfg.matchmaking_time_s, late_left_s)
        else:
            target, window_s = (1 + len(ready) if ready else None), cfg.matchmaking_time_s
        if cfg.target_group_size is not None and target is not None:
            target = min(target, cfg.target_group_size)
        if target is not None:
            target = max(target, cfg.min_group_size)  # a group of fewer could not start anyway
        return (target if target is not None else cfg.target_group_size), window_s

    def behind(self, outlook: RoundOutlook) -> bool:
        """Whether this round went on without this peer (then it takes the swarm's state instead of averaging).
        One group: any live peer ahead. Mixing groups: the other groups finish the round at their own pace, and
        members of our own cell that went on without us leave us to step alone (a later round mixes our state in:
        cheaper than throwing our inner steps away for a download); only two steps ahead, a whole phase, is behind.
        But a peer that may not step alone (``no_group_policy`` "wait") is behind as soon as the swarm is ahead and
        nobody is left at its outer step: nobody will ever average this round with it (it had waited for ever, and
        the peers a step ahead waited for it as late: seen when one member refused a reducer's range that the
        others committed)."""
        if not self.settings.mixing:
            return outlook.ahead
        if self.settings.no_group_policy == "wait" and outlook.ahead and not outlook.ready and not outlook.late:
            return True
        return outlook.far_ahead

    def _mixing_group(self, position: Position, outlook: RoundOutlook,
                      drawn_from: Optional[set] = None) -> tuple[str, Collection[str]]:
        """This round's mixing group (``settings.mixing``): its matchmaking key bits (added to the outer step's) and
        its members. The cells are drawn from every live peer that is in this round or its neighbours (ready or late
        at this outer step, stalled or excluded ones too, the ones still averaging the round before, and the ones
        whose group finished this round already), so that every peer of the round, whenever it reads the records,
        draws the same cells. ``drawn_from``: the peers of this round's earlier looks, kept and added to. ("",
        everybody) when the swarm is one group."""
        if not self.settings.mixing:
            return "", _EVERYBODY
        me = self._me()
        peers = {me, *outlook.ready, *outlook.late, *outlook.next_step, *outlook.previous_step}
        if drawn_from is not None:
            drawn_from |= peers
            peers = drawn_from
        keys = cells_of(peers, self.settings.target_group_size, position.outer_step)  # one sort, not one a peer
        if not keys:
            return "", _EVERYBODY
        return key_bits(keys[me]), {peer for peer, key in keys.items() if key == keys[me]}

    def _me(self) -> str:
        return self.dht.peer_id.to_base58()

    def _attempt(self, weight: float, position: Position, target: Optional[int], window_s: float,
                 attempt: int, mixing_bits: str = "") -> Optional[RoundResult] | object:
        """One matchmaking + all-reduce attempt; None if it formed no group or failed (logged at debug level: the
        caller decides what a failure means), ``_WENT_ON`` if the swarm finished the round without us meanwhile."""
        try:
            self.averager.set_group_bits(position.group_bits + mixing_bits)
            # the leader waits window_s for followers; allow a request timeout on top
            matchmaking_timeout_s = window_s + self.settings.request_timeout_s + 1.0
            control = self.averager.step(
                weight=weight,
                gather=position.gather,
                scheduled_time=get_dht_time() + window_s,
                timeout=matchmaking_timeout_s,
                allow_retries=True,
                wait=False,
            )
            # bounded even if the averager process dies mid-round: then this raises TimeoutError
            result = self._wait_for_round(control, position,
                                          matchmaking_timeout_s + self.settings.averaging_timeout_s + 10.0)
            if result is _WENT_ON or isinstance(result, RoundResult):
                return result
        except (AllreduceException, MatchmakingException, TimeoutError, RuntimeError) as e:
            logger.debug(f"{self._tag()} averaging attempt {attempt} failed: {e!r}")
        except Exception as e:  # a network failure is a value: log it, never let it kill training
            logger.warning(f"{self._tag()} averaging attempt {attempt} failed unexpectedly: {e!r}")
        return None

    def _wait_for_round(self, control, position: Position, timeout_s: float):
        """The step's result. While it is still looking for a group, the records are read every ``BEHIND_POLL_S``:
        once they show the swarm went on without this peer (``behind``), the step is cancelled (hivemind's leader
        disbands what it gathered) and ``_WENT_ON`` returned, instead of waiting out the matchmaking window for a
        round that is over. A peer that is leaving (``interrupted``) stops looking at once too (None). Never once the
        all-reduce began: the group would lose a member mid-round."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return control.result(timeout=min(BEHIND_POLL_S, max(deadline - time.monotonic(), 0.0)))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
            if control.stage is not AveragingStage.LOOKING_FOR_GROUP:
                continue
            if self._interrupted.is_set():  # leaving: stop looking now, not at the end of the window
                control.cancel()
                return None
            if self.behind(self.outlook(position)) and control.stage is AveragingStage.LOOKING_FOR_GROUP:
                control.cancel()
                logger.debug(f"{self._tag()} the swarm went on past outer step {position.outer_step} while this "
                             "peer looked for its group: stopped looking")
                return _WENT_ON

    def outlook(self, position: Position) -> RoundOutlook:
        """Read the run's progress records: is the swarm ahead, and who at this outer step is ready or late."""
        records = self.progress.others(5.0, leaving=True)
        if any(not r.leaving for r in records):
            self.progress.others_seen_at = time.monotonic()
        return outlook_of(self._merged(records), position.outer_step, position.local_step, position.last_group,
                          position.applied_by, mixing=self.settings.mixing)

    def _merged(self, records: List[PeerProgress]) -> List[PeerProgress]:
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

    def explain_no_group(self) -> None:
        """If no group can form because no live peer can lead one (all behind NAT, in client mode), say so: at
        most once a minute, instead of waiting in silence."""
        if not self.averager.client_mode or time.monotonic() - self._explained_no_group_at < 60.0:
            return
        others = self.progress.others(5.0)
        if any(not r.client_mode for r in others):
            return
        self._explained_no_group_at = time.monotonic()
        who = (f"so are all {len(others)} other live peer(s) of run {self.run_id!r}" if others else
               f"no other peer of run {self.run_id!r} is live")
        logger.error(
            f"{self._tag()} no group can form: this peer is behind NAT (client mode) and {who}; only a peer that "
            "others can dial can lead a group and reduce its parts: start at least one worker on a host with a "
            "public IP or a forwarded port (README, 'Behind NAT')"
        )

