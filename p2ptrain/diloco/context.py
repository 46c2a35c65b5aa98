"""``PeerState``: what the parts of ``DiLoCoOptimizer`` share, in one explicit object. The optimizer builds it and
hands it to each part (``pseudo.py``, ``reporting.py``, ``sync.py``, ``streaming.py``, ``catch_up.py``,
``state.py``); no part reads the optimizer itself, so each can be built in a test around a ``PeerState`` of its own.

Two locks order everything that touches it from more than one thread:

- ``sync_lock``: one sync (or fragment apply, or state download for a catch-up) at a time; ``shutdown()`` from another
  thread takes it to wait for the one in progress.
- ``state_lock``: what a newcomer downloads (global parameters, outer and inner state, counters) against the training
  thread changing it mid-copy; held for one inner step or one outer update at a time.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import torch

from p2ptrain.clock import PhaseClock
from p2ptrain.diloco.records import SyncRecord, _digest_of
from p2ptrain.fragments import FragmentPlan
from p2ptrain.schedules import Schedule, scale_lrs


@dataclass(eq=False)
class PeerState:
    """The tensors, counters, locks and buffers of one DiLoCo peer, shared by the optimizer's parts."""

    params: List[torch.Tensor]
    """the model's parameters (the inner optimizer's), in order"""
    global_params: List[torch.Tensor]
    """what every peer agreed on at the last sync, fp32 on CPU; the outer optimizer steps these"""
    inner_optimizer: torch.optim.Optimizer
    outer_optimizer: torch.optim.Optimizer
    averager: Any
    """the ``PseudoGradientAverager``: its buffers (shared memory with its process) hold the pseudo-gradients"""
    plan: FragmentPlan
    """which tensors each fragment holds and when it launches and is applied (one fragment: the blocking sync)"""
    local_steps: int
    """H: inner steps between syncs"""
    mixing: bool = False
    """groups of at most target_group_size average stepped states where their members differ (mixing.py)"""
    stepped_ready: bool = False
    """the state buffers hold this sync's stepped state (``Contribution.fill_stepped_state``; never without mixing)"""
    peer_id: str = ""
    """this peer's base58 id"""
    run_id: str = ""
    inner_lr_schedule: Optional[Schedule] = None
    outer_lr_schedule: Optional[Schedule] = None
    residuals: Optional[List[torch.Tensor]] = None
    """error feedback: what the wire dropped of this peer's last averaged pseudo-gradient, to be sent next time; each
    peer's own, never shared, dropped whenever its rounding no longer applies"""
    accumulator: Optional[List[torch.Tensor]] = None
    """compression "sparse": this peer's error-feedback accumulator (SparseLoCo); in checkpoints, never shared"""
    sparse_decay: float = 0.0

    local_step: int = 0
    outer_step: int = 0
    committed_local_step: int = 0
    """local step at which the last outer step was taken (a donor between the two is in a round)"""
    samples_since_sync: int = 0
    steps_since_sync: int = 0
    """inner steps in this peer's pseudo-gradient (the norm check's scale)"""
    digest: str = ""
    """the digest of ``global_params``' exact bits: equal on every peer after every committed round"""
    phase_started: float = field(default_factory=time.monotonic)
    """when this peer's current inner phase began (late_peer_wait_s)"""
    last_outer_step: Optional[int] = None
    """the outer step this peer leaves at, when its trainer knows it (--max-outer-steps, --until-outer-step): its
    last round waits for the late peers as long as a phase (round_policy.late_peer_wait_s)"""
    last_group: set = field(default_factory=set)
    """the other members of our last round that averaged (base58 ids)"""
    in_flight: Any = None
    """streaming sync: the ``FragmentRound`` in flight, if any"""
    donor_in_round: bool = False
    """the last downloaded state came from peers in the middle of a round"""
    donor_in_flight: Optional[list] = None
    """... of a fragment's round (streaming sync): [fragment, launch step]"""
    sparse_message_bytes: int = 0
    """the length of this peer's last sparse message"""
    history: List[SyncRecord] = field(default_factory=list)
    clock: PhaseClock = field(default_factory=PhaseClock)
    """the sync in progress's phases (SyncRecord.phases)"""
    sync_lock: threading.Lock = field(default_factory=threading.Lock)
    state_lock: threading.Lock = field(default_factory=threading.Lock)
    interrupted: threading.Event = field(default_factory=threading.Event)
    """set: stop looking for peers (the peer is leaving)"""
    more_to_gather: Optional[Callable[[], dict]] = None
    """what else this peer's join data carries (the replay check's claim and accusations: replay.py)"""

    @property
    def param_groups(self) -> list:
        return self.inner_optimizer.param_groups

    def tag(self) -> str:
        """The prefix of this peer's log lines."""
        return f"[{self.peer_id[-8:]} outer_step={self.outer_step}]"

    def apply_lr_schedules(self) -> None:
        """Set the inner and outer LRs for the current ``local_step`` and ``outer_step`` (the next steps')."""
        if self.inner_lr_schedule is not None:
            scale_lrs(self.inner_optimizer.param_groups, self.inner_lr_schedule(self.local_step))
        if self.outer_lr_schedule is not None:
            scale_lrs(self.outer_optimizer.param_groups, self.outer_lr_schedule(self.outer_step))

    def reset_residuals(self) -> None:
        if self.residuals is not None:
            for residual in self.residuals:
                residual.zero_()

    def global_digest(self) -> str:
        """A digest of the exact bits of the global parameters: equal on every peer after every committed round."""
        return _digest_of(self.global_params)
