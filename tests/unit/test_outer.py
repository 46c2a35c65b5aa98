"""DiLoCo's outer step with no network (p2ptrain.outer), held to the formulas written out by hand."""

from __future__ import annotations

import pytest
import torch

from p2ptrain.averaging.compression import get_compression
from p2ptrain.outer import (
    add_error_feedback_,
    group_average,
    make_outer_optimizer,
    outer_step_,
    pseudo_gradient_,
    wire_roundtrip,
)

PART = 2 ** 20  # bytes per all-reduce part: the tensors here fit in one


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=0, atol=1e-6)


def test_pseudo_gradient_is_the_last_sync_minus_now_in_the_buffers_dtype():
    global_params = [torch.tensor([1.0, 2.0, 3.0])]
    params = [torch.tensor([0.5, 2.5, 3.0], dtype=torch.bfloat16)]
    out = [torch.empty(3)]
    pseudo_gradient_(out, global_params, params)
    assert out[0].dtype == torch.float32 and torch.equal(out[0], torch.tensor([0.5, -0.5, 0.0]))


@pytest.mark.parametrize("codec_name", ["none", "fp16"])
def test_group_average_is_the_sample_weighted_mean_rounded_both_ways(codec_name):
    codec = get_compression(codec_name)
    rnd = (lambda x: x.half().float()) if codec_name == "fp16" else (lambda x: x)
    a, b = torch.tensor([0.1, -0.3, 1e-3, 7.0]), torch.tensor([0.5, 0.2, -2e-3, -1.0])
    (average,) = group_average([[a], [b]], [30.0, 10.0], codec, PART)
    expected = rnd((30 * rnd(a) + 10 * rnd(b)) / 40)
    assert close(average, expected), (average, expected)


def test_group_average_weight_zero_adds_nothing_and_all_zero_weights_give_zeros():
    codec = get_compression("none")
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([100.0, -100.0])
    (average,) = group_average([[a], [b]], [8.0, 0.0], codec, PART)
    assert close(average, a)
    (nothing,) = group_average([[torch.zeros(2)], [torch.zeros(2)]], [0.0, 0.0], codec, PART)
    assert torch.equal(nothing, torch.zeros(2))
    with pytest.raises(ValueError, match="2 contributions but 1 weights"):
        group_average([[a], [b]], [1.0], codec, PART)


def test_two_outer_steps_of_nesterov_sgd_written_out():
    lr, momentum = 0.7, 0.9
    start = torch.tensor([1.0, -2.0, 0.5])
    global_params = [start.clone().requires_grad_(True)]
    params = [torch.zeros(3)]
    outer = make_outer_optimizer(global_params, lr=lr, momentum=momentum)
    d1, d2 = torch.tensor([0.1, 0.2, -0.3]), torch.tensor([-0.05, 0.4, 0.0])
    outer_step_(outer, global_params, [d1.clone()], params)
    # first step: buf = d1; nesterov update = d1 + momentum * buf
    after_1 = start - lr * (d1 + momentum * d1)
    assert close(global_params[0].detach(), after_1) and close(params[0], after_1)
    assert global_params[0].grad is None
    outer_step_(outer, global_params, [d2.clone()], params)
    buf = momentum * d1 + d2
    after_2 = after_1 - lr * (d2 + momentum * buf)
    assert close(global_params[0].detach(), after_2) and close(params[0], after_2)


def test_outer_step_without_momentum_is_plain_sgd_and_params_keep_their_dtype():
    global_params = [torch.tensor([1.0, 1.0]).requires_grad_(True)]
    params = [torch.zeros(2, dtype=torch.bfloat16)]
    outer = make_outer_optimizer(global_params, lr=0.5, momentum=0.0)
    assert outer.param_groups[0]["nesterov"] is False
    outer_step_(outer, global_params, [torch.tensor([0.2, -0.2])], params)
    assert close(global_params[0].detach(), torch.tensor([0.9, 1.1]))
    assert params[0].dtype == torch.bfloat16 and torch.equal(params[0], torch.tensor([0.9, 1.1]).bfloat16())


