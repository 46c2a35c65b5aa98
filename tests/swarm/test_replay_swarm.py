"""The replay check in a real private swarm: 3 honest DiLoCo peers and a key holder that poisons its pseudo-gradient.

Every peer runs ``replay_rate`` > 0 with a replica of the model and a data stream anyone can regenerate from its
claim (seed, batch): after each round, a verifier fetches a sender's claim and parts, trains the claimed steps on
the replica and compares (diloco/replay.py). A drift (20% of the norm along a fixed direction, added to an honest
pseudo-gradient: no direction check sees it), a wrong-data peer (it trains on another map than the one its claim
names) and a x5 must each be found after their first round, accused in the second and left out of every round from
the third on, by every honest member alike; with nobody poisoning, every replay agrees and nobody is excluded. With
only one honest verifier drawing, its accusation makes the two others replay that round themselves: the same
exclusion, at the same round.
"""

from __future__ import annotations

import threading

import pytest
import torch

from p2ptrain import DiLoCoOptimizer
from p2ptrain.averaging.sender_scores import CONVICTION_S
from p2ptrain.config import DiLoCoConfig
from p2ptrain.diloco.options import DiLoCoOptions
from p2ptrain.swarm.dht import stop_dht
from tests.swarm.test_poisoning_senders import run_peers
from tests.swarm.test_rogue import (INNER, OUTER, PLAUSIBLE_POISONS, RUN, TEACHER, PlausiblePoisoner, honest_swarm,
                                    logs_to_stderr, make_deeper_model, swarm_key)

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

__all__ = ["logs_to_stderr", "swarm_key"]  # the fixtures, shared with test_rogue

LOCAL_STEPS, OUTER_STEPS = 3, 5
EXCLUDED_FROM = 3
"""found after round 1, accused in round 2's join data, excluded by every member after it: out from round 3"""
OTHER_TEACHER = torch.randn(16, 4, generator=torch.Generator().manual_seed(8))


def _drift(buffer: torch.Tensor) -> torch.Tensor:
    """The honest pseudo-gradient plus 20% of its norm along a fixed direction (bench --attack drift's)."""
    direction = torch.randn(buffer.shape, generator=torch.Generator().manual_seed(buffer.numel()))
    return buffer + direction * (0.2 * torch.linalg.vector_norm(buffer) / torch.linalg.vector_norm(direction))


class _Stale:
    """The pseudo-gradient of its previous round (its first round's is honest)."""

    def __init__(self) -> None:
        self.previous = {}

    def __call__(self, buffer: torch.Tensor) -> torch.Tensor:
        sent = self.previous.get(id(buffer), buffer).clone()
        self.previous[id(buffer)] = buffer.clone()
        return sent


POISONS = {"drift": _drift, "x5": PLAUSIBLE_POISONS["x5"], "wrong-data": lambda b: b, "stale": _Stale}
"""what the rogue sends of its pseudo-gradient; "wrong-data" sends it as it is but trains on another map than the
one its claims name; "stale" (a class: one memory per run) sends its last round's"""


