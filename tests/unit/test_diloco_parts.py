"""The parts of ``DiLoCoOptimizer`` (issue 36), each built around a ``PeerState`` of its own with fakes of the
others: no DHT, no averager process. And its constructor: at most 12 parameters, the old keyword arguments mapped
onto ``settings``/``options`` with a ``DeprecationWarning``, an unknown one still a ``TypeError``."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import threading
from types import SimpleNamespace

import pytest
import torch

from p2ptrain.averaging import RoundResult
from p2ptrain.config import DiLoCoConfig
from p2ptrain.diloco import DiLoCoOptimizer, DiLoCoOptions
from p2ptrain.diloco.catch_up import CatchUp
from p2ptrain.diloco.context import PeerState
from p2ptrain.diloco.options import OPTIONS_FIELDS, SETTINGS_FIELDS, resolve
from p2ptrain.diloco.pseudo import Contribution
from p2ptrain.diloco.records import Outcome, RoundOutcome, SyncRecord, Throughput
from p2ptrain.diloco.reporting import Reporter
from p2ptrain.diloco.state import StateSharing
from p2ptrain.diloco.streaming import StreamingSync
from p2ptrain.diloco.swarm_view import outlook_of
from p2ptrain.diloco.sync import BlockingSync
from p2ptrain.fragments import FragmentPlan
from p2ptrain.pace import Pace

# ------------------------------------------------------------------------------------------------ the constructor

OLD_DEFAULTS = dict(
    compression="fp16", error_feedback=None, matchmaking_time_s=5.0, late_peer_wait_s=None, averaging_timeout_s=60.0,
    min_group_size=2, target_group_size=None, no_group_policy="apply_local", batch_size=None, client_mode=None,
    averager_start_timeout_s=60.0, progress_period_s=5.0, progress=None, max_norm_ratio=10.0,
    catch_up_mid_phase=True, inner_lr_schedule=None, outer_lr_schedule=None, fragments=1, overlap_steps=0,
    merge_alpha=0.5, max_extra_steps=None, adaptive_steps=True, sparse_k=128, sparse_decay=0.95, aggregation="mean",
    audit_parts=1,
)
"""the 25 keyword arguments with defaults that DiLoCoOptimizer.__init__ took before settings= (commit 653b946)"""


def test_the_constructor_takes_at_most_12_parameters():
    parameters = [p for p in inspect.signature(DiLoCoOptimizer.__init__).parameters if p != "self"]
    assert len(parameters) <= 12, parameters


def test_every_old_keyword_argument_has_a_new_place():
    assert set(OLD_DEFAULTS) == set(SETTINGS_FIELDS) | set(OPTIONS_FIELDS)
    assert not set(SETTINGS_FIELDS) & set(OPTIONS_FIELDS)


def test_no_settings_means_the_old_defaults():
    settings, options = resolve(7, None, None, {})
    assert settings.local_steps == 7
    for name, default in OLD_DEFAULTS.items():
        assert getattr(settings if name in SETTINGS_FIELDS else options, name) == default, name


def test_the_old_keyword_arguments_map_onto_the_same_settings_with_one_warning():
    legacy = dict(compression="int8", matchmaking_time_s=2.0, target_group_size=3, max_extra_steps=4,
                  batch_size=16, catch_up_mid_phase=False, max_norm_ratio=None)
    with pytest.warns(DeprecationWarning) as caught:
        settings, options = resolve(5, None, None, dict(legacy))
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "compression= -> settings=DiLoCoConfig(compression=...)" in message
    assert "batch_size= -> options=DiLoCoOptions(batch_size=...)" in message
    expected_settings = dataclasses.replace(resolve(5, None, None, {})[0], compression="int8", matchmaking_time_s=2.0,
                                            target_group_size=3, max_extra_steps=4)
    assert settings == expected_settings
    assert options == DiLoCoOptions(batch_size=16, catch_up_mid_phase=False, max_norm_ratio=None)


def test_new_spelling_warns_nothing_and_local_steps_wins_over_the_settings():
    with warnings_as_errors():
        settings, options = resolve(9, DiLoCoConfig(local_steps=3, fragments=2), DiLoCoOptions(batch_size=4), {})
    assert (settings.local_steps, settings.fragments, options.batch_size) == (9, 2, 4)
    assert resolve(None, DiLoCoConfig(local_steps=3), None, {})[0].local_steps == 3


def test_an_unknown_keyword_is_still_a_type_error_naming_it():
    with pytest.raises(TypeError, match="'compresion'"):
        resolve(5, None, None, {"compresion": "fp16"})
    with pytest.raises(TypeError, match="'compresion'"):
        DiLoCoOptimizer([torch.zeros(2)], dht=None, run_id="x", local_steps=5, inner_optimizer=torch.optim.SGD,
                        outer_optimizer=torch.optim.SGD, compresion="fp16")
    with pytest.raises(TypeError, match="local_steps"):
        resolve(None, None, None, {})


def test_bad_settings_are_refused_as_before():
    with pytest.raises(ValueError, match="no_group_policy"):
        resolve(5, DiLoCoConfig(no_group_policy="nope"), None, {})
    with pytest.raises(ValueError, match="local_steps"):
        resolve(0, None, None, {})
    with pytest.raises(ValueError, match="target_group_size"):
        resolve(5, DiLoCoConfig(compression="sparse", target_group_size=2), None, {})


@contextlib.contextmanager
def warnings_as_errors():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# ------------------------------------------------------------------------------------------------ fakes


class FakeAverager:
    """The averager's buffers and the calls the parts make of it, with no process behind."""

    def __init__(self, shapes):
        self.buffers = [torch.zeros(shape) for shape in shapes]
        self.codec = SimpleNamespace(lossless=True)
        self.part_size_bytes = 1 << 20
        self.host_outer_step = None
        self.allow_state_sharing, self.client_mode = True, False
        self.downloaded = None
        self.banned_peers = []
        self.downloads = 0


    @contextlib.contextmanager
    def get_tensors(self):
        yield self.buffers

    def set_host_outer_step(self, step):
        self.host_outer_step = step

    def download_state(self, timeout_s):
        self.downloads += 1
        return self.downloaded


