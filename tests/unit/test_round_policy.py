"""The round policy (``Rounds.run``) with no network: scripted progress records and a fake averager
stand in for the swarm, so each decision (wait, retry, go alone, catch up) is checked on its own. The same code runs
against real hivemind peers in tests/swarm/test_round_planning.py and test_chaos.py."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import List, Optional

import pytest

from p2ptrain.averaging import RoundResult
from p2ptrain.diloco.records import Outcome, RoundOutlook
from p2ptrain.mixing import groups_of
from p2ptrain.diloco.round_policy import MAX_INCOMPLETE_RETRIES, UNJOINABLE_ROUNDS, RoundSettings
from p2ptrain.diloco.rounds import Rounds
from p2ptrain.diloco.swarm_view import Position, outlook_of
from p2ptrain.proto.p2ptrain_pb2 import PeerProgress


class FakeAverager:
    client_mode = False  # a peer that can lead groups (the averager's attribute)

    def __init__(self):
        self.plans: List[tuple] = []  # (target, window_s, expected) of each attempt
        self.incomplete_rounds = 0
        self.last_failed_members: set = set()

    def is_alive(self) -> bool:
        return True

    def set_round_plan(self, target, window_s, expected=(), max_group_size=None, fragment=0, follows_only=False) -> None:
        self.plans.append((target, window_s, sorted(expected)))


class Host(Rounds):
    """``Rounds`` with its two network reads scripted. ``outlooks``: the records each look returns (the last
    repeats); ``attempts``: what each attempt does ("ok", "fail", "interrupt" or "incomplete:<failed peer>")."""

    def __init__(self, outlooks: List[RoundOutlook], attempts: List[str], policy: str = "apply_local",
                 outer_step: int = 5, swarm_outer_step: int = 5, averaging_timeout_s: float = 0.0,
                 target_group_size: Optional[int] = None, mixing: bool = False, me: str = "A"):
        settings = RoundSettings(no_group_policy=policy, matchmaking_time_s=0.0,
                                 averaging_timeout_s=averaging_timeout_s, late_peer_wait_s=None, min_group_size=2,
                                 target_group_size=target_group_size, request_timeout_s=0.0, incomplete_settle_s=0.0,
                                 mixing=mixing)
        progress = SimpleNamespace(others_seen_at=-1e9, period_s=5.0)
        dht = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: me))
        self.keys: List[str] = []  # the mixing key bits of each attempt
        super().__init__(FakeAverager(), dht=dht, run_id="r", progress=progress, settings=settings,
                         interrupted=threading.Event(), tag=lambda: "[test]")
        self.outlooks, self.attempt_script = list(outlooks), list(attempts)
        self.position = Position(outer_step=outer_step, local_step=100, phase_started=time.monotonic())
        self._swarm_outer_step = swarm_outer_step
        self.looks = 0

    def outlook(self, position: Position) -> RoundOutlook:
        self.looks += 1
        return self.outlooks.pop(0) if len(self.outlooks) > 1 else self.outlooks[0]

    def swarm_outer_step(self) -> int:
        return self._swarm_outer_step

    def _attempt(self, weight, position, target, window_s, attempt, mixing_bits="") -> Optional[RoundResult]:
        self.keys.append(mixing_bits)
        action = self.attempt_script.pop(0) if self.attempt_script else "fail"
        if action == "ok":
            return RoundResult(group_size=target or 2)
        if action.startswith("incomplete:"):
            self.averager.incomplete_rounds += 1
            self.averager.last_failed_members = {action.split(":", 1)[1]}
        if action == "interrupt":
            self._interrupted.set()
        return None

    def explain_no_group(self) -> None:
        pass


def look(ready=(), late=None, ahead=False) -> RoundOutlook:
    return RoundOutlook(ahead=ahead, ready=list(ready), late=dict(late or {}))


def test_a_ready_peer_makes_the_group_start_with_both_of_us():
    host = Host([look(ready=["B"])], ["ok"])
    outcome = host.run(8.0, host.position)
    assert outcome.kind is Outcome.AVERAGED and outcome.attempts == 1 and outcome.result.group_size == 2
    assert host.averager.plans == [(2, 0.0, ["B"])]


def test_the_swarm_ahead_means_taking_its_state_without_an_attempt():
    host = Host([look(ahead=True)], [])
    outcome = host.run(8.0, host.position)
    assert outcome.kind is Outcome.BEHIND and outcome.attempts == 0 and host.averager.plans == []


def test_the_callers_outlook_serves_the_first_attempt():
    host = Host([look(ready=["B", "C"])], ["ok"])
    host.run(8.0, host.position, outlook=look(ready=["B"]))
    assert host.looks == 0 and host.averager.plans[0][0] == 2


def test_alone_in_the_swarm_it_goes_on_without_looking():
    host = Host([look()], [])
    outcome = host.run(8.0, host.position)
    assert outcome.kind is Outcome.ALONE and outcome.attempts == 0


def test_a_new_swarms_first_round_looks_once_before_going_alone():
    host = Host([look()], ["fail"], outer_step=0)
    outcome = host.run(8.0, host.position)
    # nobody came: alone in the swarm, which is no failed round (the sync says so without a warning)
    assert outcome.kind is Outcome.ALONE and outcome.attempts == 1


def test_a_late_peer_that_makes_progress_is_waited_for_and_counted_in_the_target():
    # C is in its inner steps (local step 90, then 95), then ready
    host = Host([look(late={"C": 90}), look(late={"C": 95}), look(ready=["C"])], ["fail", "fail", "ok"])
    outcome = host.run(8.0, host.position)
    assert outcome.kind is Outcome.AVERAGED and outcome.attempts == 3
    assert [(target, expected) for target, _, expected in host.averager.plans] == [(2, ["C"])] * 3


def test_a_member_that_failed_mid_round_is_left_out_of_the_retries():
    host = Host([look(ready=["B", "C"])], ["incomplete:C", "ok"])
    outcome = host.run(8.0, host.position)
    assert outcome.kind is Outcome.AVERAGED and outcome.attempts == 2
    assert [(target, expected) for target, _, expected in host.averager.plans] == [(3, ["B", "C"]), (2, ["B"])]


def test_after_a_first_round_that_failed_mid_round_the_survivors_go_again_without_the_forming_wait():
    """In the swarm's first round a group met and a member failed mid-round (a rogue caught sending poison): the
    swarm has formed, so the retry with the survivors is planned for them now, not for the 30 s in which peers still
    starting are waited for (the rogue test's retry took 31 s)."""
    host = Host([look(ready=["B", "C"])], ["incomplete:C", "ok"], outer_step=0, swarm_outer_step=0,
                target_group_size=4)
    outcome = host.run(8.0, host.position)
    assert outcome.kind is Outcome.AVERAGED and outcome.attempts == 2
    (_, first_window_s, _), (target, window_s, expected) = host.averager.plans
    assert first_window_s > 20 and (target, expected) == (2, ["B"]) and window_s < 1.0, host.averager.plans


def test_members_that_committed_an_incomplete_round_make_us_take_their_state():
    host = Host([look(ready=["B"])], ["incomplete:B"], swarm_outer_step=6)
    outcome = host.run(8.0, host.position)
    assert outcome.kind is Outcome.BEHIND and outcome.attempts == 1


def test_incomplete_rounds_are_retried_a_bounded_number_of_times():
    host = Host([look(ready=["B"])], ["incomplete:B"] * 10)
    outcome = host.run(8.0, host.position)
    assert outcome.kind is Outcome.NO_GROUP and outcome.attempts == 1 + MAX_INCOMPLETE_RETRIES


def test_with_nobody_left_after_an_incomplete_round_it_goes_on():
    host = Host([look(ready=["B"]), look()], ["incomplete:B"])
    outcome = host.run(8.0, host.position)
    assert outcome.kind is Outcome.NO_GROUP and outcome.attempts == 1


def test_ready_peers_that_do_not_group_with_us_are_waited_for_a_while():
    # they may be in a round of their own, which takes at most averaging_timeout_s
    host = Host([look(ready=["B"])], ["fail"] * 3 + ["ok"], averaging_timeout_s=5.0)
    outcome = host.run(8.0, host.position)
    assert outcome.kind is Outcome.AVERAGED and outcome.attempts == 4
    host = Host([look(ready=["B"])], ["fail"] * 100, averaging_timeout_s=0.3)
    started = time.monotonic()
    outcome = host.run(8.0, host.position)
    assert outcome.kind is Outcome.NO_GROUP and 0.3 <= time.monotonic() - started < 2.0


class StepsAheadAfter(Host):
    """Ready peer B never groups with us; after ``after_s`` its records show it stepped on (alone)."""

    def __init__(self, after_s: float, **kwargs):
        super().__init__([look(ready=["B"])], ["fail"] * 100_000, **kwargs)
        self.ahead_at = time.monotonic() + after_s

    def outlook(self, position: Position) -> RoundOutlook:
        time.sleep(0.01)
        return look(ahead=True) if time.monotonic() >= self.ahead_at else look(ready=["B"])


@pytest.mark.parametrize("me, kind", [("A", Outcome.NO_GROUP), ("C", Outcome.BEHIND)])
def test_of_two_ready_peers_that_cannot_group_only_the_first_by_id_steps_alone(me, kind, caplog):
    """One model: after the wait for a round (1 s), A (first by id) steps alone; C waits on (its stuck bound is 3 s)
    until B, the first of B and C, stepped, and takes its state, instead of stepping alone beside it (issue 34: two
    models at one outer step)."""
    host = StepsAheadAfter(2.0, averaging_timeout_s=1.0, me=me)
    started = time.monotonic()
    with caplog.at_level("INFO", logger="p2ptrain.diloco"):
        outcome = host.run(8.0, host.position)
    assert outcome.kind is kind
    said = [r.getMessage() for r in caplog.records if "waiting for the first of them by id" in r.getMessage()]
    assert len(said) == (me == "C"), said  # once, however many attempts
    # A went at the end of the wait for a round (NO_GROUP: before B stepped); C only once B had stepped
    assert time.monotonic() - started >= (1.0 if me == "A" else 2.0)


def test_a_first_peer_that_never_steps_is_stuck_and_the_others_go_on_after_a_bound():
    host = StepsAheadAfter(1e9, averaging_timeout_s=0.1, me="C")
    started = time.monotonic()
    outcome = host.run(8.0, host.position)
    assert outcome.kind is Outcome.NO_GROUP
    assert time.monotonic() - started >= UNJOINABLE_ROUNDS * 0.1


def test_a_peer_with_nothing_to_add_does_not_wait_for_ready_peers_that_refuse_it():
    host = Host([look(ready=["B"])], ["fail", "ok"], averaging_timeout_s=5.0)
    outcome = host.run(0.0, host.position)
    assert outcome.kind is Outcome.NO_GROUP and outcome.attempts == 1


def test_under_wait_it_keeps_looking_until_it_is_interrupted():
    host = Host([look()], ["fail"] * 5 + ["interrupt"], policy="wait")
    outcome = host.run(8.0, host.position)
    assert outcome.kind is Outcome.NO_GROUP and outcome.attempts == 6


def test_a_single_attempt_is_one_attempt():
    host = Host([look(ready=["B"])], ["fail", "ok"])
    outcome = host.run(0.0, host.position, single_attempt=True)
    assert outcome.kind is Outcome.NO_GROUP and outcome.attempts == 1


def record(peer: str, outer_step: int, local_step: int) -> PeerProgress:
    return PeerProgress(run_id="r", peer_id=peer, outer_step=outer_step, local_step=local_step)


def test_the_records_sorted_into_ready_late_and_ahead():
    records = [record("B", 5, 100), record("C", 5, 90), record("D", 4, 80), record("E", 6, 0)]
    outlook = outlook_of(records, outer_step=5, local_step=100)
    # D is behind: it catches up alone; E is a step ahead (mixing groups: another group done with this round)
    assert outlook == RoundOutlook(ahead=True, ready=["B"], late={"C": 90}, next_step=["E"], previous_step=["D"],
                                   far_ahead=False)
    assert outlook_of(records + [record("F", 7, 0)], outer_step=5, local_step=100).far_ahead
    assert not outlook_of(records[:3], outer_step=5, local_step=100).ahead


def test_a_peer_that_left_cleanly_after_this_round_is_drawn_but_never_waited_for():
    """Mixing groups: a peer whose group finished this round and that then left (its leaving record) keeps its
    place in the round's draw (CI: the others drew 5 peers instead of 8 and formed groups 3 + 2), but is not ahead,
    ready or late. One that left before this round is not drawn."""
    gone = PeerProgress(run_id="r", peer_id="L", outer_step=6, local_step=0, leaving=True)
    earlier = PeerProgress(run_id="r", peer_id="M", outer_step=5, local_step=90, leaving=True)
    outlook = outlook_of([record("B", 5, 100), gone, earlier], outer_step=5, local_step=100)
    assert outlook == RoundOutlook(ahead=False, ready=["B"], late={}, next_step=["L"])


def test_mixing_groups_wait_for_a_peer_still_in_the_round_before():
    """Mixing groups finish a round at their own pace: a peer of another group still at the step before is late
    (a cell of 4 once started without a member 0.3 s away); in one group it was not ours, so it catches up alone."""
    records = [record("B", 5, 100), record("D", 4, 80)]
    assert outlook_of(records, outer_step=5, local_step=100, mixing=True).late == {"D": 80}
    assert outlook_of(records, outer_step=5, local_step=100).late == {}


def test_a_member_of_our_last_round_not_yet_showing_its_commit_is_late_not_gone():
    """A fast peer reads the records right after a round: the slow member's record still shows the step before.
    Counted as absent, the fast peer stepped alone next to it (CI: group sizes [2, 1, 1])."""
    records = [record("B", 4, 80), record("D", 4, 70)]
    outlook = outlook_of(records, outer_step=5, local_step=100, last_group={"B"})
    assert outlook == RoundOutlook(ahead=False, ready=[], late={"B": 80}, previous_step=["D"])
    host = Host([outlook, look(ready=["B"])], ["fail", "ok"])
    assert host.run(8.0, host.position).kind is Outcome.AVERAGED


def test_a_fragment_round_is_behind_once_a_peer_of_its_outer_step_is_past_the_fragments_apply_step():
    """Streaming sync: fragment rounds do not move the outer step, so a peer that applied the fragment without us
    shows only in its local step. Waiting at the apply step (equal) is not past it."""
    records = [record("B", 5, 110), record("C", 5, 109)]
    outlook = outlook_of(records, outer_step=5, local_step=108, applied_by=110)
    assert not outlook.ahead and outlook.ready == ["B", "C"]
    assert outlook_of(records + [record("D", 5, 111)], outer_step=5, local_step=108, applied_by=110).ahead
    assert not outlook_of(records + [record("D", 5, 111)], outer_step=5, local_step=108).ahead  # blocking sync
    assert Position(outer_step=5, local_step=0, phase_started=0.0, fragment=2, fragments=4).group_bits == "0000010110"
    assert Position(outer_step=5, local_step=0, phase_started=0.0).group_bits == "00000101"


def test_mixing_groups_plan_for_their_own_members_and_turn_each_round():
    """Eight peers ready, groups of at most 4 (p2ptrain/mixing.py): each peer's attempt expects the other members of
    its own cell, not the swarm, with the cell's size as its target; cells get keys of their own, equal within a
    cell; and the cells of two rounds differ."""
    peers = list("ABCDEFGH")
    for step in (5, 6):
        keys = {}
        for me in peers:
            host = Host([look(ready=[p for p in peers if p != me])], ["ok"], outer_step=step, target_group_size=4,
                        mixing=True, me=me)
            assert host.run(8.0, host.position).kind is Outcome.AVERAGED
            group, = [g for g in groups_of(peers, 4, step) if me in g]
            assert host.averager.plans == [(len(group), 0.0, [p for p in group if p != me])]
            keys[me] = host.keys[0]
        for group in groups_of(peers, 4, step):
            assert len({keys[p] for p in group}) == 1 and keys[group[0]]
        assert len(set(keys.values())) == 2
    assert groups_of(peers, 4, 5) != groups_of(peers, 4, 6)


def test_a_mixing_group_of_one_steps_alone_at_once():
    """Three peers, groups of at most 2: two cells, one of them a single peer. That peer applies its own
    pseudo-gradient without an attempt (a later round mixes it in) instead of waiting for a group that cannot
    form; the other two average together."""
    peers, step = list("ABC"), 5
    (lone,), pair = sorted(groups_of(peers, 2, step), key=len)
    host = Host([look(ready=[p for p in peers if p != lone])], ["ok"], outer_step=step, target_group_size=2,
                mixing=True, me=lone)
    outcome = host.run(8.0, host.position)
    assert outcome.kind is Outcome.ALONE and outcome.attempts == 0 and host.averager.plans == []
    other = Host([look(ready=[p for p in peers if p != pair[0]])], ["ok"], outer_step=step, target_group_size=2,
                 mixing=True, me=pair[0])
    assert other.run(8.0, other.position).kind is Outcome.AVERAGED
    assert other.averager.plans == [(2, 0.0, [pair[1]])]


def test_a_mixing_cell_that_went_on_without_us_leaves_us_to_step_alone_not_behind():
    """Mixing groups: other cells finish the round at their own pace, so a peer one step ahead is no reason to
    take the swarm's state. When our own cell-mates are that peer, they averaged without us: we step alone at once
    (our state mixes in at a later round; a download would throw our inner steps away). Two steps ahead is a
    whole phase: behind."""
    peers, step = list("ABCD"), 6
    mine, = [g for g in groups_of(peers, 2, step) if "A" in g]
    partner, = [p for p in mine if p != "A"]
    others = [p for p in peers if p not in mine]
    host = Host([RoundOutlook(ahead=True, ready=others, late={}, next_step=[partner])], ["ok"], outer_step=step,
                target_group_size=2, mixing=True)
    outcome = host.run(8.0, host.position)
    assert outcome.kind is Outcome.ALONE and outcome.attempts == 0
    far = Host([RoundOutlook(ahead=True, ready=others, late={}, next_step=[partner], far_ahead=True)], ["ok"],
               outer_step=step, target_group_size=2, mixing=True)
    assert far.run(8.0, far.position).kind is Outcome.BEHIND
    plain = Host([RoundOutlook(ahead=True, ready=others, late={}, next_step=[partner])], ["ok"], outer_step=step)
    assert plain.run(8.0, plain.position).kind is Outcome.BEHIND  # one group: anyone ahead is


@pytest.mark.parametrize("mixing", [True, False])
def test_the_first_round_stops_waiting_for_the_swarm_to_form_once_a_peer_has_finished_it(mixing):
    """The swarm's first round waits (bounded, 30 s) for the group size the user named while its peers are still
    starting. A peer that has already stepped past the round means nobody is forming it any more: a mixing peer
    whose only cell-mate stepped alone steps alone at once (it waited out the 30 s, a test's 33 s); without mixing
    it takes the state, as ever."""
    host = Host([RoundOutlook(ahead=True, ready=[], late={}, next_step=["B"])], [], outer_step=0,
                target_group_size=2, mixing=mixing)
    outcome = host.run(0.0, host.position)
    assert outcome.kind is (Outcome.ALONE if mixing else Outcome.BEHIND)
    # at most the one look a first round makes for peers still starting, in a plain matchmaking window
    assert outcome.attempts <= 1 and all(window_s < 1.0 for _, window_s, _ in host.averager.plans), host.averager.plans
    starting = Host([look(late={"B": 3})], ["ok"], outer_step=0, target_group_size=2, mixing=mixing)
    assert starting.run(8.0, starting.position).kind is Outcome.AVERAGED  # a peer still on its way: waited for


def test_a_mixing_peer_that_may_not_step_alone_takes_the_state_once_nobody_is_left_at_its_step():
    """no_group_policy "wait" forbids the solo step that mixing groups take when the cell went on without us: with
    the swarm a step ahead and nobody left at our outer step, nobody will ever average this round with us, so the
    peer takes the state (it had looked for a group for ever, and the peer a step ahead waited for it as late: seen
    when one member refused a reducer's range that the other member committed). With a peer still at our step, it
    looks for its group as before."""
    peers, step = list("AB"), 6
    gone = Host([RoundOutlook(ahead=True, ready=[], late={}, next_step=["B"])], ["ok"], policy="wait",
                outer_step=step, target_group_size=2, mixing=True)
    outcome = gone.run(8.0, gone.position)
    assert outcome.kind is Outcome.BEHIND and outcome.attempts == 0
    company = Host([RoundOutlook(ahead=True, ready=["C"], late={}, next_step=["B"])], ["ok"], policy="wait",
                   outer_step=step, target_group_size=2, mixing=True)
    assert company.run(8.0, company.position).kind is Outcome.AVERAGED


def test_without_mixing_the_cap_does_not_split_the_swarm_into_keys():
    host = Host([look(ready=["B", "C", "D"])], ["ok"], target_group_size=2)
    host.run(8.0, host.position)
    assert host.keys == [""] and host.averager.plans == [(2, 0.0, ["B", "C", "D"])]


@pytest.mark.parametrize("others, said", [([True, True], 1), ([], 1), ([True, False], 0)])
def test_a_client_mode_peer_with_no_public_peer_says_why_no_group_can_form(others, said, caplog):
    """Behind NAT with no live peer that others can dial, nobody can lead a group: the peer says so (at most once a
    minute) instead of waiting in silence; one public peer is enough to lead."""
    records = [PeerProgress(run_id="r", peer_id=f"P{i}", outer_step=5, local_step=0, client_mode=client)
               for i, client in enumerate(others)]
    progress = SimpleNamespace(others=lambda timeout_s, leaving=False: records, others_seen_at=-1e9, period_s=5.0)
    averager = FakeAverager()
    averager.client_mode = True
    rounds = Rounds(averager, dht=None, run_id="r", progress=progress, settings=Host([look()], []).settings,
                    interrupted=threading.Event(), tag=lambda: "[test]")
    with caplog.at_level("ERROR", logger="p2ptrain.diloco"):
        rounds.explain_no_group()
        rounds.explain_no_group()
    assert sum("no group can form" in r.getMessage() for r in caplog.records) == said


def test_the_stepped_state_is_filled_only_when_a_member_may_start_from_other_parameters():
    """Filling it took 0.19-0.27 s of every 124m sync (two passes over the model), for groups whose members had all
    averaged together the round before and so started from the same parameters."""
    from p2ptrain.diloco.swarm_view import may_mix_states

    def outlook(ready=(), late=(), next_step=(), previous_step=()):
        return RoundOutlook(ahead=False, ready=list(ready), late={p: 3 for p in late}, next_step=list(next_step),
                            previous_step=list(previous_step))
    assert not may_mix_states(0, outlook(ready=["b", "c"]), set(), 4)  # the first round: everyone's initial state
    assert not may_mix_states(5, outlook(ready=["b"], late=["c"]), {"b", "c"}, 4)  # all of them averaged with us
    assert not may_mix_states(5, outlook(ready=["b"]), {"b", "c"}, 4)  # c left: still one starting point
    assert not may_mix_states(5, outlook(), set(), 4)  # alone
    assert may_mix_states(5, outlook(ready=["b", "d"]), {"b", "c"}, 4)  # d averaged elsewhere last time
    assert may_mix_states(5, outlook(ready=["b"], next_step=["c"]), {"b"}, 4)  # another group is a round ahead
    assert may_mix_states(5, outlook(ready=["b"], previous_step=["c"]), {"b"}, 4)  # ... or still in the last
    assert may_mix_states(0, outlook(ready=list("bcde")), set(), 4)  # 5 peers in groups of 4: two groups
    assert not may_mix_states(5, outlook(ready=list("bcde")), set("bcde"), None)  # no cap: one group
