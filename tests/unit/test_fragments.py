"""The streaming sync's plan (p2ptrain/fragments.py) and the merge rule (outer.merge_): pure values, no network."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.config import ConfigError, RunConfig, validate
from p2ptrain.fragments import FragmentPlan, check_schedule, split_fragments
from p2ptrain.outer import merge_


@pytest.mark.parametrize("sizes,fragments", [([10, 20, 30, 40, 50, 60], 3), ([1000, 1, 1, 1], 4), ([5] * 7, 2),
                                             ([100, 1, 100, 1, 100], 3), ([7], 1)])
def test_fragments_are_consecutive_runs_covering_every_tensor_once(sizes, fragments):
    runs = split_fragments(sizes, fragments)
    assert len(runs) == fragments and all(runs)
    assert [i for run in runs for i in run] == list(range(len(sizes)))


def test_fragments_are_about_equal_in_size():
    sizes = [64] * 2 + [4096, 64, 16384, 64] * 12 + [64]  # a transformer's shape: a few large, many small tensors
    totals = [sum(sizes[i] for i in run) for run in split_fragments(sizes, 4)]
    assert max(totals) / min(totals) < 1.25, totals


def test_schedule_staggers_rounds_and_ends_the_phase_with_the_last_fragment():
    plan = FragmentPlan.build([10] * 8, local_steps=20, fragments=4, overlap_steps=3)
    assert [plan.launch_at(f) for f in range(4)] == [2, 7, 12, 17]
    assert [plan.apply_at(f) for f in range(4)] == [5, 10, 15, 20]
    # one round in flight at a time: each fragment is applied before the next is launched
    assert all(plan.apply_at(f) < plan.launch_at(f + 1) for f in range(3))
    # local steps count from the run's start: the same places in every phase
    assert plan.due(20 * 3 + 7, plan.launch_at) == 1 and plan.due(20 * 3 + 20, plan.apply_at) == 3
    assert plan.due(20 * 3 + 8, plan.launch_at) is None
    assert plan.committed(20 * 3 + 12) == [True, True, False, False]
    assert plan.committed(20 * 4) == [False] * 4  # a phase's end is the next one's start
    assert plan.describe() == "fragments=4 overlap=3 alpha=0.5"


def test_the_blocking_sync_is_the_plan_of_one_fragment_without_overlap():
    plan = FragmentPlan.build([10, 20], local_steps=5)
    assert not plan.streaming and plan.describe() == "" and plan.launch_at(0) == plan.apply_at(0) == 5


@pytest.mark.parametrize("h,f,tau,alpha,words", [
    (8, 9, 0, 0.5, "may not exceed local_steps"), (8, 2, 4, 0.5, "from 0 to 3"), (8, 2, -1, 0.5, "from 0 to 3"),
    (8, 2, 1, 1.5, "between 0 and 1"), (8, 0, 0, 0.5, "at least 1"),
])
def test_impossible_schedules_are_refused_in_one_line_naming_the_flag(h, f, tau, alpha, words):
    with pytest.raises(ValueError, match=words) as raised:
        check_schedule(h, f, tau, alpha)
    assert "\n" not in str(raised.value) and "--" in str(raised.value)


def test_the_config_refuses_a_schedule_that_cannot_run():
    config = RunConfig(run_id="x")
    config.diloco.local_steps, config.diloco.fragments, config.diloco.overlap_steps = 8, 2, 4
    with pytest.raises(ConfigError, match="--overlap-steps"):
        validate(config)
    with pytest.raises(ValueError, match="too few for 3 fragments"):
        FragmentPlan.build([10, 10], local_steps=8, fragments=3)


def test_merge_keeps_alpha_of_the_local_values_and_is_a_copy_at_zero():
    local, global_ = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([3.0, 2.0, -1.0])
    mixed = local.clone()
    merge_([mixed], [global_], 0.25)
    torch.testing.assert_close(mixed, 0.25 * local + 0.75 * global_)
    copied = local.clone().to(torch.bfloat16)
    merge_([copied], [global_], 0.0)
    assert torch.equal(copied, global_.to(torch.bfloat16))
