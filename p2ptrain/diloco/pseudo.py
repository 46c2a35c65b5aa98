"""``Contribution``: what this peer puts into the averager's buffers for a round (of all tensors, or of a fragment's):
its pseudo-gradient, the error feedback of its last one, the sparse message of its accumulator, and (mixing groups)
its stepped state. It touches only the ``PeerState``'s tensors and buffers, never the counters."""

from __future__ import annotations

import logging
from typing import List, Optional, Sequence

import torch

from p2ptrain.averaging.sparse import accumulate_, send_
from p2ptrain.diloco.context import PeerState
from p2ptrain.finite import all_finite_many
from p2ptrain.outer import add_error_feedback_, momentum_buffers, pseudo_gradient_, stepped_state_

logger = logging.getLogger("p2ptrain.diloco")  # the optimizer's logger: one name for the whole optimizer


class Contribution:
    """Fills the averager's buffers with this peer's side of a round, from ``state``'s tensors."""

    def __init__(self, state: PeerState):
        self.state = state

    def fill_pseudo_gradient(self, indices: Optional[List[int]] = None, what: str = "the pseudo-gradient",
                             feedback: bool = True) -> bool:
        """Write this peer's pseudo-gradient (plus its error-feedback residual, unless not ``feedback``: the caller
        adds it later with ``add_error_feedback``) into the averager's buffers: of every tensor, or of the tensors
        ``indices`` (a fragment's, streaming sync). True when local training diverged: then those buffers hold
        zeros, which the peer sends with weight 0."""
        s = self.state
        indices = range(len(s.global_params)) if indices is None else indices
        with s.averager.get_tensors() as all_buffers:
            buffers = [all_buffers[i] for i in indices]
            pseudo_gradient_(buffers, [s.global_params[i] for i in indices], [s.params[i] for i in indices])
            if not all_finite_many(buffers):
                # local training diverged: contribute nothing (weight 0, zeros) but still take the group's average,
                # which puts this peer back on the shared parameters; the group is not kept waiting for us
                residuals = [] if s.residuals is None else [s.residuals[i] for i in indices]
                for tensor in buffers + residuals:
                    tensor.zero_()
                logger.error(
                    f"{s.tag()} {what} has NaN/inf values (local training diverged); discarding this peer's "
                    "local progress since the last sync; lower inner_lr if this repeats"
                )
                return True
        if feedback:
            self.add_error_feedback(indices)
        return False

    @torch.no_grad()
    def add_error_feedback(self, indices: Sequence[int]) -> None:
        """Error feedback on the buffers ``indices`` (no-op without a residual): send what the wire dropped last
        time too, and keep what it will drop of this contribution (the same parts, rounded the same way as the
        all-reduce will); kept only if the round averages. Reads only the averager's buffers and the residuals, so a
        streaming launch runs it in the fragment's round thread, off the training thread."""
        s = self.state
        if s.residuals is None:
            return
        with s.averager.get_tensors() as all_buffers:
            add_error_feedback_([all_buffers[i] for i in indices], [s.residuals[i] for i in indices],
                                s.averager.codec, s.averager.part_size_bytes)

    @torch.no_grad()
    def fill_stepped_state(self, needed: bool = True) -> None:
        """Mixing groups: this peer's outer step taken alone, from the pseudo-gradient in the buffers (after its
        error feedback), into the state buffers. A group whose members start from different global parameters
        averages these instead of the pseudo-gradients (``RoundResult.mixed``). No-op without mixing; not
        ``needed`` (``swarm_view.may_mix_states``): left unfilled, and this round's gathered data says so (then no
        group of ours averages states)."""
        s = self.state
        s.stepped_ready = s.mixing and needed
        if not s.stepped_ready:
            return
        n = len(s.global_params)
        with s.averager.get_tensors() as buffers, s.state_lock:
            s.apply_lr_schedules()
            group = s.outer_optimizer.param_groups[0]
            stepped_state_(buffers[n:2 * n], buffers[2 * n:], s.global_params,
                           momentum_buffers(s.outer_optimizer, s.global_params), buffers[:n],
                           lr=group["lr"], momentum=group["momentum"])

    @torch.no_grad()
    def fill_sparse_message(self, fragment: int = 0) -> None:
        """Compression "sparse" (no-op otherwise): fold the pseudo-gradient in the buffers of ``fragment``'s tensors
        (all of them, blocking sync) into this peer's accumulator (e <- decay * e + g), pack its top-k as this
        round's message for the averager (its outbox), take what the message carries out of the accumulator, and
        leave that in the buffers: what this peer applies if it steps alone, until a round overwrites them with the
        group's average (sparse_round.py)."""
        s = self.state
        if s.accumulator is None:
            return
        indices = s.plan.tensors[fragment]
        accumulator = [s.accumulator[i] for i in indices]
        with s.averager.get_tensors() as all_buffers:
            buffers = [all_buffers[i] for i in indices]
            accumulate_(accumulator, buffers, s.sparse_decay)
            message, carried = send_(accumulator, s.averager.sparse_layouts[fragment])
            for buffer, value in zip(buffers, carried):
                buffer.copy_(value)
        s.averager.write_sparse_message(message)
        s.sparse_message_bytes = len(message)

    @torch.no_grad()
    def unsend_sparse_message(self, diverged: bool, sign: float = 1.0, fragment: int = 0) -> None:
        """The round's message (of ``fragment``) was never applied by anyone: its values go back into the
        accumulator (still in the buffers: no round wrote them), to be sent later. ``sign`` -1: take them out
        again."""
        s = self.state
        if s.accumulator is None or diverged:
            return
        with s.averager.get_tensors() as buffers:
            for i in s.plan.tensors[fragment]:
                s.accumulator[i].add_(buffers[i], alpha=sign)

    def zero_buffers(self, indices: Optional[Sequence[int]] = None) -> None:
        """Zeros in the buffers (of ``indices``, or all): joining a round in progress with weight 0."""
        with self.state.averager.get_tensors() as buffers:
            for i in range(len(buffers)) if indices is None else indices:
                buffers[i].zero_()
