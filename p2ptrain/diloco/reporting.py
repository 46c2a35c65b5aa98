"""``Reporter``: what this peer tells the swarm and its user about where it is. Its progress record in the DHT
(``publish``), where it stands for a round (``position``), and the close of each sync: its ``SyncRecord`` in the
history and the log, the next phase's counters and pace (``record``, ``finish_record``)."""

from __future__ import annotations

import logging
import time
from typing import Optional

from p2ptrain.averaging import RoundResult
from p2ptrain.diloco.context import PeerState
from p2ptrain.diloco.records import SyncRecord, Throughput, sync_phases
from p2ptrain.diloco.swarm_view import Position
from p2ptrain.pace import Pace
from p2ptrain.swarm.progress import FORCED_STORE_WAIT_S, ProgressPublisher

logger = logging.getLogger("p2ptrain.diloco")  # the optimizer's logger: one name for the whole optimizer


class Reporter:
    """Publishes ``state``'s progress through ``progress`` and closes its syncs. ``peers_seen`` gives (and clears)
    the peers the rounds saw since the last record (``Rounds.peers_seen``)."""

    def __init__(self, state: PeerState, progress: ProgressPublisher, pace: Pace, throughput: Throughput, rounds):
        self.state, self.progress, self.pace, self.throughput, self.rounds = state, progress, pace, throughput, rounds

    def publish(self, force: bool = False, wait: bool = True):
        """A periodic refresh in the background; a forced one (our first record, a sync point, a commit) is waited
        for, at most ``FORCED_STORE_WAIT_S``, unless ``wait`` is False (the caller waits on the returned future when
        it must, ``wait_until_stored``): a peer reading the records a moment later must see it (a fast peer read
        before a slow one's record was stored, found itself alone and stepped alone, in CI)."""
        if force or self.progress.due():
            if not force:
                self.throughput.update()
            s = self.state
            return self.progress.publish(
                outer_step=s.outer_step,
                local_step=s.local_step,
                samples_per_s=self.throughput.per_s,
                samples_since_sync=s.samples_since_sync,
                wait_s=FORCED_STORE_WAIT_S if force and wait else 0.0,
                step_s=self.pace.step_s or 0.0,
            )
        return None

    def position(self) -> Position:
        """Where this peer stands for the round it is about to average, and what it tells the group about it."""
        s = self.state
        return Position(
            outer_step=s.outer_step, local_step=s.local_step, phase_started=s.phase_started,
            last_group=s.last_group, last=s.last_outer_step is not None and s.outer_step + 1 >= s.last_outer_step,
            gather={"outer_step": s.outer_step, "samples": s.samples_since_sync,
                    # the digest of the global parameters this round starts from: every member must have the same
                    "digest": s.digest,
                    # its stepped-state buffers hold this sync's: a group of such peers started from different
                    # parameters averages their states (mixing groups) instead of repairing
                    "mixing": s.stepped_ready,
                    # a pseudo-gradient of fewer inner steps than H (a newcomer's first, after it took the state
                    # mid-phase) is smaller than the others': widen its norm check in proportion
                    "norm_scale": s.local_steps / max(1, min(s.steps_since_sync, s.local_steps)),
                    **(s.more_to_gather() if s.more_to_gather is not None else {})},
        )

    def record(self, started: float, result: Optional[RoundResult], attempts: int, **flags) -> SyncRecord:
        """Close the sync: its record in ``history`` (and the log), the next phase's counters, a fresh progress
        record. ``flags``: ``caught_up``, ``repaired``, ``abandoned`` (see ``SyncRecord``)."""
        s = self.state
        record = SyncRecord.of(result, outer_step=s.outer_step, seconds=time.perf_counter() - started,
                               samples=s.samples_since_sync, attempts=attempts, digest=s.digest,
                               phases=sync_phases(s.clock.seconds, result), **flags)
        s.last_group = {peer for peer in result.gathered if peer != s.peer_id} if result else set()
        return self.finish_record(record)

    def finish_record(self, record: SyncRecord) -> SyncRecord:
        """The rest of closing a sync: its record in ``history`` and the log, the next phase's counters, a fresh
        progress record."""
        s = self.state
        record.inner_steps, record.stride = s.steps_since_sync, self.pace.stride
        record.step_s, record.fastest_step_s = self.pace.step_s, self.progress.fastest_step_s
        record.peers_seen, self.rounds.peers_seen = self.rounds.peers_seen[-16:], []
        steps_before = self.pace.steps
        if self.pace.update(record.step_s, record.fastest_step_s) != steps_before:
            logger.info(f"{s.tag()} an inner step here takes {self.pace.ratio or 0:.2f}x the fastest live peer's: "
                        f"{self.pace.steps} inner steps per phase from now on (stride {self.pace.stride:g})")
        record.log(logger, s.tag())
        s.history.append(record)
        s.phase_started = time.monotonic()
        if not record.abandoned:  # an abandoned round's samples are still in the model, to be synced later
            s.samples_since_sync = 0
            s.steps_since_sync = 0
        # our commit, stored in the background: a member of this round that reads the records before it is stored
        # still counts us (swarm_view.outlook_of), and waiting here cost up to FORCED_STORE_WAIT_S of every sync
        started_publish = time.perf_counter()
        self.publish(force=True, wait=False)
        record.phases["record"] = time.perf_counter() - started_publish
        return record