def peer_state(local_steps=4, fragments=1, overlap_steps=0, **fields) -> PeerState:
    params = [torch.nn.Parameter(torch.tensor([1.0, 2.0])), torch.nn.Parameter(torch.tensor([[3.0]]))]
    global_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    state = PeerState(params=params, global_params=global_params, inner_optimizer=torch.optim.SGD(params, lr=0.1),
                      outer_optimizer=torch.optim.SGD(global_params, lr=1.0), averager=FakeAverager([(2,), (1, 1)]),
                      plan=FragmentPlan.build([2, 1], local_steps, fragments, overlap_steps, 0.5),
                      local_steps=local_steps, peer_id="peer-A", run_id="run", **fields)
    state.digest = state.global_digest()
    return state


class FakeProgress:
    def __init__(self):
        self.published, self.swarm_outer_step, self.fastest_step_s, self.records = [], -1, None, []

    def due(self):
        return False

    def publish(self, **record):
        self.published.append(record)

    def others(self, max_age_s):
        return self.records


class FakeRounds:
    """Answers every round with ``outcome`` (after the ``first`` outcomes, in order), and records what it was
    asked."""

    def __init__(self, outcome=RoundOutcome(Outcome.ALONE, 1), first=()):
        self.outcome, self.runs, self.peers_seen, self.is_behind = outcome, [], [], False
        self.first = list(first)

    def run(self, weight, position, **kwargs):
        self.runs.append((weight, position, kwargs))
        return self.first.pop(0) if self.first else self.outcome

    def outlook(self, position):
        return None

    def may_mix_states(self, outlook, outer_step, last_group):
        return True

    def behind(self, outlook):
        return self.is_behind

    def explain_no_group(self):
        pass

    def swarm_outer_step(self):
        return -1


def reporter_of(state, rounds=None) -> Reporter:
    return Reporter(state, FakeProgress(), Pace(state.local_steps, enabled=False), Throughput(), rounds or FakeRounds())


# ------------------------------------------------------------------------------------------------ the parts


