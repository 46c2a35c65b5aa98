"""One fast finiteness check for the large tensors of a sync (pseudo-gradients, averages, received parts)."""

from __future__ import annotations

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
