"""Mixing groups: who averages with whom (``p2ptrain.mixing``), the math of a round whose members hold different
global parameters (``bench.convergence.mixing_round_`` over ``outer.stepped_state_``), and the convergence
benchmark's simulation of it (``run_mixing``) against plain DiLoCo."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from p2ptrain.averaging.compression import get_compression
from p2ptrain.bench.convergence import (Setup, convergence_table, experiment, mixing_name, mixing_round_,
                                        mixing_table, run_diloco, run_mixing)
from p2ptrain.config import DiLoCoConfig
from p2ptrain.mixing import group_key, groups_of, key_bits
from p2ptrain.outer import make_outer_optimizer, momentum_buffers

pytestmark = pytest.mark.timeout(60)


def _ids(n: int):
    return [f"peer{i:03d}" for i in range(n)]


def _group_of(groups, peer):
    return next(set(g) for g in groups if peer in g)


# --- who averages with whom -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 10, 16, 17, 27, 40])
@pytest.mark.parametrize("group_size", [2, 3, 4, 8])
def test_groups_partition_the_peers_in_groups_of_at_most_g(n, group_size):
    peers = _ids(n)
    for round_index in range(4):
        groups = groups_of(list(reversed(peers)), group_size, round_index)  # the input's order does not matter
        members = [p for g in groups for p in g]
        assert sorted(members) == peers, "every peer in exactly one group"
        assert all(1 <= len(g) <= group_size for g in groups)
        assert all(g == sorted(g) for g in groups)


def test_sixteen_peers_in_groups_of_four_are_all_linked_within_two_rounds():
    # i and j share a group in round t, or some k shares one with i in round t and with j in round t + 1: after the
    # two rounds of one order (rows in round t, its columns in round t + 1; t even) i's state has reached j
    peers = _ids(16)
    for t in range(0, 8, 2):
        now, following = groups_of(peers, 4, t), groups_of(peers, 4, t + 1)
        assert [len(g) for g in now] == [4] * 4 and [len(g) for g in following] == [4] * 4
        for i, j in itertools.product(peers, peers):
            linked = j in _group_of(now, i) or bool(_group_of(now, i) & _group_of(following, j))
            assert linked, f"{i} and {j} are not linked by rounds {t} and {t + 1}"
        # and not by one round alone
        assert any(j not in _group_of(now, i) for i, j in itertools.product(peers, peers))
    # the order is drawn again every other round: rounds 0 and 2 do not make the same groups
    assert groups_of(peers, 4, 0) != groups_of(peers, 4, 2)


@pytest.mark.parametrize("group_size", [2, 4, 8, None])
def test_no_more_peers_than_g_is_one_group_of_everybody(group_size):
    for n in range(1, (group_size or 6) + 1):
        peers = _ids(n)
        for round_index in range(3):
            assert groups_of(peers, group_size, round_index) == [peers]
            assert group_key(peers[0], peers, group_size, round_index) is None
            assert key_bits(group_key(peers[0], peers, group_size, round_index)) == ""


@pytest.mark.parametrize("n,group_size", [(16, 4), (16, 8), (10, 4), (9, 2), (27, 3), (40, 4)])
def test_key_bits_are_equal_within_a_group_and_differ_between_groups(n, group_size):
    peers = _ids(n)
    for round_index in range(4):
        groups = groups_of(peers, group_size, round_index)
        bits = [{key_bits(group_key(p, peers, group_size, round_index)) for p in g} for g in groups]
        assert all(len(b) == 1 for b in bits), "one key per group"
        keys = [b.pop() for b in bits]
        assert len(set(keys)) == len(keys), "different groups, different keys"
        assert all(k and set(k) <= {"0", "1"} for k in keys)


# --- the math of a mixing round -------------------------------------------------------------------------------------

def _replicas(count: int, momentum: float, seed: int = 0):
    """``count`` replicas with different global parameters (two tensors) and, with momentum, momentum buffers."""
    generator = torch.Generator().manual_seed(seed)
    global_params = [[torch.randn(5, 3, generator=generator).requires_grad_(True),
                      torch.randn(7, generator=generator).requires_grad_(True)] for _ in range(count)]
    cfg = DiLoCoConfig(outer_lr=0.7, outer_momentum=momentum)
    outers = [make_outer_optimizer(g, lr=cfg.outer_lr, momentum=cfg.outer_momentum) for g in global_params]
    if momentum:
        for opt, params in zip(outers, global_params):
            for g in params:
                opt.state[g]["momentum_buffer"] = torch.randn(g.shape, generator=generator)
    return global_params, outers, cfg


def _mean(tensors):
    return torch.stack([t.detach() for t in tensors]).mean(0)


def _zeros(global_params):
    return [[torch.zeros_like(g) for g in params] for params in global_params]


def _two_rounds_of_groups_of_two(global_params, outers, cfg, gradients):
    peers = _ids(len(global_params))
    mixed = []
    for round_index in range(2):
        groups = [[peers.index(p) for p in g] for g in groups_of(peers, 2, round_index)]
        mixed.append(mixing_round_(groups, global_params, outers, [[t.clone() for t in g] for g in gradients], None,
                                   get_compression("fp16"), cfg))
    return mixed


def test_a_full_grid_of_mixing_rounds_without_momentum_leaves_every_replica_at_the_mean():
    global_params, outers, cfg = _replicas(4, momentum=0.0)
    expected = [_mean(ts) for ts in zip(*global_params)]
    # zero pseudo-gradients and no momentum: the outer step changes nothing, the rounds only average
    assert _two_rounds_of_groups_of_two(global_params, outers, cfg, _zeros(global_params)) == [2, 2]
    for params in global_params:
        for g, e in zip(params, expected):
            torch.testing.assert_close(g.detach(), e, atol=1e-6, rtol=0)


def test_a_full_grid_of_mixing_rounds_with_momentum_is_two_outer_steps_of_the_mean_state():
    global_params, outers, cfg = _replicas(4, momentum=0.9)
    mean_params = [_mean(ts) for ts in zip(*global_params)]
    mean_momenta = [_mean(ts) for ts in zip(*(momentum_buffers(o, g) for o, g in zip(outers, global_params)))]
    assert _two_rounds_of_groups_of_two(global_params, outers, cfg, _zeros(global_params)) == [2, 2]
    # Nesterov with a zero gradient, twice: m <- mu m, p <- p - lr mu m
    lr, mu = cfg.outer_lr, cfg.outer_momentum
    for _ in range(2):
        mean_momenta = [mu * m for m in mean_momenta]
        mean_params = [p - lr * mu * m for p, m in zip(mean_params, mean_momenta)]
    for params, opt in zip(global_params, outers):
        for g, m, p_expected, m_expected in zip(params, momentum_buffers(opt, params), mean_params, mean_momenta):
            torch.testing.assert_close(g.detach(), p_expected, atol=1e-6, rtol=0)
            torch.testing.assert_close(m, m_expected, atol=1e-6, rtol=0)


def test_a_mixed_group_takes_the_outer_sgd_step_of_its_mean_state_with_its_mean_pseudo_gradient():
    global_params, outers, cfg = _replicas(3, momentum=0.9, seed=1)
    generator = torch.Generator().manual_seed(2)
    gradients = [[torch.randn(g.shape, generator=generator) for g in params] for params in global_params]
    # the reference: torch's own outer SGD on the mean state, with the mean pseudo-gradient
    reference = [_mean(ts).requires_grad_(True) for ts in zip(*global_params)]
    reference_opt = make_outer_optimizer(reference, lr=cfg.outer_lr, momentum=cfg.outer_momentum)
    for g, ms in zip(reference, zip(*(momentum_buffers(o, p) for o, p in zip(outers, global_params)))):
        reference_opt.state[g]["momentum_buffer"] = _mean(ms)
    for g, gs in zip(reference, zip(*gradients)):
        g.grad = _mean(gs)
    reference_opt.step()
    assert mixing_round_([[0, 1, 2]], global_params, outers, gradients, None, get_compression("fp16"), cfg) == 1
    for params, opt in zip(global_params, outers):
        for g, m, r in zip(params, momentum_buffers(opt, params), reference):
            torch.testing.assert_close(g.detach(), r.detach(), atol=1e-6, rtol=0)
            torch.testing.assert_close(m, reference_opt.state[r]["momentum_buffer"], atol=1e-6, rtol=0)


def test_a_group_of_identical_replicas_averages_pseudo_gradients_through_the_codec():
    cfg = DiLoCoConfig(outer_lr=0.7, outer_momentum=0.9)
    start = [torch.randn(5, 3, generator=torch.Generator().manual_seed(3)), torch.zeros(7)]
    global_params = [[t.clone().requires_grad_(True) for t in start] for _ in range(2)]
    outers = [make_outer_optimizer(g, lr=cfg.outer_lr, momentum=cfg.outer_momentum) for g in global_params]
    gradients = [[torch.full_like(t, 1 / 3) for t in start] for _ in range(2)]
    assert mixing_round_([[0, 1]], global_params, outers, gradients, None, get_compression("fp16"), cfg) == 0
    # SGD's first Nesterov step, p - lr (1 + mu) g, with g as the fp16 wire rounds 1/3
    wire = torch.tensor(1 / 3).half().float()
    for params in global_params:
        for g, t in zip(params, start):
            torch.testing.assert_close(g.detach(), t - cfg.outer_lr * (1 + cfg.outer_momentum) * wire, atol=1e-6,
                                       rtol=0)
    for a, b in zip(*global_params):
        assert torch.equal(a, b), "both replicas took the same step"


# --- the benchmark's simulation -------------------------------------------------------------------------------------

TINY = Setup(peers=4, steps=8, batch_size=4, eval_batches=2)


def test_mixing_in_one_group_of_everybody_is_plain_diloco_exactly():
    result = run_mixing(TINY, local_steps=4, group_size=4)
    assert result["eval_loss"] == run_diloco(TINY, local_steps=4)
    assert result["spread"] == [0.0, 0.0]
    assert result["mixed_groups"] == [0, 0] and result["groups"] == [1, 1]
    assert result["mean_eval_loss"] == pytest.approx(result["eval_loss"], abs=1e-6)


def test_mixing_in_groups_of_two_reports_its_spread_per_round():
    result = run_mixing(TINY, local_steps=4, group_size=2)
    assert math.isfinite(result["eval_loss"]) and math.isfinite(result["mean_eval_loss"])
    assert len(result["spread"]) == 2
    assert all(math.isfinite(s) and 0 < s < 0.5 for s in result["spread"])
    # round 0: two groups of replicas that start equal; round 1: each pairs members of both, which differ
    assert result["groups"] == [2, 2] and result["mixed_groups"] == [0, 2]


def test_the_experiment_puts_a_mixing_row_next_to_each_one_group_row():
    results = experiment([8], [4], ["fp16"], TINY, echo=lambda _: None, mixing=[2])
    names = [r["name"] for r in results["runs"]]
    assert names == ["alone", "data_parallel", "diloco H=4 fp16", mixing_name(4, "fp16", 2)]
    assert len(results["runs"][-1]["spread"]) == 2
    table = "\n".join(convergence_table(results))
    assert mixing_name(4, "fp16", 2) in table
    assert len(mixing_table(results)) == 5  # header, rule, one row, blank, note
    assert mixing_table({"runs": results["runs"][:3]}) == []


def test_bench_convergence_takes_mixing_group_sizes_and_more_than_eight_peers(tmp_path):
    import json

    from click.testing import CliRunner

    from p2ptrain.cli.bench import bench

    runner = CliRunner()
    result = runner.invoke(bench, ["--convergence", "8", "--peers", "4", "--local-steps", "4", "--batch-size", "4",
                                   "--model", "tiny", "--mixing-group-size", "2", "--no-swarm", "--out",
                                   str(tmp_path)])
    assert result.exit_code == 0, result.output
    runs = json.loads((tmp_path / "convergence.json").read_text())["runs"]
    assert [r["name"] for r in runs][-1] == mixing_name(4, "fp16", 2) and len(runs[-1]["spread"]) == 2
    assert "## Mixing groups" in (tmp_path / "convergence.md").read_text()
    assert runner.invoke(bench, ["--convergence", "8", "--mixing-group-size", "1"]).exit_code == 2
    refused = runner.invoke(bench, ["--peers", "9", "--loopback"])
    assert refused.exit_code != 0 and "at most 8" in refused.output
