"""The round policy as a table: ``round_policy.decide`` from one look (or the last attempt's result) and the run's
memory to the next action, with no clock, network or averager. Each row is a case the swarm tests and the soak of
the one-model issue (34) met; tests/unit/test_round_policy.py runs the same policy through ``Rounds.run``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Optional

import pytest

from p2ptrain.averaging import RoundResult
from p2ptrain.diloco.records import Outcome, RoundOutlook
from p2ptrain.diloco.round_policy import (Ask, Attempt, Attempted, Finish, Look, LookAgain, Memory, RoundSettings,
                                          Seen, Settle, Settled, decide)
from p2ptrain.diloco.swarm_view import Position
from p2ptrain.mixing import groups_of

NOW = 100.0  # the look's monotonic clock; every phase began at 40.0 (a 60 s phase so far)
(LONE,), PAIR = sorted(groups_of(list("ABC"), 2, 5), key=len)  # mixing groups of 2 among 3 peers at outer step 5
MINE, = [g for g in groups_of(list("ABCD"), 2, 0) if "A" in g]  # A's cell among 4 peers at outer step 0
MATE, = [p for p in MINE if p != "A"]
OTHERS = [p for p in "BCD" if p != MATE]
RESULT = RoundResult(group_size=2)
ALONE_5 = "no other live peer is at outer step 5: not looking for a group"
FOLLOW = ("1 peer(s) at this sync point did not group with this one; waiting for the first of them by id to step, "
          "then taking its state (one model)")


def look(ready=(), late=None, ahead=False, next_step=(), far_ahead=False, **kwargs) -> Look:
    outlook = RoundOutlook(ahead=ahead, ready=list(ready), late=dict(late or {}), next_step=list(next_step),
                           far_ahead=far_ahead)
    return Look(outlook=outlook, **{"now_s": NOW, **kwargs})


def attempted(ready_members=(), alone=False, moving=False, forming=False, **kwargs) -> Attempted:
    seen = Seen(looked_at_s=NOW, alone=alone, ready_members=tuple(ready_members), moving=moving, forming=forming)
    plan = Attempt(target=2, window_s=2.0, search_window_s=2.0, bits="", ready=tuple(ready_members), late={},
                   seen=seen)
    return Attempted(plan, **{"ended_at_s": NOW + 2.0, **kwargs})


@dataclass
class Case:
    id: str
    look: Look = field(default_factory=look)
    last: Optional[Attempted] = None
    memory: Dict[str, Any] = field(default_factory=dict)
    ask: Dict[str, Any] = field(default_factory=dict)
    cfg: Dict[str, Any] = field(default_factory=dict)
    want: type = Finish
    outcome: Optional[tuple] = None  # Finish: (kind, attempts)
    fields: Dict[str, Any] = field(default_factory=dict)  # the action's fields that must hold these values
    then: Dict[str, Any] = field(default_factory=dict)  # the memory's fields after it


CASES = [
    # what the records show before an attempt
    Case("a ready peer: the group starts with both of us, in a plain window", look(ready=["C"]), want=Attempt,
         fields=dict(target=2, window_s=2.0, search_window_s=2.0, ready=("C",), bits=""), then=dict(attempts=1)),
    Case("the target is capped by target_group_size, at least min_group_size", look(ready=["C", "D", "E"]),
         cfg=dict(target_group_size=2, min_group_size=2), want=Attempt, fields=dict(target=2)),
    Case("a late peer next to a ready one is waited for until the bound (a phase / the peers expected)",
         look(ready=["C"], late={"D": 90}), want=Attempt, fields=dict(target=3, window_s=20.0, late={"D": 90}),
         then=dict(late_deadline=NOW + 20.0, last_moved={"D": (90, NOW)})),
    Case("a late peer with nobody else ready is waited for in windows", look(late={"D": 90}), want=Attempt,
         fields=dict(target=2, window_s=30.0)),
    Case("past the bound the ready peers start without the late one", look(ready=["C"], late={"D": 90}),
         memory=dict(late_deadline=NOW - 10.0), want=Attempt, fields=dict(target=2, window_s=2.0)),
    Case("late_peer_wait_s set: the bound is that", look(ready=["C"], late={"D": 90}), cfg=dict(late_peer_wait_s=5.0),
         want=Attempt, fields=dict(target=3, window_s=5.0)),
    Case("the last round before this peer leaves waits a whole phase for a late peer (it could take the state from "
         "nobody after it)", look(ready=["C"], late={"D": 90}), ask=dict(last=True), want=Attempt,
         fields=dict(target=3, window_s=60.0), then=dict(late_deadline=NOW + 60.0)),
    Case("... and past that bound starts without it", look(ready=["C"], late={"D": 90}), ask=dict(last=True),
         memory=dict(late_deadline=NOW - 1.0), want=Attempt, fields=dict(target=2, window_s=2.0)),
    Case("... but a late_peer_wait_s the user set is kept", look(ready=["C"], late={"D": 90}), ask=dict(last=True),
         cfg=dict(late_peer_wait_s=5.0), want=Attempt, fields=dict(target=3, window_s=5.0)),
    Case("... and a stalled late peer is not waited for in it either", look(ready=["C"], late={"D": 90}),
         ask=dict(last=True), memory=dict(last_moved={"D": (90, NOW - 50.0)}), want=Attempt,
         fields=dict(target=2, window_s=2.0)),
    Case("a late peer whose local step has not moved for 30 s is not waited for: alone", look(late={"D": 90}),
         memory=dict(last_moved={"D": (90, NOW - 50.0)}), outcome=(Outcome.ALONE, 0), fields=dict(reason=ALONE_5)),
    Case("alone in the swarm: no matchmaking", outcome=(Outcome.ALONE, 0), fields=dict(reason=ALONE_5)),
    Case("alone in a new swarm's first round: one look for peers still starting", ask=dict(outer_step=0),
         want=Attempt, fields=dict(target=None, window_s=2.0)),
    Case("alone, but another peer was seen moments ago: one look", look(others_seen_at_s=NOW - 5.0), want=Attempt),
    Case("alone after the look for peers still starting", memory=dict(attempts=1), ask=dict(outer_step=0),
         outcome=(Outcome.ALONE, 1), fields=dict(
             reason="looked once for peers still starting; no other live peer is at outer step 0: not looking for a "
                    "group")),
    Case("alone after the look for a peer seen moments ago", memory=dict(attempts=1), outcome=(Outcome.ALONE, 1),
         fields=dict(reason="looked once for a peer seen moments ago; no other live peer is at outer step 5: not "
                            "looking for a group")),
    Case("the first round waits for target_group_size peers (30 s from the first look)", look(ready=["C"]),
         ask=dict(outer_step=0), cfg=dict(target_group_size=4), memory=dict(forming_until=NOW + 30.0), want=Attempt,
         fields=dict(target=4, window_s=30.0, reason="the swarm's first round: waiting up to 30s for 4 peers "
                                                     "(--target-group-size); 2 at the sync point, 0 on their way")),
    Case("the first round's wait is said once", look(ready=["C"]), ask=dict(outer_step=0),
         cfg=dict(target_group_size=4), memory=dict(forming_until=NOW + 30.0, attempts=1), want=Attempt,
         fields=dict(target=4, reason="")),
    Case("the first round's wait ends once a peer's record shows the next outer step",
         look(ready=["C"], next_step=["D"]), ask=dict(outer_step=0), cfg=dict(target_group_size=4),
         memory=dict(forming_until=NOW + 30.0), want=Attempt, fields=dict(target=2, window_s=2.0, reason="")),
    Case("the first round's wait ends at its bound", look(ready=["C"]), ask=dict(outer_step=0),
         cfg=dict(target_group_size=4), memory=dict(forming_until=NOW - 1.0), want=Attempt, fields=dict(target=2)),
    Case("mixing groups' first round: a cell-mate still starting is waited for by looking again each second",
         look(ready=OTHERS, late={MATE: 3}), ask=dict(outer_step=0, me="A"), cfg=dict(target_group_size=2, mixing=True),
         memory=dict(forming_until=NOW + 30.0), want=LookAgain, fields=dict(sleep_s=1.0, reason=""),
         then=dict(attempts=0, drawn_from=frozenset("ABCD"))),
    Case("behind: one group, a live peer ahead means taking the state", look(ahead=True, ready=["C"]),
         outcome=(Outcome.BEHIND, 0)),
    Case("behind: the first by id stepped alone, so the others take its state", look(ahead=True),
         memory=dict(attempts=4, following_first=True), outcome=(Outcome.BEHIND, 4)),
    Case("mixing groups: a peer one step ahead (another cell done) is no reason to take the state",
         look(ahead=True, ready=["C"], next_step=["D"]), cfg=dict(target_group_size=4, mixing=True), want=Attempt,
         fields=dict(target=2, ready=("C",))),
    Case("mixing groups: two steps ahead, a whole phase, is behind", look(ahead=True, far_ahead=True),
         cfg=dict(target_group_size=2, mixing=True), outcome=(Outcome.BEHIND, 0)),
    Case("mixing groups under wait: the swarm ahead with nobody left at our step", look(ahead=True, next_step=["C"]),
         cfg=dict(target_group_size=2, mixing=True, no_group_policy="wait"), outcome=(Outcome.BEHIND, 0)),
    Case("mixing groups: a group of one steps alone at once", look(ready=list(PAIR)), ask=dict(me=LONE),
         cfg=dict(target_group_size=2, mixing=True), outcome=(Outcome.ALONE, 0), fields=dict(
             reason="no other member of this peer's mixing group is left at outer step 5: stepping alone (a later "
                    "round mixes this state in)")),
    Case("mixing groups: the attempt expects its own cell, under the cell's key", look(ready=[LONE, PAIR[1]]),
         ask=dict(me=PAIR[0]), cfg=dict(target_group_size=2, mixing=True), want=Attempt,
         fields=dict(target=2, ready=(PAIR[1],))),
    Case("excluded peers are not in the target", look(ready=["C", "D"]), memory=dict(excluded=frozenset("C")),
         want=Attempt, fields=dict(target=2, ready=("D",))),
    Case("excluded peers still keep this peer from stepping alone", look(ready=["C"]),
         memory=dict(excluded=frozenset("C"), attempts=1), want=Attempt, fields=dict(target=None, ready=())),
    Case("alone after a round that failed mid-round: a round that did not form",
         memory=dict(excluded=frozenset("C"), attempts=2), outcome=(Outcome.NO_GROUP, 2), fields=dict(reason="")),
    Case("no_group_policy wait: alone, it still looks", cfg=dict(no_group_policy="wait"), want=Attempt),
    Case("a client-mode peer follows in a window longer than any leader plans", look(ready=["C"]),
         ask=dict(client_mode=True), want=Attempt, fields=dict(window_s=2.0, search_window_s=32.0)),
    Case("a client-mode peer with nobody of its round in sight keeps the short window", ask=dict(client_mode=True,
         outer_step=0), want=Attempt, fields=dict(window_s=2.0, search_window_s=2.0)),
    Case("the averager process is gone", look(ready=["C"], averager_alive=False), outcome=(Outcome.NO_GROUP, 1),
         fields=dict(reason="the averager process is gone; this peer can no longer average", level=logging.ERROR)),
    Case("leaving before any attempt", Look(leaving=True), outcome=(Outcome.ALONE, 0)),
    Case("leaving after attempts", Look(leaving=True), memory=dict(attempts=3), outcome=(Outcome.NO_GROUP, 3)),
    # what the last attempt's result means
    Case("the group averaged", last=attempted(["C"], result=RESULT), memory=dict(attempts=1),
         outcome=(Outcome.AVERAGED, 1), fields=dict(outcome__result=RESULT)),
    Case("the swarm went on while this peer looked for its group", last=attempted(["C"], went_on=True),
         memory=dict(attempts=2), outcome=(Outcome.BEHIND, 2)),
    Case("a single attempt is one attempt", last=attempted(["C"]), ask=dict(single_attempt=True),
         memory=dict(attempts=1), outcome=(Outcome.NO_GROUP, 1)),
    Case("an incomplete round: settle, leave its failed members out, and end the first round's wait",
         last=attempted(["C", "D"], incomplete=True, failed_members=frozenset("D")),
         memory=dict(attempts=1, forming_until=NOW + 20.0), want=Settle, fields=dict(sleep_s=1.0, read_records=False),
         then=dict(excluded=frozenset("D"), forming_until=None)),
    Case("an incomplete round under mixing groups: the settle reads the records", cfg=dict(mixing=True),
         last=attempted(["C"], incomplete=True), memory=dict(attempts=1), want=Settle, fields=dict(read_records=True)),
    Case("its members committed the incomplete round: take their state", memory=dict(attempts=1),
         last=attempted(["C"], incomplete=True, settled=Settled(swarm_outer_step=6)), outcome=(Outcome.BEHIND, 1)),
    Case("mixing: the records after the settle show the swarm far ahead", cfg=dict(mixing=True),
         last=attempted(["C"], incomplete=True, settled=Settled(RoundOutlook(True, [], {}, far_ahead=True))),
         memory=dict(attempts=1), outcome=(Outcome.BEHIND, 1)),
    Case("an incomplete round is run again with the survivors", memory=dict(attempts=1),
         last=attempted(["C"], incomplete=True, settled=Settled(swarm_outer_step=5)), want=LookAgain, fields=dict(
             reason="a group member failed mid-round; running the round again with the survivors (retry 1/2)",
             level=logging.WARNING), then=dict(incomplete_retries=1)),
    Case("retries of an incomplete round are bounded, then the policy decides", memory=dict(attempts=3,
         incomplete_retries=2, unjoinable_since=NOW - 20.0), cfg=dict(averaging_timeout_s=10.0),
         last=attempted(["C"], incomplete=True, settled=Settled(swarm_outer_step=5)), ask=dict(me="A"),
         outcome=(Outcome.NO_GROUP, 3)),
    Case("the look made while nobody was there failed: look again", last=attempted(alone=True),
         memory=dict(attempts=1), want=LookAgain, fields=dict(reason="")),
    Case("late peers making progress: wait for them", last=attempted(moving=True), memory=dict(attempts=1),
         want=LookAgain, then=dict(unjoinable_since=None)),
    Case("the first round's wait is not over: look again", last=attempted(["C"], forming=True),
         memory=dict(attempts=1, forming_until=NOW + 10.0), ask=dict(outer_step=0, me="A"), want=LookAgain),
    Case("ready peers that did not group with us: wait up to a round for them", last=attempted(["C"]),
         ask=dict(me="A"), memory=dict(attempts=1), want=LookAgain, fields=dict(reason=""),
         then=dict(unjoinable_since=NOW)),
    Case("no group: the first by id goes on alone after a round", last=attempted(["C"]), ask=dict(me="A"),
         memory=dict(attempts=5, unjoinable_since=NOW - 12.0), outcome=(Outcome.NO_GROUP, 5)),
    Case("a peer with weight 0 does not wait for ready peers that refuse it", last=attempted(["C"]),
         ask=dict(me="A", weight=0.0), memory=dict(attempts=1), outcome=(Outcome.NO_GROUP, 1)),
    Case("no group: the others wait for the first by id (said once)", last=attempted(["C"]), ask=dict(me="D"),
         memory=dict(attempts=5, unjoinable_since=NOW - 12.0), want=LookAgain,
         fields=dict(reason=FOLLOW, level=logging.INFO), then=dict(following_first=True)),
    Case("no group: waiting for the first by id, already said", last=attempted(["C"]), ask=dict(me="D"),
         memory=dict(attempts=6, unjoinable_since=NOW - 20.0, following_first=True), want=LookAgain,
         fields=dict(reason="")),
    Case("no group: a first that stays put for 3 rounds is stuck, and the others go on", last=attempted(["C"]),
         ask=dict(me="D"), memory=dict(attempts=9, unjoinable_since=NOW - 36.0, following_first=True),
         outcome=(Outcome.NO_GROUP, 9)),
    Case("no_group_policy wait: say why, and look again", last=attempted(), cfg=dict(no_group_policy="wait"),
         memory=dict(attempts=3), want=LookAgain, fields=dict(
             reason="no group formed (attempt 3); waiting for peers (no_group_policy=wait)", level=logging.WARNING,
             explain=True)),
]


def settings(**overrides) -> RoundSettings:
    return RoundSettings(**{**dict(no_group_policy="apply_local", matchmaking_time_s=2.0, averaging_timeout_s=10.0,
                                   late_peer_wait_s=None, min_group_size=2, target_group_size=None,
                                   request_timeout_s=1.0, incomplete_settle_s=1.0), **overrides})


def asked(me: str = "B", outer_step: int = 5, last: bool = False, **kwargs) -> Ask:
    return Ask(me=me, position=Position(outer_step=outer_step, local_step=100, phase_started=40.0, last=last),
               **{"weight": 8.0, **kwargs})


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_decide(case: Case):
    action, memory = decide(case.look, case.last, Memory(**case.memory), asked(**case.ask), settings(**case.cfg))
    assert type(action) is case.want, action
    if case.outcome is not None:
        assert (action.outcome.kind, action.outcome.attempts) == case.outcome, action
    for name, value in case.fields.items():
        got = action
        for part in name.split("__"):
            got = getattr(got, part)
        assert got == value, (name, action)
    for name, value in case.then.items():
        assert getattr(memory, name) == value, (name, memory)


def test_the_memory_starts_the_first_rounds_wait_only_where_a_group_size_was_named():
    cfg = settings(target_group_size=4)
    assert Memory.start(asked(outer_step=0), cfg, NOW).forming_until == NOW + 30.0
    assert Memory.start(asked(outer_step=1), cfg, NOW).forming_until is None
    assert Memory.start(asked(outer_step=0, single_attempt=True), cfg, NOW).forming_until is None
    assert Memory.start(asked(outer_step=0), settings(target_group_size=1), NOW).forming_until is None


def test_a_stalled_late_peer_that_moves_again_is_waited_for_again():
    """The stall clock restarts when the late peer's local step moves (the memory keeps when it was last seen to)."""
    memory = Memory(last_moved={"D": (90, NOW - 50.0)}, late_deadline=NOW + 10.0)
    action, memory = decide(look(ready=["C"], late={"D": 95}), None, memory, asked(), settings())
    assert isinstance(action, Attempt) and action.late == {"D": 95} and memory.last_moved["D"] == (95, NOW)


def test_decide_reads_nothing_but_its_arguments():
    """The same arguments, the same answer: decide keeps no state of its own."""
    args = (look(ready=["C"], late={"D": 90}), None, Memory(), asked(), settings())
    assert decide(*args) == decide(*args)
    last = replace(attempted(["C"]), ended_at_s=NOW + 5.0)
    assert decide(args[0], last, Memory(attempts=1), asked(me="D"), settings()) == \
        decide(args[0], last, Memory(attempts=1), asked(me="D"), settings())
