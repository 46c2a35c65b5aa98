"""``CatchUp``: a peer the swarm went on without takes the swarm's state (``StateSharing``) and gets back in step
with it: it skips the inner steps the donors are ahead by, and joins, with weight 0, the round they are in (a
fragment's round, streaming sync; or the whole round) so that it commits the same outer step as they do."""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from p2ptrain.diloco.context import PeerState
from p2ptrain.diloco.pseudo import Contribution
from p2ptrain.diloco.records import Outcome, SyncRecord
from p2ptrain.diloco.reporting import Reporter
from p2ptrain.diloco.state import StateSharing
from p2ptrain.diloco.streaming import apply_step

logger = logging.getLogger("p2ptrain.diloco")  # the optimizer's logger: one name for the whole optimizer


class CatchUp:
    """Takes the swarm's state for ``state`` and joins the donors' round.

    :param apply: ``BlockingSync.apply``: the outer step of a whole round this peer joined
    :param join_fragment: ``StreamingSync.join_fragment_in_progress`` (fragment, launch step): take part with weight
      0 in the fragment round the donors are in; None without a streaming sync
    :param download_timeout_s: how long a download of the state may take (the averaging timeout)
    :param mid_phase: take the state at the next inner step when the swarm is ahead, not at the sync point
    """

    def __init__(self, state: PeerState, sharing: StateSharing, contribution: Contribution, reporter: Reporter,
                 rounds, apply: Callable[..., SyncRecord], join_fragment: Optional[Callable[[int, int], None]],
                 *, download_timeout_s: float, mid_phase: bool):
        self.state, self.sharing, self.contribution, self.reporter = state, sharing, contribution, reporter
        self.rounds, self.apply, self.join_fragment = rounds, apply, join_fragment
        self.download_timeout_s, self.mid_phase = download_timeout_s, mid_phase
        self.no_donor_at_outer_step = -1  # a mid-phase catch-up found no donor at this outer step: wait for the sync

    def due(self) -> bool:
        """Whether the live peers' records show the swarm past this peer's outer step, so that the inner steps up to
        its sync point would be thrown away there (and no donor was missing at this outer step already)."""
        s = self.state
        # (mixing groups finish a round at their own pace: another group one step ahead is no news)
        return (self.mid_phase and self.reporter.progress.swarm_outer_step > s.outer_step + s.mixing
                and self.no_donor_at_outer_step != s.outer_step)

    def catch_up_mid_phase(self) -> None:
        """The swarm went on without us: every inner step until our sync point would be thrown away there, so
        take the state now (a sync that averages nothing: the rest of the phase is in step with the swarm)."""
        s = self.state
        with s.sync_lock:
            started = time.perf_counter()
            swarm_outer_step = self.rounds.swarm_outer_step()
            if swarm_outer_step <= s.outer_step:
                self.reporter.progress.swarm_outer_step = swarm_outer_step  # a stale look: nothing to do
                return
            logger.warning(f"{s.tag()} the swarm is at outer step {swarm_outer_step}: discarding this peer's "
                           f"{s.steps_since_sync} inner step(s) since its last sync now rather than at its sync "
                           "point, and taking the state from live peers")
            self.reporter.throughput.update()
            if self.catch_up_and_join(started, attempts=0) is None:
                self.no_donor_at_outer_step = s.outer_step  # no donor answered: try again at the sync point

    def catch_up(self) -> bool:
        """Take the swarm's state now; False if no peer gave a usable state."""
        with self.state.sync_lock:
            return self.catch_up_and_join(time.perf_counter(), attempts=0) is not None

    def catch_up_and_join(self, started: float, attempts: int) -> Optional[SyncRecord]:
        """Take the state and join the donors' round; the sync's record, or None if no peer gave a usable state."""
        s = self.state
        if not self.sharing.load_state_from_peers(timeout_s=self.download_timeout_s):
            return None
        if s.plan.streaming and s.donor_in_flight:
            # the donors are in a fragment's round: join it with weight 0, so that this peer applies the same
            # average to that fragment at its apply step (else it would keep the fragment's older version)
            self.join_fragment(*s.donor_in_flight)
        if not s.donor_in_round:
            self.fast_forward()
        if s.donor_in_round:
            # The donors' state is from before the round they are running now. Without joining it, this peer (now
            # in phase with them) would sync exactly when they do next time, find them one step ahead, download
            # again while they average, and stay one round behind for good.
            joined = self.join_round_in_progress(started)
            if joined is not None:
                return joined
        return self.reporter.record(started, None, attempts, caught_up=True)

    def fast_forward(self) -> None:
        """After taking the state mid-phase: the donors trained on while it downloaded (and it may be slower to start
        training again). Skip the inner steps they are ahead by, so that this peer reaches the sync point with them
        instead of late, where the round would wait for it or leave it out again; its pseudo-gradient then holds
        fewer inner steps (the norm check scales with them)."""
        s = self.state
        ahead = [r.local_step for r in self.reporter.progress.others(5.0) if r.outer_step == s.outer_step]
        next_sync = (s.local_step // s.local_steps + 1) * s.local_steps
        if s.plan.streaming:
            # never skip a fragment's launch step (its round would start without us), nor the apply step of the
            # round it joined (it applies it there, like the donors; at it already: it stays, and applies it next)
            phase_start = next_sync - s.local_steps
            stops = [phase_start + s.plan.launch_at(f) for f in range(s.plan.fragments)]
            if s.in_flight is not None:
                due = apply_step(s.plan, s.in_flight.fragment, s.in_flight.local_step)
                stops.append(max(due, s.local_step + 1))
            next_sync = min([step for step in stops if step > s.local_step], default=next_sync)
        target = min(max(ahead, default=-1), next_sync - 1)
        if target > s.local_step:
            logger.info(f"{s.tag()} the swarm is {target - s.local_step} inner step(s) further in this phase "
                        "than the state it took: skipping them, to reach the sync point together")
            s.local_step = target

    def join_round_in_progress(self, started: float) -> Optional[SyncRecord]:
        """One attempt to join the round the swarm is running, with zeros and weight 0: this peer adds nothing to
        the average and commits the same outer step as the others. None (nothing applied) if it was too late."""
        self.contribution.zero_buffers()
        self.contribution.fill_stepped_state()  # weight 0 adds nothing, but a mixing group needs finite values
        outcome = self.rounds.run(0.0, self.reporter.position(), single_attempt=True)
        if outcome.kind is not Outcome.AVERAGED:
            logger.info(f"{self.state.tag()} too late to join the swarm's round in progress; syncing at the next one")
            return None
        return self.apply(started, outcome.result, outcome.attempts, caught_up=True)
