"""How a round finds its group with the default settings (no --target-group-size): real DiLoCoOptimizers on real
hivemind DHTs on 127.0.0.1, each driven from its own thread, some of them slower than the others."""

from __future__ import annotations

import asyncio
import threading
import time
from functools import partial
from typing import Callable, List

import hivemind
import pytest
import torch

from p2ptrain import DiLoCoOptimizer
from tests.helpers import wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

INNER = partial(torch.optim.AdamW, lr=1e-2)
OUTER = partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
LOCAL_STEPS = 4


@pytest.fixture
def dhts():
    nodes: List[hivemind.DHT] = []

    def make(n: int) -> List[hivemind.DHT]:
        for _ in range(n):
            initial = nodes[0].get_visible_maddrs() if nodes else []
            nodes.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial))
        return nodes

    yield make
    for node in reversed(nodes):
        node.shutdown()


def optimizer(dht, run_id: str, **kwargs) -> tuple[torch.nn.Module, DiLoCoOptimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    opt = DiLoCoOptimizer(model.parameters(), dht=dht, run_id=run_id, local_steps=LOCAL_STEPS, inner_optimizer=INNER,
                          outer_optimizer=OUTER, batch_size=4, averaging_timeout_s=20.0, **kwargs).start()
    return model, opt


def train(model, opt: DiLoCoOptimizer, steps: int, step_delay_s: Callable[[int], float] = lambda step: 0.0) -> None:
    gen = torch.Generator().manual_seed(hash(opt.dht.peer_id.to_base58()) % 2**31)
    for step in range(steps):
        time.sleep(step_delay_s(step))
        x, y = torch.randn(4, 8, generator=gen), torch.randn(4, 2, generator=gen)
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def run_threads(*targets) -> None:
    errors = []

    def guard(target):
        try:
            target()
        except BaseException as e:  # surfaced in the test's thread
            errors.append(e)

    threads = [threading.Thread(target=guard, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=200)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a training thread hung"


def test_a_peer_waits_for_a_slower_one_instead_of_stepping_alone(dhts):
    """B trains at a quarter of A's speed: A reaches every sync point seconds before B, far longer than the
    matchmaking window. A waits for B (it is live, at the same outer step, and making progress) instead of
    stepping alone, which would make B's inner steps worthless; each group starts as soon as B arrives."""
    a_dht, b_dht = dhts(2)
    # every peer takes all H inner steps a phase (no adaptive steps, which would cut B's from its first sync on and
    # let it reach a sync A never comes to): this is about waiting, pace.py's tests are about the pace
    (model_a, a), (model_b, b) = optimizer(a_dht, "slow", matchmaking_time_s=1.0, adaptive_steps=False), \
        optimizer(b_dht, "slow", matchmaking_time_s=1.0, adaptive_steps=False)
    try:
        syncs = 3
        run_threads(lambda: train(model_a, a, syncs * LOCAL_STEPS),
                    lambda: train(model_b, b, syncs * LOCAL_STEPS, lambda step: 1.0))
        for opt in (a, b):
            assert [r.group_size for r in opt.history] == [2] * syncs, opt.history
            assert all(r.averaged and not r.caught_up for r in opt.history), opt.history
        assert [r.digest for r in a.history] == [r.digest for r in b.history]
        waited = [ra.seconds for ra in a.history[1:]]
        assert min(waited) > 2.0, f"A did not wait for B: {waited}"  # B is ~3 s behind A at every sync point
        # the group starts when B arrives, not when some window ends
        started = [max(ra.finished_at - ra.allreduce_s, rb.finished_at - rb.allreduce_s) - (rb.finished_at - rb.seconds)
                   for ra, rb in zip(a.history, b.history)]
        reruns = max(a.averager.incomplete_rounds, b.averager.incomplete_rounds)
        print(f"A waited {' '.join(f'{s:.1f}' for s in waited)}s; groups formed "
              f"{' '.join(f'{s:.2f}' for s in started)}s after B arrived; all-reduces re-run: {reruns}")
        # within the 1 s window even on a loaded machine. A round whose all-reduce failed and was run again (seen
        # once in CI: a part lost for the 10 s chunk timeout on a loaded machine; test_chaos covers re-runs) forms
        # its applied group after that failure, which says nothing about the window: such a round may be late, and
        # at most one of the three
        late = [s for s in started if s >= 1.0 + 1.0]
        assert len(late) <= min(reruns, 1), (started, reruns)
    finally:
        a.close()
        b.close()


@pytest.mark.slow  # 15 s on 2 cores, and the default suite is near its 10 minutes: `make test-slow` (CI runs it)
def test_the_swarms_first_round_waits_for_the_group_size_the_user_named(dhts):
    """--target-group-size 2 and B starts 8 s after A (a slow start-up: no progress record yet when A reaches its
    first sync point, far past the 1 s matchmaking window). A waits for it: the first round is a round of both,
    and B never has to take the state."""
    a_dht, b_dht = dhts(2)
    model_a, a = optimizer(a_dht, "forming", matchmaking_time_s=1.0, target_group_size=2)
    late: list = []

    def start_b_late():
        time.sleep(8.0)
        late.append(optimizer(b_dht, "forming", matchmaking_time_s=1.0, target_group_size=2))
        train(*late[0], 2 * LOCAL_STEPS)

    try:
        run_threads(lambda: train(model_a, a, 2 * LOCAL_STEPS), start_b_late)
        _, b = late[0]
        for opt in (a, b):
            assert [(r.outer_step, r.group_size, r.averaged, r.caught_up) for r in opt.history] == \
                [(1, 2, True, False), (2, 2, True, False)], opt.history
        assert [r.digest for r in a.history] == [r.digest for r in b.history]
        assert a.history[0].seconds > 4.0, a.history[0]  # it did wait for B, well past its matchmaking window
    finally:
        a.close()
        if late:
            late[0][1].close()


def test_a_peer_alone_in_the_swarm_does_not_wait_for_a_group(dhts):
    (node,) = dhts(1)
    # the window is the first round's one look (plus the request timeout), so it is kept short: what is checked is
    # how many times the rounds looked, not how long
    model, opt = optimizer(node, "alone", matchmaking_time_s=2.0)
    try:
        train(model, opt, 2 * LOCAL_STEPS)
        # a new swarm's first round looks once (its peers may still be starting); later ones do not look at all
        assert [r.attempts for r in opt.history] == [1, 0], opt.history
        assert all(not r.averaged and r.group_size == 1 for r in opt.history)
    finally:
        opt.close()


def test_a_peer_left_out_of_a_round_catches_up_before_its_sync_point(dhts):
    """A and B are ready; C is far behind and the bound on waiting for it (late_peer_wait_s) is short: A and B
    average without it. C sees from the records that the swarm moved on and takes the state at once, instead of
    finishing an inner phase that nobody would average."""
    nodes = dhts(3)
    peers = [optimizer(node, "left-out", matchmaking_time_s=1.0, late_peer_wait_s=0.5) for node in nodes]
    (model_a, a), (model_b, b), (model_c, c) = peers
    try:
        def busy_host(step: int) -> float:
            """C: its first step, then a pause within the phase (a busy host) until its look at the records shows
            that A and B averaged without it (a fixed 12 s pause stood for that: longer than their round and a
            heartbeat's look on a quiet machine, not always on a loaded one), then the rest."""
            if step == 1:
                wait_until(lambda: c.progress.swarm_outer_step >= 1, "C sees that A and B averaged without it", 120)
            return 0.0

        run_threads(lambda: train(model_a, a, LOCAL_STEPS), lambda: train(model_b, b, LOCAL_STEPS),
                    lambda: train(model_c, c, LOCAL_STEPS, busy_host))
        for opt in (a, b):
            assert [(r.group_size, r.averaged) for r in opt.history] == [(2, True)], opt.history
        assert c.history and c.history[0].caught_up, c.history
        assert c.history[0].digest == a.history[0].digest
        assert c.outer_step == 1
        # it caught up mid-phase: the step that took the state was not its sync point
        assert c.local_step % LOCAL_STEPS != 0 or c.local_step == a.local_step, (c.local_step, a.local_step)
    finally:
        for _, opt in peers:
            opt.close()


@pytest.mark.slow  # 12 s on 2 cores, and the default suite is near its 10 minutes: `make test-slow` (CI runs it)
def test_the_last_round_before_the_peers_leave_waits_a_phase_for_a_late_one(dhts):
    """A, B and C leave after outer step 1 (``last_outer_step``, which the trainer sets from --max-outer-steps and
    --until-outer-step). Their phases take 8 s; C comes to the sync point 4 s after A and B, past the usual bound on
    waiting for it (max(1 s window, a phase / 3 peers) = 2.7 s), within a phase. In a last round A and B wait the
    whole phase: the round is a round of three. Without that, C was left out, and once A and B had left it found
    nobody to take the state from and stepped alone (a second model: 8 workers in CI ended in groups of 7 and 1)."""
    nodes = dhts(3)
    peers = [optimizer(node, "last-round", matchmaking_time_s=1.0, adaptive_steps=False) for node in nodes]
    (model_a, a), (model_b, b), (model_c, c) = peers
    for _, opt in peers:
        opt.last_outer_step = 1
    try:
        run_threads(lambda: train(model_a, a, LOCAL_STEPS, lambda step: 2.0),
                    lambda: train(model_b, b, LOCAL_STEPS, lambda step: 2.0),
                    lambda: train(model_c, c, LOCAL_STEPS, lambda step: 6.0 if step == LOCAL_STEPS - 1 else 2.0))
        for _, opt in peers:
            assert [(r.outer_step, r.group_size, r.averaged) for r in opt.history] == [(1, 3, True)], opt.history
        assert len({opt.history[0].digest for _, opt in peers}) == 1
        assert a.history[0].seconds > 3.0, a.history[0]  # A did wait for C, past the usual bound
    finally:
        for _, opt in peers:
            opt.close()


def test_a_peer_the_leader_did_not_expect_does_not_take_an_expected_peers_place(dhts):
    """The leader planned a group of itself and B (the records it read named B only). C, whose record it had not
    seen, asks to join first: the group must still wait for B, not start with C in B's place (seen in a swarm
    where two newcomers arrived together: the round left one of them out and it had to take the state again)."""
    from hivemind.utils import get_dht_time

    from p2ptrain.averaging.averager import PseudoGradientAverager, RoundResult

    nodes = dhts(3)
    averagers = [PseudoGradientAverager([torch.full((64,), float(i))], node, prefix="unexpected_diloco",
                                        compression="none", min_group_size=2, min_matchmaking_time=1.0,
                                        request_timeout=2.0, allreduce_timeout=10.0, shutdown_timeout=5)
                 for i, node in enumerate(nodes)]
    leader, b, c = averagers
    try:
        for averager in averagers:
            averager.start_in_background(timeout_s=30)
            averager.set_group_bits("00000001")
        results = {}

        def step(name: str, averager, delay_s: float, window_s: float, **plan) -> None:
            time.sleep(delay_s)
            averager.set_round_plan(window_s=window_s, **plan)
            # the earliest deadline leads: the leader's window ends first, so C and B ask it to lead them
            control = averager.step(gather={"name": name}, weight=1.0, scheduled_time=get_dht_time() + window_s,
                                    timeout=window_s + 5.0, allow_retries=False, wait=False)
            results[name] = control.result(timeout=window_s + 30.0)

        b_id = b.peer_id.to_base58()
        run_threads(partial(step, "leader", leader, 0.0, 4.0, target_group_size=2, expected=[b_id]),
                    partial(step, "c", c, 0.3, 8.0, target_group_size=None),
                    partial(step, "b", b, 1.5, 8.0, target_group_size=None))
        assert all(isinstance(r, RoundResult) for r in results.values()), results
        assert {name: r.group_size for name, r in results.items()} == {"leader": 3, "b": 3, "c": 3}
        # and the average is over all three: (0 + 1 + 2) / 3
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                assert torch.allclose(tensor, torch.full((64,), 1.0))
    finally:
        for averager in averagers:
            averager.shutdown()


def test_a_leaving_peer_waits_until_the_other_members_of_its_last_round_have_committed_it(dhts, monkeypatch):
    """A peer's own result of a round can be complete while its averages are still on their way to a slower member;
    leaving at once (as a worker does at --until-outer-step) stopped its p2p daemon under them. close() waits until
    the members' records show the round committed, and no longer than LEAVE_WAIT_S."""
    from p2ptrain.diloco import membership

    monkeypatch.setattr(membership, "LEAVE_WAIT_S", 4.0)
    nodes = dhts(3)
    peers = [optimizer(node, "leave", matchmaking_time_s=1.0) for node in nodes]
    (model_a, a), (model_b, b), (model_c, c) = peers
    try:
        run_threads(*(partial(train, model, opt, LOCAL_STEPS) for model, opt in peers))
        assert [r.group_size for r in a.history] == [3], a.history
        # B's and C's records say they have not committed the round yet (their last averages still on the way)
        for opt in (b, c):
            opt.outer_step -= 1
            opt._publish_progress(force=True)

        def commit(opt, after_s: float) -> None:
            time.sleep(after_s)
            opt.outer_step += 1
            opt._publish_progress(force=True)

        committing = threading.Thread(target=commit, args=(b, 1.5))
        committing.start()
        started = time.monotonic()
        a.close()  # waits for B (commits after 1.5 s) and C (never does, as far as A can tell): the bound
        waited = time.monotonic() - started
        committing.join()
        assert 4.0 <= waited < 4.0 + 3.0, waited
        commit(c, 0.0)
        started = time.monotonic()
        b.close()  # its last group is A (gone, record withdrawn) and C (committed): nothing to wait for
        assert time.monotonic() - started < 2.0
    finally:
        for _, opt in peers:
            opt.close()


FP16_VALUES = 3 * 2**19
"""fp16 on the wire: 3 MiB in 512 KiB parts, so each of three members reduces a range of its own"""


def three_fp16_averagers(nodes, prefix: str, **timeouts) -> list:
    """An averager per DHT node, holding FP16_VALUES copies of its index, in groups of exactly three."""
    from p2ptrain.averaging.averager import PseudoGradientAverager

    return [PseudoGradientAverager([torch.full((FP16_VALUES,), float(i))], node, prefix=prefix, compression="fp16",
                                   min_group_size=3, target_group_size=3, min_matchmaking_time=2.0,
                                   request_timeout=2.0, shutdown_timeout=5, **timeouts)
            for i, node in enumerate(nodes)]


def round_with_a_missing_member(averagers: list, step_timeout_s: float, last_starts_later_s: float = 0.0) -> dict:
    """Start the three averagers (group bits and a plan for a group of 3 in a 4 s window) and one step on each, the
    third member's window ``last_starts_later_s`` later; its step is not waited for. Members 0 and 1's outcomes
    (``outcomes[i]``: the result or the exception) and seconds (``outcomes[i, "s"]``)."""
    from hivemind.utils import get_dht_time

    for averager in averagers:
        averager.start_in_background(timeout_s=30)
        averager.set_group_bits("00000001")
        averager.set_round_plan(window_s=4.0, target_group_size=3)
    outcomes = {}
    scheduled = get_dht_time() + 4.0

    def step(i: int) -> None:
        started = time.monotonic()
        start = scheduled + (last_starts_later_s if i == 2 else 0.0)
        control = averagers[i].step(gather={"i": i}, weight=1.0, scheduled_time=start, timeout=step_timeout_s,
                                    allow_retries=False, wait=False)
        if i == 2:
            return  # the missing member's step does not end with the others': not waited for
        try:
            outcomes[i] = control.result(timeout=60.0)
        except Exception as e:
            outcomes[i] = e
        outcomes[i, "s"] = time.monotonic() - started

    run_threads(partial(step, 0), partial(step, 1), partial(step, 2))
    return outcomes


def assert_nothing_applied(averagers: list, outcomes: dict) -> None:
    """Members 0 and 1 found the round incomplete and kept their own tensors."""
    for i in (0, 1):
        assert isinstance(outcomes[i], Exception), outcomes
        with averagers[i].get_tensors() as (tensor,):
            assert torch.equal(tensor, torch.full((FP16_VALUES,), float(i)))


@pytest.mark.slow  # 13 s: the default suite reached 9:46 of its 10 minutes on 2 cores (CI runs it after)
def test_every_sender_hangs_up_on_its_reducers_once_it_holds_their_averages(dhts):
    """Protocol 6: a reducer holds each sender's stream open after its last average until the sender hangs up
    (ExactAllReduceRunner.rpc_aggregate_part), because a reducer that closed first could lose that average in the
    daemons' reset on a slow link. So the senders must hang up by themselves: if they did not, every round would end
    only when the reducers gave up on them (their reducer_timeout, 40 s here), not in about a second."""
    from hivemind.utils import get_dht_time

    from p2ptrain.averaging.averager import RoundResult

    nodes = dhts(3)
    averagers = three_fp16_averagers(nodes, "hangup_diloco", allreduce_timeout=60.0, next_chunk_timeout=20.0)
    try:
        for averager in averagers:
            averager.start_in_background(timeout_s=30)
        for round_index in range(3):
            results, seconds = {}, {}

            def step(i: int, averager) -> None:
                averager.set_group_bits(f"{round_index:08b}")
                averager.set_round_plan(window_s=4.0, target_group_size=3)
                control = averager.step(gather={"i": i}, weight=1.0, scheduled_time=get_dht_time() + 4.0,
                                        timeout=60.0, allow_retries=False, wait=False)
                results[i] = control.result(timeout=90.0)
                seconds[i] = results[i].allreduce_s

            run_threads(*(partial(step, i, a) for i, a in enumerate(averagers)))
            assert all(isinstance(r, RoundResult) and r.group_size == 3 for r in results.values()), results
            # from the group's forming to every peer's result: the wire and the codec, no reducer left waiting
            assert max(seconds.values()) < 10.0, seconds
        tensors = []
        for averager in averagers:
            with averager.get_tensors() as (tensor,):
                tensors.append(tensor.clone())
        assert all(torch.equal(t, tensors[0]) for t in tensors)  # bit-identical, every round averaged by all three
        assert torch.allclose(tensors[0], torch.full((FP16_VALUES,), 1.0))
    finally:
        for averager in averagers:
            averager.shutdown()


def test_a_member_counted_into_the_group_that_never_runs_the_round_costs_seconds_not_the_timeouts(dhts, monkeypatch):
    """The WAN benchmark stalled 10 minutes: one member's matchmaking gave up as the leader counted it into the group,
    so it never ran the round, and the others waited for its parts (sender_timeout, 300 s there) and then for its
    range (reducer_timeout). A member that sends nothing START_TIMEOUT_S into the all-reduce is left out, and one
    that answers no part of its range in twice that is a failed reducer: the honest members' round fails fast,
    names the deserter (the host re-runs it without it) and leaves their tensors as they were."""
    from p2ptrain.averaging import allreduce
    from p2ptrain.averaging.averager import PseudoGradientAverager

    nodes = dhts(3)
    deserter_id = nodes[2].peer_id
    run_allreduce = PseudoGradientAverager._run_allreduce_inplace_

    async def deserting(self, *args, **kwargs):
        if self.peer_id == deserter_id:  # in the group, but never runs its all-reduce (nor answers as a reducer)
            await asyncio.sleep(3600)
        return await run_allreduce(self, *args, **kwargs)

    # the averager processes fork from here and keep both
    monkeypatch.setattr(PseudoGradientAverager, "_run_allreduce_inplace_", deserting)
    monkeypatch.setattr(allreduce, "START_TIMEOUT_S", 3.0)
    # a range for every member, the deserter's too
    averagers = three_fp16_averagers(nodes, "desert_diloco", allreduce_timeout=300.0, next_chunk_timeout=100.0)
    try:
        outcomes = round_with_a_missing_member(averagers, step_timeout_s=300.0)  # the deserter's step never ends
        assert_nothing_applied(averagers, outcomes)  # the round was not complete
        deserter = averagers[2].peer_id.to_base58()
        for i in (0, 1):
            assert outcomes[i, "s"] < 30.0, outcomes  # the start timeouts (3 s, 6 s), not 100-300 s
            assert deserter in averagers[i].last_failed_members, (averagers[i].last_failed_members, outcomes)
    finally:
        for averager in averagers:
            averager.shutdown()


def test_a_member_that_left_matchmaking_as_the_group_formed_ends_the_round_at_once_and_is_not_blamed(dhts, monkeypatch):
    """CI, 8 workers on 2 cores: a follower gave up on its leader's answer while the leader counted it in (hivemind
    drops a follower only once it sees the follower's stream close), so the group began without it. The others waited
    START_TIMEOUT_S for its parts, then ran the round again without it, while it still looked for them; the swarm split
    in two models. A peer that looks for a group with no join request out can be in no group formed so far: it
    answers a part stream for one at once (BAD_GROUP_ID), and the members end the round in about a second, nothing
    applied, without naming it among the failed (the host's retry counts it in again)."""
    from hivemind.averaging.matchmaking import Matchmaking
    from hivemind.proto import averaging_pb2

    from p2ptrain.averaging import allreduce

    nodes = dhts(3)
    leaver_id = nodes[2].peer_id
    request_join_group, kept_open = Matchmaking._request_join_group, []

    async def leaving_once_accepted(self, leader):
        if self.peer_id != leaver_id:
            return await request_join_group(self, leader)
        stub = self._servicer_type.get_stub(self._p2p, leader, namespace=self._prefix)
        stream = await stub.rpc_join_group(averaging_pb2.JoinRequest(
            schema_hash=self.schema_hash, expiration=self.get_request_expiration_time(), client_mode=False,
            gather=self.step_control.data_for_gather, group_key=self.group_key_manager.current_key))
        await anext(stream)
        kept_open.append(stream)  # open: the leader counts it in, as it did the follower whose close came late
        return None  # and it looks on, as that follower did

    # the averager processes fork from here and keep both
    monkeypatch.setattr(Matchmaking, "_request_join_group", leaving_once_accepted)
    monkeypatch.setattr(allreduce, "START_TIMEOUT_S", 30.0)
    averagers = three_fp16_averagers(nodes, "leaver_diloco", allreduce_timeout=300.0, next_chunk_timeout=100.0)
    try:
        # the leaver's window ends last: it never leads, it follows; it looks on until its timeout
        outcomes = round_with_a_missing_member(averagers, step_timeout_s=30.0, last_starts_later_s=1.0)
        assert_nothing_applied(averagers, outcomes)  # the round was not complete
        leaver = averagers[2].peer_id.to_base58()
        for i in (0, 1):
            assert outcomes[i, "s"] < 15.0, outcomes  # the window (4 s) and a second, not START_TIMEOUT_S (30 s)
            assert leaver not in averagers[i].last_failed_members, (averagers[i].last_failed_members, outcomes)
    finally:
        for averager in averagers:
            averager.shutdown()


def test_a_peer_alone_in_matchmaking_looks_the_group_up_a_few_times_a_second_not_in_a_loop(dhts):
    """hivemind's matchmaking asks the DHT for the group's declared leaders again as soon as an answer comes back
    while it has none (PotentialLeaders.pop_next_leader triggers the next update at once): a peer waiting alone for
    a group spun on DHT lookups. In the WAN benchmark a peer a fragment ahead of the others did so for 10-60 s a
    round, and every host's link carried ~150 kB/s of answers to it (its own ~450 kB/s): twice the int8 sync's bytes
    per phase. The lookups are paced (group_lookup_gaps: 0.05, 0.1, 0.2, 0.4, then GROUP_LOOKUP_INTERVAL_S); a group
    still forms at once when one is there."""
    from hivemind.utils import get_dht_time

    from p2ptrain.averaging.averager import PseudoGradientAverager
    from p2ptrain.lookup_pace import group_lookups_within

    nodes = dhts(2)
    averager = PseudoGradientAverager([torch.zeros(16)], nodes[1], prefix="lone_lookups", compression="fp16",
                                      min_group_size=2, target_group_size=2, min_matchmaking_time=2.0,
                                      request_timeout=2.0, shutdown_timeout=5)
    try:
        averager.start_in_background(timeout_s=30)
        window_s = 4.0
        averager.set_round_plan(window_s=window_s, target_group_size=2)
        started = time.monotonic()
        control = averager.step(weight=1.0, scheduled_time=get_dht_time() + window_s, timeout=window_s + 2.0,
                                allow_retries=False, wait=False)
        with pytest.raises(Exception):
            control.result(timeout=60.0)  # nobody to group with
        seconds = time.monotonic() - started
        assert seconds >= window_s - 1.0, seconds
        assert averager.group_lookups <= group_lookups_within(seconds) + 2, (averager.group_lookups, seconds)
        assert averager.group_lookups >= 2  # it did look
    finally:
        averager.shutdown()
