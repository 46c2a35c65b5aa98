"""A peer's membership of a run: joining it (settings check, averager process, first progress record, heartbeat)
and leaving it (the last round's members, the record withdrawn, the averager stopped). ``DiLoCoOptimizer.start()``
and ``shutdown()`` are these two; both are idempotent and safe after a failure."""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Collection, Optional

from p2ptrain.swarm.progress import ProgressPublisher, RunMismatch, check_run_settings, fetch_progress

logger = logging.getLogger(__package__)  # one logger name for the whole optimizer, as users grep for it

LEAVE_WAIT_S = 10.0
"""a peer that leaves right after a round waits at most this long for the other members to commit it"""


class Membership:
    """Joins and leaves the run for one optimizer. ``publish_first`` stores the peer's first progress record (and
    waits for it); ``tag`` prefixes log lines."""

    def __init__(self, dht, run_id: str, averager, progress: Optional[ProgressPublisher], *, progress_period_s: float,
                 settings: dict, watch_swarm: bool, averager_start_timeout_s: float,
                 publish_first: Callable[[], None], tag: Callable[[], str]):
        self.dht, self.run_id, self.averager = dht, run_id, averager
        self._owns_progress = progress is None  # a caller's publisher (a shard claim) is the caller's to withdraw
        # the caller's publisher carries what it knows beyond the tensors (a Worker: the model's name, shape, seed)
        settings = {**(progress.settings if progress is not None else {}), **settings}
        self.progress = progress or ProgressPublisher(dht, run_id, period_s=progress_period_s)
        self.progress.settings = settings
        relayed = getattr(dht, "relayed", None)  # behind NAT, dialled through relays (swarm/relays.py)
        self.progress.client_mode = averager.client_mode or relayed is not None  # never dialled directly
        if relayed is not None:  # published, and told of every look at the records
            self.progress.relay_maddrs, self.progress.on_look = tuple(relayed.relay_maddrs), relayed.look
        reachability = getattr(dht, "reachability", None)  # how start_dht chose the mode (swarm/reachability.py)
        self.progress.reachability = str(reachability) if getattr(reachability, "reason", "") else (
            "client" if averager.client_mode else "public")
        # the record's heartbeat also reads where the swarm is
        self.progress.watch_swarm = watch_swarm or relayed is not None
        self._averager_start_timeout_s = averager_start_timeout_s
        self._publish_first, self._tag = publish_first, tag
        self._lock = threading.Lock()
        self.started = False
        self.closed = threading.Event()

    def join(self) -> None:
        """Check this peer's settings against the live peers', start the averager process, publish the progress
        record and keep it fresh. A second call does nothing; a failed one stops what it had started."""
        with self._lock:
            if self.closed.is_set():
                raise RuntimeError("this DiLoCoOptimizer was shut down; build a new one to join the run again")
            if self.started:
                return
            if not hasattr(self.dht, "auth"):
                logger.warning("this DHT was not started by p2ptrain.swarm.dht.start_dht: its records are not signed, "
                               "so peers started by p2ptrain (the CLI, start_dht) ignore them; it averages only with "
                               "peers that also use a plain hivemind.DHT")
            published = False
            try:
                # a peer with another model or settings would never group with the run's peers (the schema hash
                # differs) and would wait, or train alone, in silence: refuse it now, naming the difference
                try:
                    check_run_settings(self.progress.settings, fetch_progress(self.dht, self.run_id, timeout_s=5.0),
                                       self.run_id)
                except RunMismatch:
                    if not self._owns_progress:  # a shard claim published it: leave the listing (and the rounds)
                        self.progress.withdraw()
                    raise
                self._start_averager()
                published = True  # from here on, a failure must withdraw the record it may have stored
                self._publish_first()
                self.progress.start_heartbeat()
            except BaseException:
                self._stop(withdraw=published)
                raise
            self.started = True

    def _start_averager(self) -> None:
        try:
            self.averager.start_in_background(timeout_s=self._averager_start_timeout_s)
        except Exception as e:
            if "already set" in str(e):
                raise ValueError(
                    f"another DiLoCoOptimizer of run {self.run_id!r} already uses this DHT; give each "
                    "optimizer its own hivemind.DHT (or its own run_id)"
                ) from None
            raise

    def leave(self, interrupt: Callable[[], None], sync_lock: threading.Lock, attempt_s: float,
              last_round: Callable[[], tuple]) -> None:
        """Stop looking for peers, let a sync in flight finish its attempt (at most ``attempt_s``), wait (bounded)
        for the members of the last round to commit it, withdraw the record and stop the averager. ``last_round``
        gives (the other members of our last round, our outer step) once the sync in flight is done."""
        with self._lock:
            if self.closed.is_set():
                return
            self.closed.set()
        interrupt()
        if not self.started:
            return
        acquired = sync_lock.acquire(timeout=attempt_s)
        try:
            self._wait_for_members(*last_round(), timeout_s=LEAVE_WAIT_S)
            self._stop(withdraw=True)
        finally:
            if acquired:
                sync_lock.release()

    def _stop(self, withdraw: bool) -> None:
        """Withdraw the progress record (which stops its heartbeat) and stop the averager process if it runs."""
        if withdraw:
            self.progress.withdraw()
        if self.averager.is_alive():
            self.averager.shutdown()

    def _wait_for_members(self, members: Collection[str], outer_step: int, timeout_s: float) -> None:
        """Our part of the last all-reduce may still be on its way to a slower member when we have our own result
        (a peer that ends the run at an absolute outer step leaves at once); stopping the p2p daemon then would cut
        it off, and a member whose round failed could no longer take the state from us."""
        deadline = time.monotonic() + timeout_s
        while members and self.averager.is_alive():
            behind = sorted(r.peer_id[-8:] for r in fetch_progress(self.dht, self.run_id, timeout_s=2.0)
                            if r.peer_id in members and r.outer_step < outer_step)
            if not behind:
                return
            if time.monotonic() > deadline:
                logger.warning(f"{self._tag()} leaving although member(s) {behind} of the last round have not "
                               f"committed it after {timeout_s:.0f}s")
                return
            time.sleep(0.2)
