"""``StreamingSync``, the streaming sync of ``DiLoCoOptimizer``: each fragment of the parameters is averaged at
its own inner step of the phase, in a thread of its own while training goes on, and applied ``overlap_steps``
later (``p2ptrain/fragments.py`` has the plan, ``docs/streaming-and-sparse.md`` "Streaming sync" the whole story).

A fragment's round is the blocking sync's round over fewer tensors: the same ``Rounds`` (planned from the progress
records, matchmaking keyed to the outer step and the fragment), the same exact all-reduce, checks and outcomes. What
differs is when the training thread waits: only when it reaches the fragment's apply step before the round ended.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional

import torch

from p2ptrain.averaging import RoundResult
from p2ptrain.diloco.context import PeerState
from p2ptrain.diloco.pseudo import Contribution
from p2ptrain.diloco.records import Outcome, RoundOutcome, SyncRecord, _digest_of
from p2ptrain.diloco.reporting import Reporter
from p2ptrain.diloco.swarm_view import Position
from p2ptrain.fragments import FragmentPlan
from p2ptrain.outer import merge_, outer_step_
from p2ptrain.swarm.progress import FORCED_STORE_WAIT_S, wait_until_stored

logger = logging.getLogger("p2ptrain.diloco")

@dataclass
class FragmentRound:
    """One fragment's round in flight: launched at an inner step, its outcome filled in by its thread."""

    fragment: int
    local_step: int
    """the inner step at which its pseudo-gradient was taken"""
    weight: float
    launched: float = field(default_factory=time.perf_counter)
    launched_at: float = field(default_factory=time.time)
    """wall-clock time of the launch: the benchmark compares the members' (who waited for whom)"""
    thread: Optional[threading.Thread] = None
    outcome: Optional[RoundOutcome] = None
    ended: float = 0.0
    """perf_counter when the round's outcome was known"""
    deferred: bool = False
    """its apply step came while it still ran, and this peer trains on (extra inner steps) until it ends"""

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


@dataclass
class PhaseLog:
    """The fragment rounds of the current inner phase, for the phase's ``SyncRecord``."""

    blocked_s: float = 0.0
    """seconds the training thread spent on the sync this phase: taking pseudo-gradients, waiting, applying"""
    extra_steps: int = 0
    """inner steps taken beyond the schedule while a round late at its apply step ran"""
    attempts: int = 0
    fragments: List[dict] = field(default_factory=list)


def apply_step(plan: FragmentPlan, fragment: int, launched_at: int) -> int:
    """The local step at which ``fragment``'s round launched at ``launched_at`` is applied."""
    return launched_at - plan.launch_at(fragment) + plan.apply_at(fragment)