def test_error_feedback_sends_last_rounds_loss_and_keeps_this_ones():
    codec = get_compression("int8")
    torch.manual_seed(0)
    first, second = torch.randn(1000), torch.randn(1000)
    residual = [torch.zeros(1000)]
    sent = [first.clone()]
    add_error_feedback_(sent, residual, codec, PART)
    assert torch.equal(sent[0], first)  # nothing was dropped before the first round
    dropped = first - wire_roundtrip(first, codec, PART)
    assert close(residual[0], dropped) and dropped.abs().max() > 1e-4  # int8 drops something
    sent = [second.clone()]
    add_error_feedback_(sent, residual, codec, PART)
    assert close(sent[0], second + dropped)
    assert close(residual[0], sent[0] - wire_roundtrip(sent[0], codec, PART))
    # over the two rounds, what the wire carried adds up to what was meant, less only the last residual
    carried = wire_roundtrip(first, codec, PART) + wire_roundtrip(sent[0], codec, PART)
    assert close(carried + residual[0], first + second)


def test_wire_roundtrip_rounds_each_part_on_its_own():
    codec = get_compression("int8")
    # two parts of 64 values (256 bytes of fp32, ~1 byte a value on the wire): one tiny, one large. Rounded as one
    # part, the tiny values would all vanish under the large part's scale.
    tensor = torch.cat([torch.full((64,), 1e-3), torch.full((64,), 10.0)])
    out = wire_roundtrip(tensor, codec, part_size_bytes=64)
    assert out[:64].abs().min() > 0 and (out[:64] - tensor[:64]).abs().max() < 1e-4
    whole = wire_roundtrip(tensor, codec, part_size_bytes=PART)
    assert whole[:64].abs().max() == 0  # the counter-case: one scale for all of it


def test_the_mean_of_stepped_states_is_the_step_of_the_mean_state():
    """Mixing groups (``outer.stepped_state_``): each member steps its own state alone, the group averages the
    results; by linearity that is the outer SGD step (Nesterov, or plain) of the mean state with the mean
    pseudo-gradient, and ``load_stepped_state_`` leaves the optimizer where that step would."""
    from p2ptrain.outer import load_stepped_state_, momentum_buffers, stepped_state_

    torch.manual_seed(0)
    for momentum in (0.9, 0.0):
        params = [torch.randn(6) for _ in range(3)]
        momenta = [torch.randn(6) for _ in range(3)]
        gradients = [torch.randn(6) for _ in range(3)]
        stepped = []
        for p, m, g in zip(params, momenta, gradients):
            out_p, out_m = torch.empty(6), torch.empty(6)
            stepped_state_([out_p], [out_m], [p], [m], [g], lr=0.7, momentum=momentum)
            stepped.append((out_p, out_m))
        mean_p = torch.stack([p for p, _ in stepped]).mean(0)
        mean_m = torch.stack([m for _, m in stepped]).mean(0)

        reference = torch.nn.Parameter(torch.stack(params).mean(0))
        opt = make_outer_optimizer([reference], lr=0.7, momentum=momentum)
        if momentum:
            opt.state[reference]["momentum_buffer"] = torch.stack(momenta).mean(0)
        outer_step_(opt, [reference], [torch.stack(gradients).mean(0)])
        assert torch.allclose(mean_p, reference.detach(), atol=1e-6)

        mine = torch.nn.Parameter(torch.zeros(6))
        mine_opt = make_outer_optimizer([mine], lr=0.7, momentum=momentum)
        model = [torch.zeros(6)]
        load_stepped_state_(mine_opt, [mine], [mean_p], [mean_m], model)
        assert torch.equal(mine.detach(), mean_p) and torch.equal(model[0], mean_p)
        if momentum:
            assert torch.allclose(momentum_buffers(mine_opt, [mine])[0], opt.state[reference]["momentum_buffer"],
                                  atol=1e-6)
        else:
            assert momentum_buffers(mine_opt, [mine]) == [None]
    # a peer's first outer step has no momentum buffer yet: zeros, as SGD's first step
    out_p, out_m = torch.empty(2), torch.empty(2)
    stepped_state_([out_p], [out_m], [torch.ones(2)], [None], [torch.ones(2)], lr=0.5, momentum=0.9)
    assert torch.equal(out_m, torch.ones(2)) and torch.allclose(out_p, torch.full((2,), 1 - 0.5 * 1.9))