class Withholder(DiLoCoOptimizer):
    """Gathers its claims like every member, but its averager shows none of them."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.averager.replay.keep_claim = lambda **_: None  # before the averager process forks (start)


class FalseAccuser(DiLoCoOptimizer):
    """An honest trainer that accuses ``victim`` of every round it was in."""

    victim = ""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        gather = self._state.more_to_gather
        self._state.more_to_gather = lambda: dict(gather(), accuse=[[self.victim, self.outer_step - 1]])


def batch(seed: int, index: int, teacher: torch.Tensor = TEACHER):
    """Batch ``index`` of the data stream ``seed``: anyone can make it again from the two numbers."""
    gen = torch.Generator().manual_seed(1000 * seed + index)
    x = torch.randn(8, 16, generator=gen)
    return x, x @ teacher + 0.1 * torch.randn(8, 4, generator=gen)


class StreamReplayer:
    """A peer's data stream and a replica of its model (``diloco.replay.Replayer``): the claim is the stream's seed
    and the index of the batch last taken."""

    def __init__(self, seed: int) -> None:
        self.seed, self.next_batch = seed, 0
        self.replica = make_deeper_model()

    def take(self, teacher: torch.Tensor = TEACHER):
        self.next_batch += 1
        return batch(self.seed, self.next_batch - 1, teacher)

    def claim(self) -> dict:
        return {"seed": self.seed, "batch": self.next_batch - 1}

    def parameters(self):
        return list(self.replica.parameters())

    def step(self, claim: dict, step: int, optimizer) -> None:
        x, y = batch(claim["seed"], claim["batch"] + step)
        torch.nn.functional.mse_loss(self.replica(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()


def train(dhts, poison=None, rates=(1.0, 1.0, 1.0, 1.0), rogue=PlausiblePoisoner, rogues: int = 1):
    """One DiLoCoOptimizer per DHT, each in its own thread, with ``rates[i]``; the first ``rogues`` peers are
    ``rogue``s if ``poison`` (a ``PlausiblePoisoner`` sending ``POISONS[poison]``)."""
    if poison in POISONS:
        PLAUSIBLE_POISONS["replay-test"] = POISONS[poison]() if poison == "stale" else POISONS[poison]
        PlausiblePoisoner.poison = "replay-test"
    models = [make_deeper_model() for _ in dhts]
    streams = [StreamReplayer(seed=100 + i) for i in range(len(dhts))]
    honest = range(rogues if poison is not None else 0, len(dhts))
    opts = []
    for i, (model, dht) in enumerate(zip(models, dhts)):
        kind = DiLoCoOptimizer if i in honest else rogue
        # no adaptive steps: every peer trains H steps a phase however loaded the host (strides are replayed as
        # claimed: tests/unit/test_replay_claims.py), so runs with and without the check train the same steps
        settings = DiLoCoConfig(local_steps=LOCAL_STEPS, compression="fp16", matchmaking_time_s=2.0,
                                averaging_timeout_s=6.0, target_group_size=len(dhts), replay_rate=rates[i],
                                adaptive_steps=False,
                                no_group_policy="wait" if i in honest else "apply_local")
        opts.append(kind(model.parameters(), dht=dht, run_id=RUN, inner_optimizer=INNER, outer_optimizer=OUTER,
                         settings=settings, options=DiLoCoOptions(batch_size=8, replayer=streams[i])).start())
    done, errors = threading.Event(), []

    def run(i):
        try:
            teacher = OTHER_TEACHER if poison == "wrong-data" and i not in honest else TEACHER
            for _ in range(LOCAL_STEPS * OUTER_STEPS * 4):
                if opts[i].outer_step >= OUTER_STEPS or (i not in honest and done.is_set()):
                    break
                x, y = streams[i].take(teacher)
                torch.nn.functional.mse_loss(models[i](x), y).backward()
                opts[i].step()
                opts[i].zero_grad()
        except BaseException as e:
            errors.append(e)

    try:
        run_peers(run, len(dhts), honest, done, errors)
        for opt in opts:  # the last round's replays, which run beside the next phase
            if opt.replay_check is not None:
                opt.replay_check.settle()
        return ([[p.detach().clone() for p in models[i].parameters()] for i in honest],
                [list(o.history) for o in opts], [o.averager.banned_peers for o in opts],
                [o.averager.peer_id.to_base58() for o in opts], [o._replay for o in opts])
    finally:
        for opt in opts:
            opt.close()


def run_swarm(swarm_key, poison=None, rates=(1.0, 1.0, 1.0, 1.0), rogue=PlausiblePoisoner, rogues: int = 1):
    dhts = honest_swarm(swarm_key, len(rates))
    FalseAccuser.victim = dhts[1].peer_id.to_base58()
    try:
        return train(dhts, poison, rates, rogue, rogues)
    finally:
        for dht in dhts:
            stop_dht(dht)


def assert_excluded_from_round_3(params, histories, banned, ids, excluded_from=EXCLUDED_FROM, rogues: int = 1):
    peers, rogue_ids = len(ids), set(ids[:rogues])
    for history, excluded in zip(histories[rogues:], banned[rogues:]):
        rounds = [(r.outer_step, r.group_size, r.averaged) for r in history]
        assert [r.outer_step for r in history if r.averaged] == list(range(1, OUTER_STEPS + 1)), rounds
        assert [r.group_size for r in history] == \
            [peers] * (excluded_from - 1) + [peers - rogues] * (OUTER_STEPS - excluded_from + 1), rounds
        assert all(not rogue_ids & set(r.members) for r in history[excluded_from - 1:]), rounds
        assert set(excluded) == rogue_ids, excluded
    for other in params[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other, params[0])), "the honest peers' models differ"


@pytest.mark.slow
def test_two_colluders_of_six_are_each_found_by_the_replay_and_left_out_together(swarm_key):
    """Two drifting key holders of 6: the replay judges each sender on its own claim, so colluders, who could hold a
    median a direction check reads, are found like one."""
    params, histories, banned, ids, checks = run_swarm(swarm_key, "drift", rates=(1.0,) * 6, rogues=2)
    assert_excluded_from_round_3(params, histories, banned, ids, rogues=2)
    for check in checks[2:]:
        assert set(check.convicted) == set(ids[:2]), check.convicted


@pytest.mark.slow
@pytest.mark.parametrize("poison", ["drift", "wrong-data", "x5"])
def test_a_poisoning_sender_is_found_by_its_replay_and_left_out_from_the_third_round(swarm_key, poison, capfd,
                                                                                  logs_to_stderr):
    params, histories, banned, ids, checks = run_swarm(swarm_key, poison)
    assert_excluded_from_round_3(params, histories, banned, ids)
    for check in checks[1:]:  # each honest verifier replayed the rogue's first round and found it
        assert ids[0] in check.convicted and check.convicted[ids[0]].startswith("round 1:"), check.convicted
        honest_deviations = [d for peer, ds in check.deviations.items() if peer != ids[0] for d in ds]
        assert honest_deviations and max(honest_deviations) < 1e-3, check.deviations
    logs = capfd.readouterr()
    assert f"for {CONVICTION_S:.0f}s: the replay check convicted it: round 1:" in logs.err + logs.out


@pytest.mark.slow
def test_a_stale_pseudo_gradient_is_found_in_its_first_stale_round(swarm_key):
    params, histories, banned, ids, checks = run_swarm(swarm_key, "stale")
    assert_excluded_from_round_3(params, histories, banned, ids, excluded_from=EXCLUDED_FROM + 1)
    for check in checks[1:]:
        assert check.convicted[ids[0]].startswith("round 2:"), check.convicted
        assert check.deviations[ids[0]][0] == 0.0, check.deviations  # its first round was honest


@pytest.mark.slow
def test_a_sender_that_does_not_show_its_claim_is_convicted_for_it(swarm_key):
    params, histories, banned, ids, checks = run_swarm(swarm_key, "withhold", rogue=Withholder)
    assert_excluded_from_round_3(params, histories, banned, ids)
    for check in checks[1:]:
        assert "does not show the claim it gathered" in check.convicted[ids[0]], check.convicted


@pytest.mark.slow
def test_a_false_accusation_costs_one_replay_and_silences_its_accuser(swarm_key, capfd, logs_to_stderr):
    _, histories, banned, ids, checks = run_swarm(swarm_key, "accuse", rates=(1e-9,) * 4, rogue=FalseAccuser)
    for history, excluded in zip(histories, banned):
        assert [(r.outer_step, r.group_size) for r in history] == [(s, 4) for s in range(1, OUTER_STEPS + 1)], history
        assert excluded == []
    for check in checks[2:]:  # the victim's round 1, replayed once on the first accusation; the rest ignored
        assert check.convicted == {} and check.deviations == {ids[1]: [0.0]}, check.deviations
    assert f"peer {ids[0]} accused {ids[1]} of a false pseudo-gradient in round 1" in "".join(capfd.readouterr())


@pytest.mark.slow
def test_one_verifiers_accusation_has_the_others_replay_and_exclude_at_the_same_round(swarm_key):
    # the rogue and two honest peers draw (almost) never: only peer 1's replay finds the drift, and its accusation
    params, histories, banned, ids, checks = run_swarm(swarm_key, "drift", rates=(1e-9, 1.0, 1e-9, 1e-9))
    assert_excluded_from_round_3(params, histories, banned, ids)
    for check in checks[2:]:  # they replayed the accused round only: the rogue's round 1
        assert list(check.deviations) == [ids[0]] and len(check.deviations[ids[0]]) == 1, check.deviations


def held_out_loss(params) -> float:
    model = make_deeper_model()
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
        x, y = batch(seed=999, index=0)
        return float(torch.nn.functional.mse_loss(model(x), y))


@pytest.mark.slow
def test_with_nobody_poisoning_every_replay_agrees_nobody_is_excluded_and_the_model_is_the_same(swarm_key):
    params, histories, banned, _, checks = run_swarm(swarm_key)
    for history, excluded, check in zip(histories, banned, checks):
        assert [(r.outer_step, r.group_size) for r in history] == [(s, 4) for s in range(1, OUTER_STEPS + 1)], history
        assert excluded == [] and check.convicted == {}
        # every other sender of every round replayed, bit for bit (one process, one thread count)
        assert sorted(len(ds) for ds in check.deviations.values()) == [OUTER_STEPS] * 3, check.deviations
        assert max(d for ds in check.deviations.values() for d in ds) == 0.0, check.deviations
    # the same swarm without the check ends on the same model: the check changes nothing it does not convict (up
    # to the order in which a reducer adds its senders' parts, which the arrivals set)
    unchecked, unchecked_histories, _, _, _ = run_swarm(swarm_key, rates=(0.0,) * 4)
    for history in unchecked_histories:
        assert [(r.outer_step, r.group_size) for r in history] == [(s, 4) for s in range(1, OUTER_STEPS + 1)], history
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(params[0], unchecked[0]))
    with_check, without = held_out_loss(params[0]), held_out_loss(unchecked[0])
    print(f"held-out loss with the replay check {with_check:.6f}, without {without:.6f}")
    assert abs(with_check - without) <= 1e-4 * without
