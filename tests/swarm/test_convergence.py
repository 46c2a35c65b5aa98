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
