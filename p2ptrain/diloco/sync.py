"""The sync of all parameters at once (the blocking DiLoCo sync): the pseudo-gradient (with its error feedback)
into the averager's buffers, one round through ``Rounds``, the outer step, and the sync's record. A mixin of
``DiLoCoOptimizer`` (``optimizer.py``), whose attributes it uses; the streaming sync (``streaming.py``) runs the same
steps per fragment and shares the helpers here."""

from __future__ import annotations

import logging
import time
from typing import List, Optional, Sequence

import torch

from p2ptrain.averaging import RoundResult
from p2ptrain.clock import PhaseClock
from p2ptrain.diloco.records import Outcome, RoundOutcome, SyncRecord, _digest_of, sync_phases
from p2ptrain.diloco.rounds import Position
from p2ptrain.averaging.sparse import accumulate_, send_
from p2ptrain.finite import all_finite_many
from p2ptrain.outer import (add_error_feedback_, load_stepped_state_, momentum_buffers, outer_step_,
                            pseudo_gradient_, stepped_state_)
from p2ptrain.swarm.progress import FORCED_STORE_WAIT_S, wait_until_stored

logger = logging.getLogger(__package__)  # the optimizer's logger: one name for the whole optimizer


class BlockingSyncMixin:
    """``sync()``: average the pseudo-gradients of all parameters with the swarm and take one outer step."""

    def sync(self) -> SyncRecord:
        """Average pseudo-gradients with the swarm and take one outer step. Never raises for network failures."""
        self._require_started()
        if self.plan.streaming:
            raise RuntimeError("this optimizer syncs its fragments on their own schedule inside step() (fragments > 1 "
                               "or overlap_steps > 0); sync() is the blocking sync of all parameters")
        # close() from another thread waits for this lock: shutting the averager down under a running step()
        # would leave that step waiting for an answer from a process that is gone
        with self._sync_lock:
            return self._sync()

    @torch.no_grad()
    def _sync(self) -> SyncRecord:
        started = time.perf_counter()
        clock = self._clock = PhaseClock()
        self.throughput.update()
        # tell the others we are at the sync point now, not at the next periodic refresh: a round waits for the
        # live peers that have not got there yet (_plan_round), and would wait for us too. The store runs in the
        # DHT's process while this thread reads the records and computes the pseudo-gradient; it is waited for
        # (bounded) before matchmaking starts
        store_deadline = time.monotonic() + FORCED_STORE_WAIT_S
        with clock("publish"):
            stored = self._publish_progress(force=True, wait=False)
        # one read of the records: this check, and the first attempt's plan
        with clock("plan"):
            outlook = self.rounds.outlook(self._position())
        if self.rounds.behind(outlook):
            # behind already (paused, or a round went on without us): matchmaking at this outer step is doomed
            logger.warning(f"{self._tag()} the swarm has moved past outer step {self.outer_step}; discarding this "
                           "peer's stale pseudo-gradient and taking the state from live peers")
            record = self._catch_up_and_join(started, attempts=0)
            if record is not None:
                return record
        with clock("pseudo_gradient"):
            diverged = self._fill_pseudo_gradient()
            self._fill_stepped_state()
            if not diverged:
                self._fill_sparse_message()
        with clock("publish"):
            wait_until_stored(stored, store_deadline - time.monotonic())

        weight = 0.0 if diverged else float(max(self.samples_since_sync, 1))
        with clock("round"):
            outcome = self.rounds.run(weight, self._position(), outlook=outlook)
        if outcome.kind is not Outcome.AVERAGED:
            # nothing went through the wire: the peer applies its pseudo-gradient unrounded (apply_local), takes
            # the swarm's state (behind) or abandons the round; either way there is no rounding error to carry
            self._reset_residuals()
        if outcome.kind is Outcome.BEHIND or outcome.kind is not Outcome.AVERAGED and self._interrupted.is_set():
            self._unsend_sparse_message(diverged)  # taking the state, or leaving: the message reached nobody
        if outcome.kind is Outcome.BEHIND:
            logger.warning(
                f"{self._tag()} the swarm has moved past outer step {self.outer_step}; discarding this peer's "
                "stale pseudo-gradient and taking the state from live peers"
            )
            record = self._catch_up_and_join(started, outcome.attempts)
            if record is not None:
                return record
            # nobody could give us the state: fall back to the no-group policy (a sparse message is applied alone
            # after all, so it leaves the accumulator again: the failed download touched no buffer)
            if not self._interrupted.is_set():
                self._unsend_sparse_message(diverged, sign=-1.0)
        if outcome.kind is not Outcome.AVERAGED and self._interrupted.is_set():
            # leaving: commit nothing the swarm did not. The local progress stays in the model's parameters (and in
            # a checkpoint, with the global ones), so a resumed peer takes this round up again.
            logger.warning(f"{self._tag()} leaving: abandoning this round without an outer step")
            return self._record(started, None, outcome.attempts, abandoned=True)
        match outcome:
            case RoundOutcome(kind=Outcome.AVERAGED):
                pass
            case RoundOutcome(kind=Outcome.ALONE):  # alone in the swarm (or in its mixing group): nobody to wait for
                logger.info(f"{self._tag()} applying this peer's own pseudo-gradient: no other live peer of run "
                            f"{self.run_id!r} is at this outer step" + (" in its mixing group" if self.mixing else ""))
            case _:  # the buffers still hold our own pseudo-gradient: a failed round never writes them
                self.rounds.explain_no_group()
                logger.warning(
                    f"{self._tag()} no group formed after {outcome.attempts} attempt(s); applying this peer's own "
                    "pseudo-gradient (no_group_policy=apply_local)"
                )
        return self._apply(started, outcome.result, outcome.attempts)

    @torch.no_grad()
    def _fill_stepped_state(self) -> None:
        """Mixing groups: this peer's outer step taken alone, from the pseudo-gradient in the buffers (after its
        error feedback), into the state buffers. A group whose members start from different global parameters
        averages these instead of the pseudo-gradients (``RoundResult.mixed``). No-op without mixing."""
        if not self.mixing:
            return
        n = len(self.global_params)
        with self.averager.get_tensors() as buffers, self._state_lock:
            self._apply_lr_schedules()
            group = self.outer_optimizer.param_groups[0]
            stepped_state_(buffers[n:2 * n], buffers[2 * n:], self.global_params,
                           momentum_buffers(self.outer_optimizer, self.global_params), buffers[:n],
                           lr=group["lr"], momentum=group["momentum"])

    @torch.no_grad()
    def _fill_sparse_message(self, fragment: int = 0) -> None:
        """Compression "sparse" (no-op otherwise): fold the pseudo-gradient in the buffers of ``fragment``'s tensors
        (all of them, blocking sync) into this peer's accumulator (e <- decay * e + g), pack its top-k as this
        round's message for the averager (its outbox), take what the message carries out of the accumulator, and
        leave that in the buffers: what this peer applies if it steps alone, until a round overwrites them with the
        group's average (sparse_round.py)."""
        if self._accumulator is None:
            return
        indices = self.plan.tensors[fragment]
        accumulator = [self._accumulator[i] for i in indices]
        with self.averager.get_tensors() as all_buffers:
            buffers = [all_buffers[i] for i in indices]
            accumulate_(accumulator, buffers, self.sparse_decay)
            message, carried = send_(accumulator, self.averager.sparse_layouts[fragment])
            for buffer, value in zip(buffers, carried):
                buffer.copy_(value)
        self.averager.write_sparse_message(message)
        self.sparse_message_bytes = len(message)

    @torch.no_grad()
    def _unsend_sparse_message(self, diverged: bool, sign: float = 1.0, fragment: int = 0) -> None:
        """The round's message (of ``fragment``) was never applied by anyone: its values go back into the
        accumulator (still in the buffers: no round wrote them), to be sent later. ``sign`` -1: take them out
        again."""
        if self._accumulator is None or diverged:
            return
        indices = self.plan.tensors[fragment]
        with self.averager.get_tensors() as buffers:
            for i in indices:
                self._accumulator[i].add_(buffers[i], alpha=sign)

    def _fill_pseudo_gradient(self, indices: Optional[List[int]] = None, what: str = "the pseudo-gradient",
                              feedback: bool = True) -> bool:
        """Write this peer's pseudo-gradient (plus its error-feedback residual, unless not ``feedback``: the caller
        adds it later with ``_add_error_feedback``) into the averager's buffers: of every tensor, or of the tensors
        ``indices`` (a fragment's, streaming sync). True when local training diverged: then those buffers hold
        zeros, which the peer sends with weight 0."""
        indices = range(len(self.global_params)) if indices is None else indices
        with self.averager.get_tensors() as all_buffers:
            buffers = [all_buffers[i] for i in indices]
            pseudo_gradient_(buffers, [self.global_params[i] for i in indices], [self.params[i] for i in indices])
            if not all_finite_many(buffers):
                # local training diverged: contribute nothing (weight 0, zeros) but still take the group's average,
                # which puts this peer back on the shared parameters; the group is not kept waiting for us
                residuals = [] if self._residuals is None else [self._residuals[i] for i in indices]
                for tensor in buffers + residuals:
                    tensor.zero_()
                logger.error(
                    f"{self._tag()} {what} has NaN/inf values (local training diverged); discarding this peer's "
                    "local progress since the last sync; lower inner_lr if this repeats"
                )
                return True
        if feedback:
            self._add_error_feedback(indices)
        return False

    @torch.no_grad()
    def _add_error_feedback(self, indices: Sequence[int]) -> None:
        """Error feedback on the buffers ``indices`` (no-op without a residual): send what the wire dropped last
        time too, and keep what it will drop of this contribution (the same parts, rounded the same way as the
        all-reduce will); kept only if the round averages. Reads only the averager's buffers and the residuals, so a
        streaming launch runs it in the fragment's round thread, off the training thread."""
        if self._residuals is None:
            return
        with self.averager.get_tensors() as all_buffers:
            add_error_feedback_([all_buffers[i] for i in indices], [self._residuals[i] for i in indices],
                                self.averager.codec, self.averager.part_size_bytes)

    @torch.no_grad()
    def _apply(self, started: float, result: Optional[RoundResult], attempts: int, **flags) -> SyncRecord:
        """The outer step with what the buffers hold (the group's average, or our own pseudo-gradient)."""
        clock = self._clock
        mixed = result is not None and result.mixed
        n = len(self.global_params)
        with clock("outer_step"), self.averager.get_tensors() as buffers, self._state_lock:
            self._apply_lr_schedules()  # the outer step counter may have jumped since the last one (a catch-up)
            if mixed:  # the group's mean stepped state: the outer step of its mean state is in it already
                load_stepped_state_(self.outer_optimizer, self.global_params, buffers[n:2 * n], buffers[2 * n:],
                                    self.params)
            else:
                outer_step_(self.outer_optimizer, self.global_params, buffers[:n], self.params)
            self.outer_step += 1
            self._committed_local_step = self.local_step
        if mixed:
            self._reset_residuals()  # the stepped states crossed the wire in fp32: nothing was dropped
        with clock("digest"):
            self._digest = self._global_digest()  # outside the averager's lock: hashing needs none of its buffers
        self.averager.set_host_outer_step(self.outer_step)
        # a mixing group's members differ by design: they averaged their states, there is nothing to repair
        repaired = result is not None and not mixed and self._repair_if_diverged(result)
        return self._record(started, result, attempts, repaired=repaired, **flags)

    def _record(self, started: float, result: Optional[RoundResult], attempts: int, **flags) -> SyncRecord:
        """Close the sync: its record in ``history`` (and the log), the next phase's counters, a fresh progress
        record. ``flags``: ``caught_up``, ``repaired``, ``abandoned`` (see ``SyncRecord``)."""
        record = SyncRecord.of(result, outer_step=self.outer_step, seconds=time.perf_counter() - started,
                               samples=self.samples_since_sync, attempts=attempts, digest=self._digest,
                               phases=sync_phases(self._clock.seconds, result), **flags)
        me = self.dht.peer_id.to_base58()
        self._last_group = {peer for peer in result.gathered if peer != me} if result else set()
        return self._finish_record(record)

    def _finish_record(self, record: SyncRecord) -> SyncRecord:
        """The rest of closing a sync: its record in ``history`` and the log, the next phase's counters, a fresh
        progress record."""
        record.inner_steps, record.stride = self._steps_since_sync, self.pace.stride
        record.step_s, record.fastest_step_s = self.pace.step_s, self.progress.fastest_step_s
        record.peers_seen, self.rounds.peers_seen = self.rounds.peers_seen[-16:], []
        steps_before = self.pace.steps
        if self.pace.update(record.step_s, record.fastest_step_s) != steps_before:
            logger.info(f"{self._tag()} an inner step here takes {self.pace.ratio or 0:.2f}x the fastest live peer's: "
                        f"{self.pace.steps} inner steps per phase from now on (stride {self.pace.stride:g})")
        record.log(logger, self._tag())
        self.history.append(record)
        self._phase_started = time.monotonic()
        if not record.abandoned:  # an abandoned round's samples are still in the model, to be synced later
            self.samples_since_sync = 0
            self._steps_since_sync = 0
        # our commit, stored in the background: a member of this round that reads the records before it is stored
        # still counts us (rounds.outlook_of), and waiting here cost up to FORCED_STORE_WAIT_S of every sync
        started_publish = time.perf_counter()
        self._publish_progress(force=True, wait=False)
        record.phases["record"] = time.perf_counter() - started_publish
        return record

    def _position(self) -> Position:
        """Where this peer stands for the round it is about to average, and what it tells the group about it."""
        return Position(
            outer_step=self.outer_step, local_step=self.local_step, phase_started=self._phase_started,
            last_group=self._last_group,
            gather={"outer_step": self.outer_step, "samples": self.samples_since_sync,
                    # the digest of the global parameters this round starts from: every member must have the same
                    "digest": self._digest,
                    # it keeps stepped-state buffers: a group of such peers started from different parameters
                    # averages their states (mixing groups) instead of repairing
                    "mixing": self.mixing,
                    # a pseudo-gradient of fewer inner steps than H (a newcomer's first, after it took the state
                    # mid-phase) is smaller than the others': widen its norm check in proportion
                    "norm_scale": self.local_steps / max(1, min(self._steps_since_sync, self.local_steps))},
        )

    def _reset_residuals(self) -> None:
        if self._residuals is not None:
            for residual in self._residuals:
                residual.zero_()

    def _global_digest(self) -> str:
        """A digest of the exact bits of the global parameters: equal on every peer after every committed round."""
        return _digest_of(self.global_params)
