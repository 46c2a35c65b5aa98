"""One fast finiteness check for the large tensors of a sync (pseudo-gradients, averages, received parts)."""

from __future__ import annotations

from typing import Iterable

import torch


def all_finite(tensor: torch.Tensor) -> bool:
    """True when no value of ``tensor`` is NaN or infinite.

    ``torch.isfinite(t).all()`` writes a bool tensor as large as ``t`` and reduces it: 0.3 s for the 25M-parameter
    model on one CPU core, and a sync checks the whole vector three times. ``aminmax`` reads it once (0.014 s):
    min and max propagate NaN, and an infinity is one of them."""
    if tensor.numel() == 0:
        return True
    if not tensor.is_floating_point():
        return True
    low, high = torch.aminmax(tensor.detach())
    return bool(torch.isfinite(low) & torch.isfinite(high))


def all_finite_many(tensors: Iterable[torch.Tensor]) -> bool:
    """True when no value of any of ``tensors`` is NaN or infinite.

    On the CPU, one ``all_finite`` per tensor (each a single read). On an accelerator, one fused multi-tensor kernel
    computes every tensor's largest absolute value where the tensors live (NaN propagates through it and an infinity
    is its own maximum) and one host round-trip reads the answer, instead of a transfer and a synchronization per
    tensor: a model of hundreds of tensors is checked in one go."""
    by_device: dict = {}
    for tensor in tensors:
        if tensor.is_floating_point() and tensor.numel():
            by_device.setdefault(tensor.device, []).append(tensor.detach())
    for device, group in by_device.items():
        if device.type == "cpu":
            if not all(all_finite(t) for t in group):
                return False
        elif not fused_all_finite(group):
            return False
    return True


def fused_all_finite(tensors: list) -> bool:
    """``all_finite_many`` for tensors on one device, as one ``_foreach_norm(inf)`` and one ``.item()``."""
    largest = torch._foreach_norm(tensors, ord=float("inf"))
    return bool(torch.isfinite(torch.stack([m.float() for m in largest])).all())
