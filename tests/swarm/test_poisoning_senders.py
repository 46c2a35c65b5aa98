"""The sender check in a real private swarm: 3 honest DiLoCo peers and a key holder that poisons its pseudo-gradient.

Every peer runs ``--aggregation mean+check``: the reducers sign each sender's sums with their receipts, every member
adds them up and scores the senders after each round (averaging/sender_scores.py). A poisoner (x5, a sign flip at
its own norm, a fixed direction at 5x, or training on another task than the swarm's) must be convicted by every
honest member in the third round it is flagged in, and left out of every round after; with nobody poisoning, nobody
is convicted and every round averages the whole group. A small drift or a stale pseudo-gradient is not caught
(docs/security.md, "Catching a poisoning sender").
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
from tests.swarm.test_rogue import (INNER, OUTER, PLAUSIBLE_POISONS, RUN, TEACHER, PlausiblePoisoner, honest_swarm,
                                    learn_step, logs_to_stderr, make_deeper_model, swarm_key)

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]

__all__ = ["logs_to_stderr", "swarm_key"]  # the fixtures, shared with test_rogue

LOCAL_STEPS, OUTER_STEPS = 3, 5
CONVICTED_IN = 3
"""the sender check convicts in the third round in a row a sender is flagged in (sender_check.ROUNDS)"""

POISONS = {"x5": PLAUSIBLE_POISONS["x5"], "flip": lambda b: -b, "direction": PLAUSIBLE_POISONS["direction"],
           "wrong-data": lambda b: b}
"""what the poisoner sends of its pseudo-gradient; "wrong-data" sends it as it is, but learns another map than the
swarm's (``OTHER_TEACHER``): it trains on other data than its shard"""
OTHER_TEACHER = torch.randn(16, 4, generator=torch.Generator().manual_seed(8))


class Poisoner(PlausiblePoisoner):
    """A key holder that trains like the others and sends ``POISONS[poison]`` of its pseudo-gradient; it gives up
    a round it cannot average (it is excluded) and applies its own."""


def train(dhts, poison=None):
    """One DiLoCoOptimizer per DHT, each in its own thread, learning one linear map from its own samples; peer 0
    poisons if ``poison``. The honest peers train until their last outer step, the poisoner until they are done.
    Returns the honest peers' parameters, every peer's history and banned peers, and the peer ids."""
    if poison is not None:
        PLAUSIBLE_POISONS["swarm-test"] = POISONS[poison]
        Poisoner.poison = "swarm-test"
    models = [make_deeper_model() for _ in dhts]
    kinds = [Poisoner if poison is not None else DiLoCoOptimizer] + [DiLoCoOptimizer] * (len(dhts) - 1)
    def settings(kind):
        return DiLoCoConfig(local_steps=LOCAL_STEPS, compression="fp16", matchmaking_time_s=2.0,
                            averaging_timeout_s=6.0, target_group_size=len(dhts), aggregation="mean+check",
                            no_group_policy="apply_local" if kind is Poisoner else "wait")

    opts = [kind(model.parameters(), dht=dht, run_id=RUN, inner_optimizer=INNER, outer_optimizer=OUTER,
                 settings=settings(kind), options=DiLoCoOptions(batch_size=8)).start()
            for kind, model, dht in zip(kinds, models, dhts)]
    honest = range(1 if poison is not None else 0, len(dhts))
    done, errors = threading.Event(), []

    def run(i):
        try:
            gen = torch.Generator().manual_seed(100 + i)
            for _ in range(LOCAL_STEPS * OUTER_STEPS * 4):
                if opts[i].outer_step >= OUTER_STEPS or (i not in honest and done.is_set()):
                    break
                x = torch.randn(8, 16, generator=gen)
                teacher = OTHER_TEACHER if poison == "wrong-data" and i not in honest else TEACHER
                learn_step(models[i], opts[i], x, x @ teacher + 0.1 * torch.randn(8, 4, generator=gen))
        except BaseException as e:
            errors.append(e)

    try:
        run_peers(run, len(dhts), honest, done, errors)
        return ([[p.detach().clone() for p in models[i].parameters()] for i in honest],
                [list(o.history) for o in opts], [o.averager.banned_peers for o in opts],
                [o.averager.peer_id.to_base58() for o in opts])
    finally:
        for opt in opts:
            opt.close()


def run_peers(run, peers: int, honest, done: threading.Event, errors: list) -> None:
    """``run(i)`` for every peer, each in a thread of its own: the honest ones until they end, then the others
    until they see ``done``; fails on what any raised (into ``errors``) or on a peer that hangs."""
    threads = [threading.Thread(target=run, args=(i,)) for i in range(peers)]
    for t in threads:
        t.start()
    for i in honest:
        threads[i].join(timeout=240)
    done.set()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "a peer hung"


def run_swarm(swarm_key, poison=None):
    dhts = honest_swarm(swarm_key, 4)
    try:
        return train(dhts, poison)
    finally:
        for dht in dhts:
            stop_dht(dht)


@pytest.mark.slow
@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_poisoning_sender_is_convicted_in_its_third_round_and_left_out_after(swarm_key, poison, capfd,
                                                                              logs_to_stderr):
    params, histories, banned, ids = run_swarm(swarm_key, poison)
    rogue = ids[0]
    for history, excluded in zip(histories[1:], banned[1:]):
        rounds = [(r.outer_step, r.group_size, r.averaged) for r in history]
        assert [r.outer_step for r in history if r.averaged] == list(range(1, OUTER_STEPS + 1)), rounds
        # in the group for the rounds that convict it, never after
        assert [r.group_size for r in history] == [4] * CONVICTED_IN + [3] * (OUTER_STEPS - CONVICTED_IN), rounds
        assert all(rogue in r.members for r in history[:CONVICTED_IN]), rounds
        assert all(rogue not in r.members for r in history[CONVICTED_IN:]), rounds
        assert rogue in excluded and set(excluded) == {rogue}, excluded
    for other in params[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other, params[0])), "the honest peers' models differ"
    logs = capfd.readouterr()
    assert f"for {CONVICTION_S:.0f}s: the sender check convicted it: flagged in 3 rounds in a row" in logs.err + logs.out


@pytest.mark.slow
def test_with_nobody_poisoning_nobody_is_convicted(swarm_key):
    _, histories, banned, _ = run_swarm(swarm_key)
    for history, excluded in zip(histories, banned):
        assert [(r.outer_step, r.group_size) for r in history] == [(s, 4) for s in range(1, OUTER_STEPS + 1)], history
        assert excluded == []