def test_contribution_writes_the_pseudo_gradient_and_zeros_a_diverged_one():
    state = peer_state()
    with torch.no_grad():
        state.params[0].sub_(torch.tensor([0.5, 0.25]))
    contribution = Contribution(state)
    assert contribution.fill_pseudo_gradient() is False
    assert torch.equal(state.averager.buffers[0], torch.tensor([0.5, 0.25]))
    assert not state.averager.buffers[1].any()
    with torch.no_grad():
        state.params[1].fill_(float("nan"))
    assert contribution.fill_pseudo_gradient() is True
    assert all(not b.any() for b in state.averager.buffers)


def test_contribution_puts_an_unsent_sparse_message_back_into_the_accumulator():
    state = peer_state(accumulator=[torch.zeros(2), torch.zeros(1, 1)])
    state.averager.buffers[0].fill_(2.0)
    Contribution(state).unsend_sparse_message(diverged=False)
    assert torch.equal(state.accumulator[0], torch.tensor([2.0, 2.0]))
    Contribution(state).unsend_sparse_message(diverged=False, sign=-1.0)
    assert not state.accumulator[0].any()


def test_reporter_closes_a_sync_and_publishes_the_counters():
    state = peer_state()
    state.samples_since_sync, state.steps_since_sync, state.outer_step = 32, 2, 3
    reporter = reporter_of(state)
    position = reporter.position()
    assert position.gather["samples"] == 32 and position.gather["norm_scale"] == 2.0
    assert position.gather["digest"] == state.digest
    record = reporter.record(0.0, None, attempts=1, caught_up=True)
    assert state.history == [record] and record.caught_up and record.samples == 32
    assert (state.samples_since_sync, state.steps_since_sync, state.last_group) == (0, 0, set())
    assert reporter.progress.published[-1]["outer_step"] == 3


def test_blocking_sync_applies_its_own_pseudo_gradient_when_alone():
    state = peer_state()
    with torch.no_grad():
        state.params[0].sub_(1.0)
    rounds = FakeRounds(RoundOutcome(Outcome.ALONE, 1))
    sync = BlockingSync(state, Contribution(state), reporter_of(state, rounds), rounds,
                        repair=lambda result: pytest.fail("nothing to repair"),
                        catch_up=lambda started, attempts: pytest.fail("not behind"))
    record = sync.sync()
    assert state.outer_step == 1 and record.outer_step == 1 and state.averager.host_outer_step == 1
    # outer SGD at lr 1 with the pseudo-gradient (global - local) as gradient: the global params become the local
    assert torch.equal(state.global_params[0].detach(), torch.tensor([0.0, 1.0]))
    assert torch.equal(state.params[0].detach(), torch.tensor([0.0, 1.0]))
    assert state.digest == state.global_digest()
    assert rounds.runs[0][0] == 1.0  # weight: max(samples, 1)


def test_blocking_sync_behind_hands_over_to_the_catch_up_and_leaving_abandons():
    state = peer_state()
    rounds = FakeRounds(RoundOutcome(Outcome.BEHIND, 2))
    taken = SyncRecord(outer_step=5, averaged=False, group_size=1, seconds=0.0)
    calls = []
    sync = BlockingSync(state, Contribution(state), reporter_of(state, rounds), rounds, repair=lambda r: False,
                        catch_up=lambda started, attempts: calls.append(attempts) or taken)
    assert sync.sync() is taken and calls == [2]
    rounds.outcome = RoundOutcome(Outcome.NO_GROUP, 3)
    state.interrupted.set()
    record = sync.sync()
    assert record.abandoned and state.outer_step == 0


def test_catch_up_without_a_donor_changes_nothing():
    state = peer_state()
    sharing = SimpleNamespace(load_state_from_peers=lambda timeout_s: False)
    catch_up = CatchUp(state, sharing, Contribution(state), reporter_of(state), FakeRounds(),
                       apply=lambda *a, **k: pytest.fail("no round"), join_fragment=None, download_timeout_s=1.0,
                       mid_phase=True)
    assert catch_up.catch_up() is False and state.history == []


