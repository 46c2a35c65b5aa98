"""What ``DiLoCoOptimizer`` is told beyond its tensors and optimizers: the run's settings (``config.DiLoCoConfig``,
the ``[diloco]`` section a CLI peer reads from its config) and this peer's own knobs (``DiLoCoOptions``), and the
mapping of the constructor's old keyword arguments onto them."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from p2ptrain.averaging.audit import AUDIT_PARTS
from p2ptrain.averaging.compression import COMPRESSION_CHOICES, SPARSE
from p2ptrain.averaging.sparse import DEFAULT_DECAY, DEFAULT_K
from p2ptrain.config import DiLoCoConfig
from p2ptrain.diloco.records import NO_GROUP_POLICIES
from p2ptrain.fragments import DEFAULT_MERGE_ALPHA
from p2ptrain.schedules import Schedule
from p2ptrain.swarm.progress import ProgressPublisher


@dataclass
class DiLoCoOptions:
    """A peer's own knobs, which the run's peers need not agree on and ``DiLoCoConfig`` does not declare."""

    batch_size: Optional[int] = None
    """samples per inner step, the default weight unit of ``step`` (``step(batch_size=...)`` wins)"""
    error_feedback: Optional[bool] = None
    """keep what the wire rounded off this peer's pseudo-gradient (fp32, CPU, one copy of the parameters) and add it
    to the next one. None: on for "int8" only. Dropped when the peer takes the swarm's state or its round is not
    averaged; in neither checkpoints nor the state newcomers download"""
    max_norm_ratio: Optional[float] = 10.0
    """a peer's part of the all-reduce (or a reducer's average) whose norm exceeds this many times this peer's own
    values over the same range is refused and the peer excluded for a while; None: no bound"""
    catch_up_mid_phase: bool = True
    """when the live peers' records show the swarm at a later outer step, take the swarm's state at the next inner
    step instead of finishing an inner phase nobody will average. Off for a peer of several ranks (hsdp)"""
    inner_lr_schedule: Optional[Schedule] = None
    """``local_step -> factor`` of each inner param group's base LR (``p2ptrain/schedules.py``); None: left alone"""
    outer_lr_schedule: Optional[Schedule] = None
    """``outer_step -> factor`` of the outer optimizer's base LR; None: left alone"""
    progress: Optional[ProgressPublisher] = None
    """publish progress through this publisher (e.g. one that already carries a shard claim)"""
    progress_period_s: float = 5.0
    """how often the peer's progress record in the DHT is refreshed between syncs"""
    client_mode: Optional[bool] = None
    """never accept incoming connections (peers behind NAT); None: the DHT's mode"""
    averager_start_timeout_s: float = 60.0
    """how long the averager process may take to start"""
    replayer: Any = None
    """the replay check's view of this peer's training (``diloco.replay.Replayer``: a replica of the model, the
    data): needed where ``settings.replay_rate`` > 0"""


def default_settings(local_steps: int) -> DiLoCoConfig:
    """The settings of a library user who passes none: the constructor's defaults of old, which are the config's
    except where the averaging modules' own constants are named (equal today; they stay the reference)."""
    return DiLoCoConfig(local_steps=local_steps, audit_parts=AUDIT_PARTS, sparse_k=DEFAULT_K,
                        sparse_decay=DEFAULT_DECAY, merge_alpha=DEFAULT_MERGE_ALPHA)


SETTINGS_FIELDS = ("compression", "aggregation", "audit_parts", "sparse_k", "sparse_decay", "fragments",
                   "overlap_steps", "merge_alpha", "max_extra_steps", "adaptive_steps", "matchmaking_time_s",
                   "late_peer_wait_s", "averaging_timeout_s", "min_group_size", "target_group_size", "no_group_policy")
"""the old keyword arguments that are ``DiLoCoConfig`` fields now (``settings=``)"""
OPTIONS_FIELDS = tuple(f.name for f in dataclasses.fields(DiLoCoOptions) if f.name != "replayer")
"""the old keyword arguments that are ``DiLoCoOptions`` fields now (``options=``)"""


def resolve(local_steps: Optional[int], settings: Optional[DiLoCoConfig], options: Optional[DiLoCoOptions],
            legacy: Dict[str, Any]) -> Tuple[DiLoCoConfig, DiLoCoOptions]:
    """The settings and options a constructor call means: ``local_steps`` given wins over the settings', an old
    keyword argument over both (one ``DeprecationWarning`` names the new spelling of each); an unknown one is a
    ``TypeError``, as it always was."""
    unknown = sorted(set(legacy) - set(SETTINGS_FIELDS) - set(OPTIONS_FIELDS))
    if unknown:
        raise TypeError(f"DiLoCoOptimizer() got an unexpected keyword argument {unknown[0]!r}")
    if settings is None:
        if local_steps is None:
            raise TypeError("DiLoCoOptimizer() missing required keyword argument: 'local_steps' (or settings=)")
        settings = default_settings(local_steps)
    elif local_steps is not None and local_steps != settings.local_steps:
        settings = dataclasses.replace(settings, local_steps=local_steps)
    options = options if options is not None else DiLoCoOptions()
    if legacy:
        spelled = [f"{name}= -> settings=DiLoCoConfig({name}=...)" if name in SETTINGS_FIELDS
                   else f"{name}= -> options=DiLoCoOptions({name}=...)" for name in sorted(legacy)]
        warnings.warn("DiLoCoOptimizer's keyword arguments of settings are deprecated: " + "; ".join(spelled),
                      DeprecationWarning, stacklevel=3)
        settings = dataclasses.replace(settings, **{k: v for k, v in legacy.items() if k in SETTINGS_FIELDS})
        options = dataclasses.replace(options, **{k: v for k, v in legacy.items() if k in OPTIONS_FIELDS})
    check_settings(settings)
    return settings, options


def check_settings(settings: DiLoCoConfig) -> None:
    """What the optimizer refuses of its settings (a ``ValueError`` naming the field), as its constructor did."""
    if settings.local_steps < 1:
        raise ValueError(f"local_steps must be at least 1, got {settings.local_steps}")
    if settings.no_group_policy not in NO_GROUP_POLICIES:
        raise ValueError(f"no_group_policy must be one of {NO_GROUP_POLICIES}, got {settings.no_group_policy!r}")
    if settings.matchmaking_time_s <= 0 or settings.averaging_timeout_s <= 0:
        raise ValueError("matchmaking_time_s and averaging_timeout_s must be positive")
    if settings.late_peer_wait_s is not None and settings.late_peer_wait_s < 0:
        raise ValueError(f"late_peer_wait_s must be at least 0, got {settings.late_peer_wait_s}")
    if settings.min_group_size < 1:
        raise ValueError(f"min_group_size must be at least 1, got {settings.min_group_size}")
    if settings.compression not in COMPRESSION_CHOICES:
        raise ValueError(f"unknown compression {settings.compression!r}; use one of: {', '.join(COMPRESSION_CHOICES)}")
    if settings.compression == SPARSE and settings.target_group_size is not None:
        raise ValueError("compression 'sparse' averages the whole swarm in one group: no target_group_size")
