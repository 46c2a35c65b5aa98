"""``BlockingSync``: the sync of all parameters at once (the blocking DiLoCo sync). The pseudo-gradient (with its
error feedback) into the averager's buffers (``Contribution``), one round through ``Rounds``, the outer step
(``apply``), and the sync's record (``Reporter``). The streaming sync (``streaming.py``) runs the same steps per
fragment; the catch-up (``catch_up.py``) takes the swarm's state when the round says this peer is behind."""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

import torch

from p2ptrain.averaging import RoundResult
from p2ptrain.clock import PhaseClock
from p2ptrain.diloco.context import PeerState
from p2ptrain.diloco.pseudo import Contribution
from p2ptrain.diloco.records import Outcome, RoundOutcome, SyncRecord
from p2ptrain.diloco.reporting import Reporter
from p2ptrain.outer import load_stepped_state_, outer_step_
from p2ptrain.swarm.progress import FORCED_STORE_WAIT_S, wait_until_stored

logger = logging.getLogger("p2ptrain.diloco")  # the optimizer's logger: one name for the whole optimizer

CatchUpAndJoin = Callable[[float, int], Optional[SyncRecord]]
"""(sync started at, attempts so far) -> the sync's record if this peer took the swarm's state, else None"""


class BlockingSync:
    """Averages the pseudo-gradients of all of ``state``'s parameters with the swarm and takes one outer step.

    :param repair: ``StateSharing.repair_if_diverged``: after a round, take the state anew if this peer's parameters
      were not the group's reference ones
    :param catch_up: ``CatchUp.catch_up_and_join``: take the swarm's state when it moved past this peer
    """

    def __init__(self, state: PeerState, contribution: Contribution, reporter: Reporter, rounds,
                 repair: Callable[[RoundResult], bool], catch_up: CatchUpAndJoin,
                 judge: Optional[Callable[[RoundResult, int], None]] = None):
        self.state, self.contribution, self.reporter, self.rounds = state, contribution, reporter, rounds
        self.repair, self.catch_up, self.judge = repair, catch_up, judge

    @torch.no_grad()
    def sync(self) -> SyncRecord:
        """One sync; call under ``state.sync_lock``. Never raises for network failures."""
        s = self.state
        started = time.perf_counter()
        clock = s.clock = PhaseClock()
        self.reporter.throughput.update()
        # tell the others we are at the sync point now, not at the next periodic refresh: a round waits for the
        # live peers that have not got there yet (round_policy.plan_round), and would wait for us too. The store
        # runs in the DHT's process while this thread reads the records and computes the pseudo-gradient; it is
        # waited for (bounded) before matchmaking starts
        store_deadline = time.monotonic() + FORCED_STORE_WAIT_S
        with clock("publish"):
            stored = self.reporter.publish(force=True, wait=False)
        # one read of the records: this check, and the first attempt's plan
        with clock("plan"):
            outlook = self.rounds.outlook(self.reporter.position())
        if self.rounds.behind(outlook):
            # behind already (paused, or a round went on without us): matchmaking at this outer step is doomed
            logger.warning(f"{s.tag()} the swarm has moved past outer step {s.outer_step}; discarding this "
                           "peer's stale pseudo-gradient and taking the state from live peers")
            record = self.catch_up(started, 0)
            if record is not None:
                return record
        with clock("pseudo_gradient"):
            diverged = self.contribution.fill_pseudo_gradient()
            self.contribution.fill_stepped_state(self.rounds.may_mix_states(outlook, s.outer_step, s.last_group))
            if not diverged:
                self.contribution.fill_sparse_message()
        with clock("publish"):
            wait_until_stored(stored, store_deadline - time.monotonic())

        weight = 0.0 if diverged else float(max(s.samples_since_sync, 1))
        with clock("round"):
            outcome = self.rounds.run(weight, self.reporter.position(), outlook=outlook)
        if outcome.kind is not Outcome.AVERAGED:
            # nothing went through the wire: the peer applies its pseudo-gradient unrounded (apply_local), takes
            # the swarm's state (behind) or abandons the round; either way there is no rounding error to carry
            s.reset_residuals()
        if outcome.kind is Outcome.BEHIND or outcome.kind is not Outcome.AVERAGED and s.interrupted.is_set():
            self.contribution.unsend_sparse_message(diverged)  # taking the state, or leaving: it reached nobody
        if outcome.kind is Outcome.BEHIND:
            logger.warning(
                f"{s.tag()} the swarm has moved past outer step {s.outer_step}; discarding this peer's "
                "stale pseudo-gradient and taking the state from live peers"
            )
            record = self.catch_up(started, outcome.attempts)
            if record is not None:
                return record
            # nobody could give us the state: fall back to the no-group policy (a sparse message is applied alone
            # after all, so it leaves the accumulator again: the failed download touched no buffer)
            if not s.interrupted.is_set():
                self.contribution.unsend_sparse_message(diverged, sign=-1.0)
        if outcome.kind is not Outcome.AVERAGED and s.interrupted.is_set():
            # leaving: commit nothing the swarm did not. The local progress stays in the model's parameters (and in
            # a checkpoint, with the global ones), so a resumed peer takes this round up again.
            logger.warning(f"{s.tag()} leaving: abandoning this round without an outer step")
            return self.reporter.record(started, None, outcome.attempts, abandoned=True)
        match outcome:
            case RoundOutcome(kind=Outcome.AVERAGED):
                pass
            case RoundOutcome(kind=Outcome.ALONE):  # alone in the swarm (or in its mixing group): nobody to wait for
                logger.info(f"{s.tag()} applying this peer's own pseudo-gradient: no other live peer of run "
                            f"{s.run_id!r} is at this outer step" + (" in its mixing group" if s.mixing else ""))
            case _:  # the buffers still hold our own pseudo-gradient: a failed round never writes them
                self.rounds.explain_no_group()
                logger.warning(
                    f"{s.tag()} no group formed after {outcome.attempts} attempt(s); applying this peer's own "
                    "pseudo-gradient (no_group_policy=apply_local)"
                )
        return self.apply(started, outcome.result, outcome.attempts)

    @torch.no_grad()
    def apply(self, started: float, result: Optional[RoundResult], attempts: int, **flags) -> SyncRecord:
        """The outer step with what the buffers hold (the group's average, or our own pseudo-gradient)."""
        s = self.state
        clock = s.clock
        mixed = result is not None and result.mixed
        n = len(s.global_params)
        with clock("outer_step"), s.averager.get_tensors() as buffers, s.state_lock:
            s.apply_lr_schedules()  # the outer step counter may have jumped since the last one (a catch-up)
            if mixed:  # the group's mean stepped state: the outer step of its mean state is in it already
                load_stepped_state_(s.outer_optimizer, s.global_params, buffers[n:2 * n], buffers[2 * n:], s.params)
            else:
                outer_step_(s.outer_optimizer, s.global_params, buffers[:n], s.params)
            s.outer_step += 1
            s.committed_local_step = s.local_step
        if mixed:
            s.reset_residuals()  # the stepped states crossed the wire in fp32: nothing was dropped
        with clock("digest"):
            s.digest = s.global_digest()  # outside the averager's lock: hashing needs none of its buffers
        s.averager.set_host_outer_step(s.outer_step)
        # a mixing group's members differ by design: they averaged their states, there is nothing to repair
        repaired = result is not None and not mixed and self.repair(result)
        if self.judge is not None and result is not None and not mixed and not repaired:
            with clock("replay"):  # the replay check (replay.py): the round's senders, judged
                self.judge(result, s.outer_step - 1)
        return self.reporter.record(started, result, attempts, repaired=repaired, **flags)