class StreamingSync:
    """Launches and applies ``state``'s fragment rounds on the plan's schedule (``state.plan``); the round in flight
    is ``state.in_flight``, which a donor's snapshot names.

    :param repair: ``StateSharing.repair_if_diverged``
    :param catch_up: ``CatchUp.catch_up_and_join``: take the swarm's state when a round says this peer is behind
    :param max_extra_steps: inner steps per phase this peer may take beyond the schedule while a round it must apply
      still runs
    """

    def __init__(self, state: PeerState, contribution: Contribution, reporter: Reporter, rounds,
                 repair: Callable[[RoundResult], bool], catch_up: Callable[[float, int], Optional[SyncRecord]],
                 max_extra_steps: int):
        self.state, self.contribution, self.reporter, self.rounds = state, contribution, reporter, rounds
        self.repair, self.catch_up, self.max_extra_steps = repair, catch_up, max_extra_steps
        self.reset_counters()

    def reset_counters(self) -> None:
        """At the start, and after the state was taken or loaded: the next pseudo-gradients hold only the steps from
        here."""
        self._fragment_samples = [0] * self.state.plan.fragments  # samples behind each fragment's next pseudo-gradient
        self._fragment_steps = [0] * self.state.plan.fragments  # inner steps behind it (the norm check's scale)
        self._phase = PhaseLog()

    # ------------------------------------------------------------------------------------------ the schedule

    def finish_overdue(self) -> bool:
        """Called by ``step()`` before the inner step, outside the state lock. True: a round deferred at its apply
        step is in flight, and this inner step is an extra one (it does not move ``local_step``), at whose end the
        round is applied if it ended by then (``after_step``). Otherwise apply a round in flight whose
        apply step this peer is already at or past: one it joined after taking the state, or one whose apply step a
        skip of inner steps passed (``CatchUp.fast_forward``)."""
        round_ = self.state.in_flight
        if round_ is not None and round_.deferred:
            self._phase.extra_steps += 1
            return True
        if round_ is not None and self.state.local_step >= self._apply_step_of(round_):
            self._finish(round_.fragment)
        return False

    def _may_train_on(self, round_: FragmentRound) -> bool:
        """Whether this peer, at ``round_``'s apply step with the round still running, takes another inner step
        instead of waiting: the round's other members launched it later (unequal speeds, CPU noise), and idling
        here until they are through is the time a streaming sync loses. At most ``max_extra_steps`` a phase, so a
        peer's pseudo-gradient stays near the others' in size (the norm check) and a stalled round still ends."""
        return (round_.running() and self._phase.extra_steps < self.max_extra_steps
                and not self.state.interrupted.is_set())

    def _apply_step_of(self, round_: FragmentRound) -> int:
        """The local step at which ``round_``'s fragment is applied."""
        return apply_step(self.state.plan, round_.fragment, round_.local_step)

    def _fragment_position(self, fragment: int, launched_at: int, samples: int, norm_scale: float) -> Position:
        """What a round of ``fragment`` launched at ``launched_at`` plans from and tells its group."""
        return Position(
            outer_step=self.state.outer_step, local_step=launched_at, phase_started=self.state.phase_started,
            last_group=self.state.last_group, fragment=fragment, fragments=self.state.plan.fragments,
            applied_by=apply_step(self.state.plan, fragment, launched_at),
            gather={"outer_step": self.state.outer_step, "samples": samples, "fragment": fragment,
                    "norm_scale": norm_scale,
                    "digest": _digest_of(self.state.global_params[i] for i in self.state.plan.tensors[fragment])},
        )

    def after_step(self, may_defer: bool = False) -> None:
        """After an inner step (local_step already counted, the launch due at it done under the state lock): apply
        the fragment due at this step, or the deferred round in flight. With ``may_defer`` (the step's last local
        step: nothing launches before the next inner step), a round still running is deferred instead of waited
        for, while ``_may_train_on`` allows; it is applied at the end of the first extra step it has ended by."""
        round_ = self.state.in_flight
        if round_ is not None and round_.deferred:
            if not self._may_train_on(round_):
                self._finish(round_.fragment)
            return
        fragment = self.state.plan.due(self.state.local_step, self.state.plan.apply_at)
        if fragment is None:
            return
        if may_defer and round_ is not None and round_.fragment == fragment and self._may_train_on(round_):
            round_.deferred = True
            return
        self._finish(fragment)

    def count_step(self, samples: int, real: bool = True) -> None:
        """Count an inner step's samples into every fragment's next pseudo-gradient (``real``: an inner step was
        taken, not a stride's skip, see pace.py)."""
        for f in range(self.state.plan.fragments):
            self._fragment_samples[f] += samples
            self._fragment_steps[f] += int(real)

    def launch_due(self, samples: int, real: bool = True) -> None:
        """Count this step's samples, then start the round of the fragment due at this local step, if one is. Called
        by ``step()`` under the state lock, so a donor's snapshot sees the launch done or not started."""
        self.count_step(samples, real)
        fragment = self.state.plan.due(self.state.local_step, self.state.plan.launch_at)
        if fragment is not None:
            self._launch(fragment)

    @torch.no_grad()
    def _launch(self, fragment: int) -> None:
        started = time.perf_counter()
        if self.state.in_flight is not None:
            # cannot happen: the plan applies each round before the next launch, and step() finishes an overdue one
            # before its inner step. Called under the state lock, which applying needs: skip this fragment's round
            # rather than wait (its values then lag the swarm's until the digest check repairs them)
            logger.error(f"{self.state.tag()} fragment {self.state.in_flight.fragment}'s round is still in flight at "
                         "fragment "
                         f"{fragment}'s launch; skipping fragment {fragment}'s round")
            return
        indices = self.state.plan.tensors[fragment]
        # the error feedback (a codec round trip of the fragment) runs in the round's thread, before its all-reduce
        diverged = self.contribution.fill_pseudo_gradient(indices, f"fragment {fragment}'s pseudo-gradient",
                                                          feedback=False)
        steps = max(1, min(self._fragment_steps[fragment], self.state.local_steps))
        weight = 0.0 if diverged else float(max(self._fragment_samples[fragment], 1))
        position = self._fragment_position(fragment, self.state.local_step, self._fragment_samples[fragment],
                                           norm_scale=self.state.local_steps / steps)
        self._fragment_samples[fragment] = 0
        self._fragment_steps[fragment] = 0
        stored = self.reporter.publish(force=True, wait=False)  # the others see us at this launch step
        self._start_round(FragmentRound(fragment, self.state.local_step, weight), position, stored,
                          feedback=None if diverged else indices)
        self._phase.blocked_s += time.perf_counter() - started

    def _start_round(self, round_: FragmentRound, position: Position, stored=None,
                     feedback: Optional[List[int]] = None) -> None:
        """Run ``round_`` in a thread of its own; it is in flight until its apply step (``_finish``). ``feedback``:
        the buffers to add the error-feedback residual to first, or (sparse) to fold into the accumulator and pack
        as the round's message (nothing else touches them, their residuals or their accumulator until the round
        is applied); None when this peer sends nothing (weight 0)."""
        def run() -> None:
            try:
                if feedback is not None:
                    self.contribution.add_error_feedback(feedback)
                    self.contribution.fill_sparse_message(round_.fragment)
                if stored is not None:
                    wait_until_stored(stored, FORCED_STORE_WAIT_S)
                round_.outcome = self.rounds.run(round_.weight, position)
            except Exception as e:  # a network failure is a value: the fragment is applied as a failed round
                logger.warning(f"{self.state.tag()} fragment {round_.fragment}'s round failed unexpectedly: {e!r}")
                round_.outcome = RoundOutcome(Outcome.NO_GROUP, 0)
            round_.ended = time.perf_counter()

        round_.thread = threading.Thread(target=run, name=f"p2ptrain-fragment-{round_.fragment}", daemon=True)
        self.state.in_flight = round_
        round_.thread.start()

    @torch.no_grad()
    def join_fragment_in_progress(self, fragment: int, launched_at: int) -> None:
        """After taking the state from donors whose round of ``fragment`` (launched at ``launched_at``) is in flight:
        take part in it with zeros and weight 0, adding nothing to the average but applying it like the others."""
        indices = self.state.plan.tensors[fragment]
        with self.state.averager.get_tensors() as all_buffers:
            for i in indices:
                all_buffers[i].zero_()
        position = self._fragment_position(fragment, launched_at, samples=0, norm_scale=1.0)
        logger.info(f"{self.state.tag()} the donors were in fragment {fragment}'s round: joining it with weight 0")
        with self.state.state_lock:
            self._start_round(FragmentRound(fragment, launched_at, 0.0), position)

    @torch.no_grad()
    def _finish(self, fragment: int) -> None:
        """Wait for ``fragment``'s round and apply it: the outer step on its global values, merged into the model's."""
        with self.state.sync_lock:  # the training thread, or shutdown() from another one: once
            self._finish_locked(fragment)
            # a round that found this peer behind took the state, and may have joined the donors' round at its apply
            # step already (a donor trains on there while it runs): apply that one now too, before a launch can come
            round_ = self.state.in_flight
            while round_ is not None and self.state.local_step >= self._apply_step_of(round_):
                self._finish_locked(round_.fragment)
                round_ = self.state.in_flight

    @torch.no_grad()
    def _finish_locked(self, fragment: int) -> None:
        started = time.perf_counter()
        round_ = self.state.in_flight
        if round_ is None or round_.fragment != fragment:
            # nothing of ours in flight for it: this peer resumed from a checkpoint written after the round was
            # applied early (``flush``). The fragment stays where it is (a donor's snapshot names its round in
            # flight, which a newcomer joins: ``join_fragment_in_progress``)
            logger.info(f"{self.state.tag()} fragment {fragment} is due but no round of it is in flight; nothing to "
                        "apply")
            return
        round_.thread.join()
        outcome = round_.outcome or RoundOutcome(Outcome.NO_GROUP, 0)
        self._phase.attempts += outcome.attempts
        waited = time.perf_counter() - started
        indices = self.state.plan.tensors[fragment]
        if outcome.kind is not Outcome.AVERAGED and self.state.residuals is not None:
            for i in indices:
                self.state.residuals[i].zero_()
        unsent = round_.weight == 0  # no sparse message left the accumulator (see _start_round)
        if outcome.kind is Outcome.BEHIND or outcome.kind is not Outcome.AVERAGED and self.state.interrupted.is_set():
            # taking the state, or leaving: nobody applied it
            self.contribution.unsend_sparse_message(unsent, fragment=fragment)
        if outcome.kind is Outcome.BEHIND:
            logger.warning(f"{self.state.tag()} the swarm has moved past outer step {self.state.outer_step} (fragment "
                           f"{fragment}); discarding this peer's pseudo-gradients and taking the state from live peers")
            self._phase.blocked_s += waited
            self.state.in_flight = None
            if self.catch_up(started, outcome.attempts) is not None:
                self.reset_counters()
                return
            if not self.state.interrupted.is_set():  # nobody gave us the state: the message is applied alone after all
                self.contribution.unsend_sparse_message(unsent, sign=-1.0, fragment=fragment)
        if outcome.kind is not Outcome.AVERAGED and self.state.interrupted.is_set():
            # leaving: commit nothing the swarm did not; the fragment's local progress stays in the model
            logger.warning(f"{self.state.tag()} leaving: abandoning fragment {fragment}'s round without an outer step")
            self._phase.blocked_s += time.perf_counter() - started
            self.state.in_flight = None
            return
        if outcome.kind is Outcome.NO_GROUP:
            self.rounds.explain_no_group()
            logger.warning(f"{self.state.tag()} no group formed for fragment {fragment} after {outcome.attempts} "
                           "attempt(s); applying this peer's own pseudo-gradient (no_group_policy=apply_local)")
        alpha = self.state.plan.merge_alpha if self.state.plan.overlap_steps > 0 else 0.0
        with self.state.state_lock, self.state.averager.get_tensors() as all_buffers:  # the order _launch takes them in
            self.state.in_flight = None  # under the lock: a donor's snapshot sees the round in flight or applied
            self.state.apply_lr_schedules()
            globals_ = [self.state.global_params[i] for i in indices]
            # the outer step takes this fragment's tensors only (the others' momentum stays as it is)
            outer_step_(self.state.outer_optimizer, globals_, [all_buffers[i] for i in indices])
            merge_([self.state.params[i] for i in indices], globals_, alpha)
            last = fragment == self.state.plan.fragments - 1
            if last:
                self.state.outer_step += 1
                self.state.committed_local_step = self.state.local_step
        self.state.digest = self.state.global_digest()
        result = outcome.result if outcome.kind is Outcome.AVERAGED else None
        if result is not None:
            me = self.state.peer_id
            self.state.last_group = {peer for peer in result.gathered if peer != me}
        repaired = result is not None and self.repair(result)
        if repaired:  # the state was taken anew: the next pseudo-gradients count from here
            self.reset_counters()
        blocked = time.perf_counter() - started
        self._phase.blocked_s += blocked
        self._phase.fragments.append(dict(
            fragment=fragment, averaged=result is not None, group_size=result.group_size if result else 1,
            attempts=outcome.attempts, launched_at_step=round_.local_step, applied_at_step=self.state.local_step,
            launched_at=round_.launched_at,
            round_s=round_.ended - round_.launched, waited_s=waited, blocked_s=blocked, repaired=repaired,
            allreduce_s=result.allreduce_s if result else 0.0, bytes_sent=result.bytes_sent if result else 0,
            bytes_received=result.bytes_received if result else 0, weight=round_.weight,
        ))
        if last:
            self._record_phase()

    def _record_phase(self) -> None:
        """The phase's ``SyncRecord``: one per outer step, as with the blocking sync, with each fragment's round."""
        phase, self._phase = self._phase, PhaseLog()
        rounds = phase.fragments
        record = SyncRecord(
            outer_step=self.state.outer_step, averaged=bool(rounds) and all(r["averaged"] for r in rounds),
            group_size=min((r["group_size"] for r in rounds), default=1), seconds=phase.blocked_s,
            bytes_sent=sum(r["bytes_sent"] for r in rounds), bytes_received=sum(r["bytes_received"] for r in rounds),
            samples=self.state.samples_since_sync, attempts=phase.attempts, digest=self.state.digest,
            finished_at=time.time(),
            allreduce_s=sum(r["allreduce_s"] for r in rounds), repaired=any(r["repaired"] for r in rounds),
            phases={"blocked": phase.blocked_s, "rounds": sum(r["round_s"] for r in rounds),
                    "waited": sum(r["waited_s"] for r in rounds)},
            fragments=rounds, extra_steps=phase.extra_steps,
        )
        self.reporter.finish_record(record)

    def flush(self) -> None:
        """Finish the fragment round in flight, if any (wait for it and apply it), so the optimizer's state holds
        no half-done round: ``state_dict`` and ``shutdown`` call it."""
        round_ = self.state.in_flight
        if round_ is not None:
            self._finish(round_.fragment)
