"""DiLoCo's outer step over plain tensors: no network, no processes.

One round, for every peer of a group: its pseudo-gradient (the parameters at the last sync minus its parameters now),
plus what the wire dropped of its last one (error feedback), goes through the codec; the group averages the rounded
contributions weighted by the samples behind them, and the average is rounded again on its way back; an outer SGD with
Nesterov momentum applies it to the global parameters, and every replica restarts from them.

``DiLoCoOptimizer`` runs these around the network's all-reduce, which computes ``group_average`` in pieces across the
peers (``averaging.allreduce``); the convergence benchmark runs the whole round in one process; the tests hold both to
a written-out reference.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from p2ptrain.averaging.compression import WireCodec, wire_parts, wire_residual_
from p2ptrain.averaging.robust import robust_aggregate, weight_cap


@torch.no_grad()
def pseudo_gradient_(out: Sequence[torch.Tensor], global_params: Sequence[torch.Tensor],
                     params: Sequence[torch.Tensor]) -> None:
    """``out[i] = global_params[i] - params[i]``, in ``out``'s dtype and device (the averager's fp32 CPU buffers)."""
    for buffer, g, p in zip(out, global_params, params, strict=True):
        torch.sub(g, p.detach().to(buffer.device, buffer.dtype), out=buffer)


@torch.no_grad()
def add_error_feedback_(buffers: Sequence[torch.Tensor], residuals: Sequence[torch.Tensor], codec: WireCodec,
                        part_size_bytes: int) -> None:
    """Send what the wire dropped last time too (``buffers += residuals``), and keep what it will drop of this
    contribution (``residuals = buffers - wire(buffers)``), cut and rounded as the all-reduce will."""
    for buffer, residual in zip(buffers, residuals, strict=True):
        buffer.add_(residual)
    wire_residual_(list(residuals), buffers, codec, part_size_bytes)


@torch.no_grad()
def wire_roundtrip(tensor: torch.Tensor, codec: WireCodec, part_size_bytes: int) -> torch.Tensor:
    """What a peer receives of ``tensor``: each all-reduce part compressed and decompressed."""
    parts = wire_parts(tensor, codec, part_size_bytes)
    return torch.cat([codec.roundtrip(part).view(-1) for part in parts]).view_as(tensor)


@torch.no_grad()
def group_average(contributions: Sequence[Sequence[torch.Tensor]], weights: Sequence[float], codec: WireCodec,
                  part_size_bytes: int, aggregation: str = "mean") -> List[torch.Tensor]:
    """What every member of a group holds after the all-reduce: per tensor, the mean of the members' rounded
    contributions weighted by ``weights`` (their samples; 0 adds nothing, and a group that all weighs 0 gets zeros),
    rounded again on the way back. ``contributions[k]`` is member k's list of tensors, in the group's order. With an
    ``aggregation`` other than "mean", each wire part's robust aggregate (``robust.py``), as the part's reducer
    computes it."""
    if len(contributions) != len(weights):
        raise ValueError(f"{len(contributions)} contributions but {len(weights)} weights")
    cap = weight_cap(weights)  # as the reducers cap the members' claims
    weights = [min(float(w), cap) for w in weights]
    if aggregation != "mean":
        return [_robust_average(tensors, weights, codec, part_size_bytes, aggregation)
                for tensors in zip(*contributions, strict=True)]
    total = float(sum(weights)) or 1.0
    averages = []
    for tensors in zip(*contributions, strict=True):
        accumulator = torch.zeros_like(tensors[0], dtype=torch.float32)
        for tensor, weight in zip(tensors, weights):
            accumulator.add_(wire_roundtrip(tensor.float(), codec, part_size_bytes), alpha=weight)
        averages.append(wire_roundtrip(accumulator.div_(total), codec, part_size_bytes))
    return averages


def _robust_average(tensors: Sequence[torch.Tensor], weights: Sequence[float], codec: WireCodec,
                    part_size_bytes: int, aggregation: str) -> torch.Tensor:
    """One tensor's robust aggregate, wire part by wire part (a reducer sees only its parts), rounded both ways."""
    rounded = [wire_roundtrip(tensor.float(), codec, part_size_bytes) for tensor in tensors]
    result = torch.empty_like(rounded[0])
    split = [wire_parts(t, codec, part_size_bytes) for t in (result, *rounded)]
    for out, *parts in zip(*split):
        out.copy_(robust_aggregate(parts, weights, aggregation))
    return wire_roundtrip(result, codec, part_size_bytes)


