"""The convergence experiment's single-process simulation, and the real swarm against it."""

from __future__ import annotations

import pytest

from p2ptrain.bench.convergence import Setup, run_alone, run_diloco, run_swarm
from p2ptrain.config import DiLoCoConfig

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]


def test_diloco_with_one_peer_h1_and_a_plain_outer_step_is_training_alone():
    # one peer, a sync every step, outer SGD with lr 1 and no momentum: the global parameters follow the inner
    # optimizer exactly, so the result is the lone peer's
    setup = Setup(peers=1, steps=12)
    plain_outer = DiLoCoConfig(outer_lr=1.0, outer_momentum=0.0)
    assert run_diloco(setup, local_steps=1, compression="none", cfg=plain_outer) == \
        pytest.approx(run_alone(setup), abs=1e-5)


def test_the_swarm_lands_where_its_own_math_does(tmp_path):
    """Real `join` daemons (2 peers, fp32 on the wire) against the simulation of the same run: the swarm must not be
    worse than its math; float summation order is the only difference."""
    setup = Setup(peers=2, steps=30)
    simulated = run_diloco(setup, local_steps=10, compression="none")
    swarm = run_swarm(setup, local_steps=10, compression="none", out=tmp_path)
    print(f"simulated {simulated:.5f}, swarm {swarm:.5f}")
    assert swarm == pytest.approx(simulated, abs=2e-3)


def test_the_straggler_experiment_is_the_convergence_experiment_s_diloco_when_nobody_misses():
    from p2ptrain.bench.convergence_straggler import run_straggler, straggler_table

    setup = Setup(peers=2, steps=9)
    losses = {policy: run_straggler(setup, local_steps=3, miss_every=2, policy=policy)
              for policy in ("none", "discard", "fold")}
    assert losses["none"] == run_diloco(setup, local_steps=3, compression="fp16")
    # the straggler missed round 2 of 3, then sent one phase or two in round 3
    assert len(set(losses.values())) == 3
    table = straggler_table({p: {0: loss} for p, loss in losses.items()}, setup, 3, 2)
    change = 100 * (losses["fold"] / losses["none"] - 1)
    assert table[-1].startswith("| fold | ") and table[-1].endswith(f"{change:+.2f}% |")