def test_catch_up_fast_forwards_to_the_donors_local_step_and_records_it():
    state = peer_state(local_steps=10)
    reporter = reporter_of(state)
    reporter.progress.records = [SimpleNamespace(outer_step=0, local_step=6), SimpleNamespace(outer_step=1,
                                                                                               local_step=9)]
    sharing = SimpleNamespace(load_state_from_peers=lambda timeout_s: True)
    catch_up = CatchUp(state, sharing, Contribution(state), reporter, FakeRounds(), apply=None, join_fragment=None,
                       download_timeout_s=1.0, mid_phase=True)
    assert catch_up.catch_up() is True
    assert state.local_step == 6 and state.history[-1].caught_up
    reporter.progress.swarm_outer_step = 2
    assert catch_up.due()
    catch_up.no_donor_at_outer_step = state.outer_step
    assert not catch_up.due()


def streaming_catch_up(state: PeerState, donors_at: int) -> CatchUp:
    """A catch-up whose donors, at local step ``donors_at``, are in fragment 0's round launched at step 2."""
    reporter = reporter_of(state)
    reporter.progress.records = [SimpleNamespace(outer_step=0, local_step=donors_at)]

    def load_state_from_peers(timeout_s):
        state.local_step, state.donor_in_flight = donors_at, (0, 2)
        return True

    return CatchUp(state, SimpleNamespace(load_state_from_peers=load_state_from_peers), Contribution(state), reporter,
                   FakeRounds(), apply=None, join_fragment=lambda fragment, launched_at: setattr(
                       state, "in_flight", SimpleNamespace(fragment=fragment, local_step=launched_at)),
                   download_timeout_s=1.0, mid_phase=True)


@pytest.mark.parametrize("donors_at", [2, 4])
def test_a_streaming_catch_up_skips_to_the_donors_step_and_never_past_the_joined_rounds_apply_step(donors_at):
    """8 steps, 2 fragments, overlap 2: fragment 0 launches at step 2 and is applied at 4, fragment 1 launches at 6.
    A peer that took the state at the donors' step stays there: at 2 (before, it went to the next stop less one, 3,
    wherever the donors were), and at 4 itself, where a donor trains on while fragment 0's round runs (before, it
    skipped to 5: past the apply step, and it launched fragment 1's round at 6 with fragment 0's still in flight)."""
    state = peer_state(local_steps=8, fragments=2, overlap_steps=2)
    assert streaming_catch_up(state, donors_at).catch_up()
    assert state.local_step == donors_at and state.in_flight.local_step == 2
    # what a member still in fragment 0's round (applied at 4) reads of it: not a peer that applied it already, so
    # not a swarm that went on without that member (in CI, an original member read the newcomer at step 5 there,
    # took the state as if behind, and its round's record was lost)
    newcomer = SimpleNamespace(peer_id="newcomer", outer_step=0, local_step=state.local_step, leaving=False)
    assert not outlook_of([newcomer], outer_step=0, local_step=4, applied_by=4).ahead


def test_a_catch_up_that_joins_a_round_at_its_apply_step_applies_it_before_the_next_launch():
    """Fragment 0's round (launched at 2, applied at 4) finds this peer behind; it takes the state of donors at
    step 4 that still run fragment 0's round of the next outer step, and joins it. That round is due: it is
    applied at once, so fragment 1's round launches at step 6 (before, it was still in flight there, and fragment
    1's round was skipped: the peer missed that outer step's record and drifted from the swarm)."""
    state = peer_state(local_steps=8, fragments=2, overlap_steps=2)
    rounds = FakeRounds(RoundOutcome(Outcome.NO_GROUP, 1), first=[RoundOutcome(Outcome.BEHIND, 1)])
    taken = SyncRecord(outer_step=0, averaged=False, group_size=1, seconds=0.0, caught_up=True)
    streaming = None

    def catch_up(started, attempts):
        state.local_step = 4
        streaming.join_fragment_in_progress(0, 2)
        return taken

    streaming = StreamingSync(state, Contribution(state), reporter_of(state, rounds), rounds,
                              repair=lambda r: False, catch_up=catch_up, max_extra_steps=0)
    launched = []
    for _ in range(state.local_steps):
        with state.state_lock:
            state.local_step += 1
            streaming.launch_due(1)
            if state.in_flight is not None and state.in_flight.local_step == state.local_step:
                launched.append((state.in_flight.fragment, state.local_step))
        streaming.after_step()
    assert launched == [(0, 2), (1, 6)] and [weight for weight, *_ in rounds.runs] == [2.0, 0.0, 2.0]
    assert state.in_flight is None and [f["fragment"] for f in state.history[-1].fragments] == [0, 1]


