"""The outer SGD's in-place step (``outer.sgd_step_in_place_``): torch's bits and state, and no tensor allocated per
step after the first (issue 37)."""

from __future__ import annotations

import copy
from typing import List

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from p2ptrain.outer import is_plain_or_nesterov_sgd, make_outer_optimizer, outer_step_
from p2ptrain.schedules import scale_lrs

SHAPES = [(64, 48), (48,), (3, 5, 7), (1000,), (1,), (17, 1, 9)]
LR_FACTORS = [1.0, 0.5, 0.125, 1.0, 0.3]  # an LR schedule between steps (scale_lrs, as PeerState.apply_lr_schedules)
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def tensors(seed: int, device: str = "cpu") -> List[torch.Tensor]:
    """fp32 values of several shapes and magnitudes, the same for a seed on any device."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=generator) * 10.0 ** (i % 3 - 2)).to(device) for i, shape in
            enumerate(SHAPES)]


def assert_same_state(ours: dict, theirs: dict) -> None:
    """Two ``state_dict()``s hold the same keys, values and bits (but for the reference's ``foreach``, set by hand)."""
    assert [{**g, "foreach": None} for g in ours["param_groups"]] == [{**g, "foreach": None} for g in
                                                                       theirs["param_groups"]]
    assert ours["state"].keys() == theirs["state"].keys()
    for index, state in ours["state"].items():
        assert state.keys() == theirs["state"][index].keys()
        for key, value in state.items():
            assert torch.equal(value, theirs["state"][index][key]), (index, key)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("momentum", [0.9, 0.5, 0.0])
def test_the_in_place_step_takes_torchs_bits_and_keeps_its_state(momentum, foreach, device):
    start = tensors(0, device)
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    ours_opt = make_outer_optimizer(ours, lr=0.7, momentum=momentum)
    theirs_opt = make_outer_optimizer(theirs, lr=0.7, momentum=momentum)
    theirs_opt.param_groups[0]["foreach"] = foreach
    assert is_plain_or_nesterov_sgd(ours_opt)
    for step, factor in enumerate(LR_FACTORS):
        scale_lrs(ours_opt.param_groups, factor)
        scale_lrs(theirs_opt.param_groups, factor)
        average = tensors(step + 1, device)
        grads = [a.clone() for a in average]
        outer_step_(ours_opt, ours, average)
        for p, grad in zip(theirs, grads):
            p.grad = grad
        theirs_opt.step()
        for a, b in zip(ours, theirs):
            assert torch.equal(a, b), (step, a.shape)
        assert_same_state(ours_opt.state_dict(), theirs_opt.state_dict())
        # the averages are scratch: they hold the Nesterov update, as torch's foreach step leaves its gradients
        if foreach:
            assert all(torch.equal(a, g) for a, g in zip(average, grads))
        assert all(p.grad is None for p in ours)
    if momentum == 0:
        assert len(ours_opt.state) == 0  # as torch: plain SGD keeps no state at all


def test_a_loaded_state_steps_on_as_torch_would():
    """The momentum buffers come and go through ``state_dict``: a checkpoint or a state transfer loaded into a fresh
    optimizer steps on with torch's bits, and a buffer set by hand (``load_stepped_state_``) is the one stepped."""
    start = tensors(0)
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    theirs_opt = make_outer_optimizer(theirs, lr=0.7, momentum=0.9)
    for step in range(2):
        for p, grad in zip(theirs, tensors(step + 1)):
            p.grad = grad
        theirs_opt.step()
    ours = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    ours_opt = make_outer_optimizer(ours, lr=0.7, momentum=0.9)
    ours_opt.load_state_dict(copy.deepcopy(theirs_opt.state_dict()))  # as from a checkpoint: buffers of its own
    buffers = [ours_opt.state[p]["momentum_buffer"] for p in ours]
    outer_step_(ours_opt, ours, tensors(3))
    for p, grad in zip(theirs, tensors(3)):
        p.grad = grad
    theirs_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    assert_same_state(ours_opt.state_dict(), theirs_opt.state_dict())
    assert all(ours_opt.state[p]["momentum_buffer"] is buffer for p, buffer in zip(ours, buffers))


def allocations(step) -> List[int]:
    """The bytes of every CPU allocation ``step()`` makes, as torch's allocator reports them to the profiler."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    return [event.self_cpu_memory_usage for event in prof.events() if event.self_cpu_memory_usage > 0]


def test_after_the_first_the_in_place_step_allocates_no_tensor():
    params = [torch.nn.Parameter(t) for t in tensors(0)]
    outer = make_outer_optimizer(params, lr=0.7, momentum=0.9)
    average = tensors(1)
    smallest = min(t.numel() * t.element_size() for t in average if t.numel() > 1)  # bytes; a (1,) tensor: a scalar's
    first = allocations(lambda: outer_step_(outer, params, average))
    assert sum(a for a in first if a >= smallest) == sum(t.numel() * 4 for t in average if t.numel() > 1)  # buffers
    buffers = [outer.state[p]["momentum_buffer"] for p in params]
    pointers = [t.data_ptr() for t in params + buffers + average]
    for step in range(2, 5):
        average = [a.copy_(b) for a, b in zip(average, tensors(step))]
        made = allocations(lambda: outer_step_(outer, params, average))
        assert max(made, default=0) < smallest, made  # a few bytes at most: wrapped scalars, never a tensor's worth
    assert [t.data_ptr() for t in params + buffers + average] == pointers
    assert all(outer.state[p]["momentum_buffer"] is b for p, b in zip(params, buffers))

    # the counter-case, so the check above can fail: torch's own step allocates each Nesterov update anew
    for p, grad in zip(params, tensors(9)):
        p.grad = grad
    assert max(allocations(outer.step)) >= smallest


class CountingSGD(torch.optim.SGD):
    steps = 0

    def step(self, closure=None):
        CountingSGD.steps += 1
        return super().step(closure)


@pytest.mark.parametrize("build, in_place", [
    (lambda ps: make_outer_optimizer(ps, lr=0.7, momentum=0.9), True),
    (lambda ps: make_outer_optimizer(ps, lr=0.7, momentum=0.0), True),
    (lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True, foreach=True), True),
    (lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True, fused=True), False),  # torch's own kernel
    (lambda ps: torch.optim.SGD(ps, lr=torch.tensor(0.7), momentum=0.9, nesterov=True), False),
    (lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9), False),  # heavy ball, not Nesterov
    (lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True, weight_decay=0.1), False),
    (lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, dampening=0.1), False),
    (lambda ps: torch.optim.SGD(ps, lr=0.7, momentum=0.9, nesterov=True, maximize=True), False),
    (lambda ps: torch.optim.SGD([{"params": ps[:1]}, {"params": ps[1:]}], lr=0.7, momentum=0.9, nesterov=True),
     False),
    (lambda ps: torch.optim.Adam(ps, lr=0.1), False),
])
def test_any_other_outer_optimizer_steps_through_its_own_step(build, in_place, monkeypatch):
    params = [torch.nn.Parameter(t) for t in tensors(0)[:2]]
    outer = build(params)
    calls = []
    monkeypatch.setattr(outer, "step", lambda: calls.append(1) or type(outer).step(outer))
    outer_step_(outer, params, tensors(1)[:2])
    assert calls == ([] if in_place else [1])
    assert all(p.grad is None for p in params)


def test_a_subclass_of_sgd_is_another_optimizer():
    params = [torch.nn.Parameter(t) for t in tensors(0)[:2]]
    outer = CountingSGD(params, lr=0.7, momentum=0.9, nesterov=True)
    assert not is_plain_or_nesterov_sgd(outer)
    outer_step_(outer, params, tensors(1)[:2])
    assert CountingSGD.steps == 1
