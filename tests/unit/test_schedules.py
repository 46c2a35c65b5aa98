"""The learning-rate schedules: their factors, how they set param groups, and that a peer resuming from saved
counters continues the schedule where the saver was."""

from __future__ import annotations

import math

import pytest
import torch

from p2ptrain import config
from p2ptrain.config import DiLoCoConfig
from p2ptrain.schedules import (
    SCHEDULES,
    inner_lr_factor,
    inner_lr_schedule,
    outer_lr_factor,
    outer_lr_schedule,
    scale_lrs,
)


def factor(step, kind="cosine", warmup_steps=10, total_steps=110, min_lr_ratio=0.1):
    return inner_lr_factor(step, kind=kind, warmup_steps=warmup_steps, total_steps=total_steps,
                           min_lr_ratio=min_lr_ratio)


def test_config_names_the_schedules_this_module_has():
    assert tuple(config.LR_SCHEDULES) == SCHEDULES


@pytest.mark.parametrize("kind", SCHEDULES)
def test_warmup_rises_linearly_from_the_first_step(kind):
    assert [factor(s, kind) for s in range(10)] == pytest.approx([(s + 1) / 10 for s in range(10)])
    assert factor(10, kind) == 1.0  # the end of the warm-up is the schedule's start


@pytest.mark.parametrize("kind, middle", [("cosine", 0.55), ("linear", 0.55)])
def test_decays_reach_min_lr_ratio_at_total_steps_and_stay(kind, middle):
    assert factor(60, kind) == pytest.approx(middle)  # half-way: cosine and linear agree there
    assert factor(110, kind) == pytest.approx(0.1)
    assert factor(10_000, kind) == pytest.approx(0.1)


def test_cosine_and_linear_differ_between_their_endpoints():
    quarter = 10 + 25
    assert factor(quarter, "linear") == pytest.approx(0.1 + 0.9 * 0.75)
    assert factor(quarter, "cosine") == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))


def test_constant_and_no_warmup():
    assert factor(0, "constant", warmup_steps=0, total_steps=None) == 1.0
    assert factor(10_000, "constant", total_steps=None) == 1.0
    assert factor(0, "linear", warmup_steps=0, total_steps=100) == 1.0


def test_a_decay_without_total_steps_is_refused():
    with pytest.raises(ValueError, match="total_steps"):
        factor(20, "cosine", total_steps=None)


def test_outer_warmup():
    assert [outer_lr_factor(k, 4) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert outer_lr_factor(0, 0) == 1.0


def test_defaults_make_no_schedule_so_nothing_touches_the_optimizer():
    assert inner_lr_schedule(DiLoCoConfig()) is None
    assert outer_lr_schedule(DiLoCoConfig()) is None
    schedule = inner_lr_schedule(DiLoCoConfig(lr_schedule="linear", warmup_steps=2, total_steps=12, min_lr_ratio=0.0))
    assert [schedule(s) for s in (0, 1, 2, 7, 12)] == pytest.approx([0.5, 1.0, 1.0, 0.5, 0.0])
    assert inner_lr_schedule(DiLoCoConfig(warmup_steps=3))(0) == pytest.approx(1 / 3)
    assert outer_lr_schedule(DiLoCoConfig(outer_warmup_steps=2))(0) == 0.5


def test_scale_lrs_keeps_the_base_lr_and_never_compounds():
    groups = [{"lr": 0.4}, {"lr": 0.2}]
    scale_lrs(groups, 0.5)
    scale_lrs(groups, 0.5)
    assert [g["lr"] for g in groups] == [0.2, 0.1]
    assert [g["initial_lr"] for g in groups] == [0.4, 0.2]
    groups[0]["lr"] = 123.0  # e.g. a donor's LR, downloaded with its state: the base stays this peer's
    scale_lrs(groups, 1.0)
    assert [g["lr"] for g in groups] == [0.4, 0.2]


def _adamw(base_lr=1e-2):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=base_lr)


def _inner_step(model, opt, schedule, local_step):
    """What DiLoCoOptimizer.step does with an inner schedule: apply it at the local step, then step."""
    scale_lrs(opt.param_groups, schedule(local_step))
    model(torch.randn(3, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return local_step + 1


def test_a_peer_loaded_at_a_local_step_continues_the_schedule_there():
    schedule = inner_lr_schedule(DiLoCoConfig(lr_schedule="cosine", warmup_steps=3, total_steps=20))
    model, saver = _adamw()
    local_step = 0
    for _ in range(7):
        local_step = _inner_step(model, saver, schedule, local_step)
    saved = {"inner": saver.state_dict(), "local_step": local_step}

    # a fresh peer: its constructor applied the schedule at step 0; then load_state_dict, which re-applies it
    _, loader = _adamw()
    scale_lrs(loader.param_groups, schedule(0))
    loader.load_state_dict(saved["inner"])
    scale_lrs(loader.param_groups, schedule(saved["local_step"]))

    scale_lrs(saver.param_groups, schedule(local_step))  # what the saver's own next step would use
    assert loader.param_groups[0]["lr"] == saver.param_groups[0]["lr"] == pytest.approx(1e-2 * schedule(7))
    assert loader.param_groups[0]["initial_lr"] == 1e-2


def test_a_checkpoint_written_without_a_schedule_is_the_base_of_one():
    _, unscheduled = _adamw(base_lr=3e-3)
    _, loader = _adamw(base_lr=1e-2)
    loader.load_state_dict(unscheduled.state_dict())  # torch replaces the groups: no initial_lr in them
    scale_lrs(loader.param_groups, 0.5)
    assert loader.param_groups[0]["lr"] == pytest.approx(1.5e-3)