def test_state_sharing_serves_a_snapshot_that_another_peer_state_loads():
    donor = peer_state()
    donor.outer_step, donor.local_step = 3, 5
    sharing = StateSharing(donor, on_loaded=lambda: None, download_timeout_s=1.0)
    served = {}

    def serve():
        served["metadata"], (served["flat"],), _ = sharing.shareable_state()

    thread = threading.Thread(target=serve)
    thread.start()
    thread.join()  # no inner step comes: the state-serving thread copies it itself, under the lock
    assert served["metadata"]["outer_step"] == 3 and served["metadata"]["digest"] == donor.digest

    newcomer = peer_state()
    with torch.no_grad():
        newcomer.params[0].add_(1.0)
        newcomer.global_params[0].add_(1.0)
    loaded = []
    newcomer.averager.downloaded = SimpleNamespace(metadata=served["metadata"], flat=served["flat"].clone(),
                                                   num_bytes=12, chunks_by_donor={"d": 1}, failed_donors=[])
    taker = StateSharing(newcomer, on_loaded=lambda: loaded.append(True), download_timeout_s=1.0)
    assert taker.load_state_from_peers(timeout_s=1.0)
    assert loaded == [True] and taker.states_taken == 1 and taker.state_bytes_taken == 12
    assert (newcomer.outer_step, newcomer.local_step, newcomer.digest) == (3, 5, donor.digest)
    assert torch.equal(newcomer.params[0].detach(), donor.global_params[0].detach())


def test_streaming_sync_launches_a_fragment_round_and_applies_it_at_its_step():
    state = peer_state(local_steps=4, fragments=2)
    rounds = FakeRounds(RoundOutcome(Outcome.NO_GROUP, 1))
    streaming = StreamingSync(state, Contribution(state), reporter_of(state, rounds), rounds,
                              repair=lambda r: False, catch_up=lambda started, attempts: None, max_extra_steps=0)
    launched = []
    for _ in range(state.local_steps):
        with state.state_lock:
            state.local_step += 1
            streaming.launch_due(1)
        if state.in_flight is not None:
            launched.append(state.in_flight.fragment)
        streaming.after_step()
    assert launched == [0, 1] and state.in_flight is None
    assert state.outer_step == 1 and len(state.history) == 1 and len(state.history[0].fragments) == 2


def digests_round(me: str, mine: str, others: dict) -> RoundResult:
    return RoundResult(group_size=1 + len(others), gathered={me: {"digest": mine},
                                                             **{p: {"digest": d} for p, d in others.items()}})


@pytest.mark.parametrize("rogue_digest, excluded", [("x", False), ("0" * 32, True)])
def test_a_repair_ignores_the_digests_of_excluded_members_and_made_up_ones(rogue_digest, excluded):
    """Two key holders in a group of four claim one digest: excluded this round, or not a digest at all, they do not
    vote, so they cannot win a tie on their smaller peer ids and send the honest members after another state (CI:
    test_rogue's huge+inf)."""
    state = peer_state()
    honest = state.digest
    if excluded:
        state.averager.banned_peers = ["Qm1rogue", "Qm2rogue"]
    sharing = StateSharing(state, on_loaded=lambda: None, download_timeout_s=1.0)
    result = digests_round(state.peer_id, honest, {"Qm1rogue": rogue_digest, "Qm2rogue": rogue_digest,
                                                   "QmZhonest": honest})
    assert not sharing.repair_if_diverged(result)
    assert state.averager.downloads == 0 and state.averager.allow_state_sharing


def test_a_repair_still_takes_the_state_when_the_honest_majority_holds_another_digest():
    state = peer_state()
    other = "f" * 32
    sharing = StateSharing(state, on_loaded=lambda: None, download_timeout_s=1.0)
    assert not sharing.repair_if_diverged(digests_round(state.peer_id, state.digest, {"QmB": other, "QmC": other}))
    assert state.averager.downloads == 1  # it tried (the fake has no donor), with its own sharing off meanwhile
    assert state.averager.allow_state_sharing
