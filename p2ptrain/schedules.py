"""Learning-rate schedules as pure functions of the swarm's step counters.

A factor multiplies each parameter group's base learning rate. It depends only on ``local_step`` (the inner
schedule) or ``outer_step`` (the outer warm-up), which every peer holds in common: checkpoints store them and a
newcomer takes them with the swarm's state. So a resumed peer or a newcomer is at the same point of the schedule
as the swarm, with no scheduler state of its own to save or transfer.
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Callable, Iterable, Optional

if TYPE_CHECKING:
    from p2ptrain.config import DiLoCoConfig

SCHEDULES = ("constant", "cosine", "linear")
"""the inner schedules after the warm-up (config.LR_SCHEDULES is a light copy)"""

Schedule = Callable[[int], float]
"""a step counter -> the factor of the base learning rate at that step"""


def inner_lr_factor(step: int, *, kind: str, warmup_steps: int, total_steps: Optional[int],
                    min_lr_ratio: float) -> float:
    """The inner learning rate at inner step ``step`` (0-based), as a fraction of the base one: a linear warm-up
    from 0 (step s of it gets (s + 1) / warmup_steps, so the first step already moves), then ``kind``: "constant"
    (1), or a "cosine" or "linear" decay from 1 at the end of the warm-up to ``min_lr_ratio`` at ``total_steps``,
    flat after it."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    if total_steps is None or total_steps <= warmup_steps:
        raise ValueError(f"a {kind} schedule needs total_steps above warmup_steps {warmup_steps}, got {total_steps}")
    progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
    if kind == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif kind == "linear":
        remaining = 1.0 - progress
    else:
        raise ValueError(f"unknown learning-rate schedule {kind!r}; use constant, cosine or linear")
    return min_lr_ratio + (1.0 - min_lr_ratio) * remaining


def outer_lr_factor(outer_step: int, warmup_steps: int) -> float:
    """The outer learning rate of outer step ``outer_step`` (0-based), as a fraction of the base one: a linear
    warm-up, (outer_step + 1) / warmup_steps, then 1."""
    if warmup_steps <= 0:
        return 1.0
    return min(1.0, (outer_step + 1) / warmup_steps)


def scale_lrs(param_groups: Iterable[dict], factor: float) -> None:
    """Set each group's ``lr`` to ``factor`` x its base learning rate. The base is ``group["initial_lr"]``, recorded
    from the group's ``lr`` the first time (as torch's LR schedulers do): every later ``lr`` is a scaled one."""
    for group in param_groups:
        group.setdefault("initial_lr", group["lr"])
        group["lr"] = group["initial_lr"] * factor


def inner_lr_schedule(config: DiLoCoConfig) -> Optional[Schedule]:
    """The inner schedule the config asks for; None for a constant learning rate without warm-up, so that the
    optimizer leaves its param groups untouched."""
    if config.lr_schedule == "constant" and config.warmup_steps == 0:
        return None
    return functools.partial(inner_lr_factor, kind=config.lr_schedule, warmup_steps=config.warmup_steps,
                             total_steps=config.total_steps, min_lr_ratio=config.min_lr_ratio)


def outer_lr_schedule(config: DiLoCoConfig) -> Optional[Schedule]:
    """The outer warm-up the config asks for; None without one."""
    if config.outer_warmup_steps == 0:
        return None
    return functools.partial(outer_lr_factor, warmup_steps=config.outer_warmup_steps)