def make_outer_optimizer(global_params: Sequence[torch.Tensor], lr: float, momentum: float) -> torch.optim.SGD:
    """The outer optimizer: SGD with Nesterov momentum (plain SGD when ``momentum`` is 0)."""
    return torch.optim.SGD(global_params, lr=lr, momentum=momentum, nesterov=momentum > 0)


def is_plain_or_nesterov_sgd(outer_optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``outer_optimizer`` is torch's SGD (not a subclass) with one param group, Nesterov or no momentum, and
    no weight decay, dampening or maximize: the outer optimizer ``make_outer_optimizer`` builds, whose step is
    ``m' = momentum * m + g``, ``p' = p - lr * (g + momentum * m')`` (or ``p' = p - lr * g``), linear in (p, m, g)."""
    if type(outer_optimizer) is not torch.optim.SGD or len(outer_optimizer.param_groups) != 1:
        return False
    group = outer_optimizer.param_groups[0]
    return (group["weight_decay"] == 0 and group["dampening"] == 0 and (group["nesterov"] or group["momentum"] == 0)
            and not group.get("maximize", False))


@torch.no_grad()
def outer_step_(outer_optimizer: torch.optim.Optimizer, global_params: Sequence[torch.Tensor],
                average: Sequence[torch.Tensor], params: Optional[Sequence[torch.Tensor]] = None) -> None:
    """Apply ``average`` (the group's pseudo-gradient, or this peer's own) as the gradient of the global parameters,
    then copy them into ``params`` (the model's, in its own device and dtype).

    ``average`` is scratch: afterwards it may hold the Nesterov update ``g + momentum * m'`` instead of ``g`` (as
    torch's foreach SGD, the default on CUDA, leaves its gradients too); a caller that needs ``g`` after the step
    passes a copy. The outer SGD ``make_outer_optimizer`` builds steps in place (``sgd_step_in_place_``), with the
    bits of its ``step()``; any other optimizer steps through ``step()``, and so does an SGD that asks for torch's
    fused kernel (bits of its own, and no temporary anyway) or holds its lr as a tensor."""
    group = outer_optimizer.param_groups[0]
    if (is_plain_or_nesterov_sgd(outer_optimizer) and not group.get("fused") and not group.get("differentiable")
            and not isinstance(group["lr"], torch.Tensor)):
        sgd_step_in_place_(outer_optimizer, global_params, average)
    else:
        for g, gradient in zip(global_params, average, strict=True):
            g.grad = gradient
        outer_optimizer.step()
        for g in global_params:
            g.grad = None
    if params is not None:
        for p, g in zip(params, global_params, strict=True):
            p.copy_(g)


@torch.no_grad()
def sgd_step_in_place_(outer_optimizer: torch.optim.SGD, global_params: Sequence[torch.Tensor],
                       average: Sequence[torch.Tensor]) -> None:
    """``outer_optimizer.step()`` with ``average`` as the gradients of ``global_params`` (tensors of its one param
    group, of which ``is_plain_or_nesterov_sgd`` holds), the Nesterov update written into ``average``: torch's
    single-tensor SGD allocates ``grad + momentum * m'`` anew for every tensor at every step (486 MB in all at the
    124m model). This allocates nothing but the momentum buffers, at their first step. The same ops in the same
    order as torch's single-tensor step (its foreach step runs them per tensor on CPU): the same bits. The buffers
    live in the optimizer's state where torch keeps them (its SGD keeps no step count), so ``state_dict``,
    ``load_state_dict`` and ``momentum_buffers`` see no difference. No device is assumed: it runs where the tensors
    are."""
    group = outer_optimizer.param_groups[0]
    lr, momentum = group["lr"], group["momentum"]  # read at each step: an LR schedule rescales lr (scale_lrs)
    for g, gradient in zip(global_params, average, strict=True):
        if momentum != 0:
            state = outer_optimizer.state[g]
            buffer = state.get("momentum_buffer")
            if buffer is None:  # torch's first step: the buffer is the gradient itself
                buffer = state["momentum_buffer"] = gradient.clone()
            else:
                buffer.mul_(momentum).add_(gradient)
            gradient.add_(buffer, alpha=momentum)
        g.add_(gradient, alpha=-lr)


@torch.no_grad()
def merge_(params: Sequence[torch.Tensor], global_params: Sequence[torch.Tensor], alpha: float) -> None:
    """``params = alpha * params + (1 - alpha) * global_params``, in ``params``' own device and dtype (alpha 0 is a
    plain copy: the bits of the global values)."""
    for p, g in zip(params, global_params, strict=True):
        if alpha == 0.0:
            p.copy_(g)
        else:
            p.lerp_(g.to(p.device, p.dtype), 1.0 - alpha)


@torch.no_grad()
def stepped_state_(out_params: Sequence[torch.Tensor], out_momenta: Sequence[torch.Tensor],
                   global_params: Sequence[torch.Tensor], momenta: Sequence[Optional[torch.Tensor]],
                   gradient: Sequence[torch.Tensor], lr: float, momentum: float) -> None:
    """This peer's outer step taken alone, written into ``out_params`` and ``out_momenta`` (the global parameters
    and momenta untouched): ``m' = momentum * m + g``, ``p' = p - lr * (g + momentum * m')`` (Nesterov, as the outer
    SGD; a missing momentum buffer is zeros, as SGD's first step), or ``p' = p - lr * g`` and ``m' = 0`` without
    momentum. Both are linear in (p, m, g): the weighted mean of the members' stepped states is the step of their
    mean state with their mean pseudo-gradient. That is what lets a mixing group whose members hold different
    global parameters (they averaged in different groups last round) average the stepped states instead: the
    result is the one DiLoCo step of the group's mean."""
    for p_out, m_out, p, m, g in zip(out_params, out_momenta, global_params, momenta, gradient, strict=True):
        if momentum == 0:
            m_out.zero_()
            torch.sub(p, g, alpha=lr, out=p_out)
            continue
        if m is None:
            m_out.copy_(g)
        else:
            torch.add(g, m, alpha=momentum, out=m_out)
        p_out.copy_(p).sub_(g, alpha=lr).sub_(m_out, alpha=lr * momentum)


def momentum_buffers(outer_optimizer: torch.optim.Optimizer,
                     global_params: Sequence[torch.Tensor]) -> List[Optional[torch.Tensor]]:
    """The outer SGD's momentum buffer of each global parameter (None before its first step, or without momentum)."""
    return [outer_optimizer.state.get(g, {}).get("momentum_buffer") for g in global_params]


@torch.no_grad()
def load_stepped_state_(outer_optimizer: torch.optim.Optimizer, global_params: Sequence[torch.Tensor],
                        mean_params: Sequence[torch.Tensor], mean_momenta: Sequence[torch.Tensor],
                        params: Optional[Sequence[torch.Tensor]] = None) -> None:
    """Take a mixing group's mean stepped state (``stepped_state_`` averaged) as this peer's outer step: the global
    parameters, the outer momentum (when the optimizer has any) and ``params`` (the model's copy)."""
    uses_momentum = outer_optimizer.param_groups[0].get("momentum", 0) != 0
    for g, p_mean, m_mean in zip(global_params, mean_params, mean_momenta, strict=True):
        g.copy_(p_mean)
        if uses_momentum:
            state = outer_optimizer.state[g]
            if state.get("momentum_buffer") is None:
                state["momentum_buffer"] = m_mean.clone()
            else:
                state["momentum_buffer"].copy_(m_mean)
    if params is not None:
        for p, g in zip(params, global_params, strict=True):
            p.copy_(g)


def mixes_groups(target_group_size: Optional[int], streaming: bool, outer_optimizer: torch.optim.Optimizer) -> bool:
    """Whether this peer keeps the stepped-state buffers of mixing groups: it caps its groups (below the swarm's size
    several groups form each round), syncs all parameters at once (a fragment's round has no such path yet), and its
    outer step is linear in (parameters, momentum, pseudo-gradient) (``is_plain_or_nesterov_sgd``,
    ``outer.stepped_state_``)."""
    return target_group_size is not None and not streaming and is_plain_or_nesterov_sgd(outer_optimizer)
