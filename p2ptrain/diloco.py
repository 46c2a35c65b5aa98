"""DiLoCo as one drop-in optimizer: an inner optimizer every step, an averaged outer step every ``local_steps``.

One sync (an "outer step"), on every peer:

1. pseudo-gradient = (global parameters at the last sync) - (current parameters), fp32 on CPU
2. average it with the peers that are ready (``PseudoGradientAverager``), each weighted by the samples it trained on
   since the last sync; fp16 on the wire by default (or none, bf16, int8), fp32 accumulation; bit-identical result
   on every peer. With error feedback (int8 by default), the peer adds what the wire dropped of its previous
   pseudo-gradient to this one first
3. outer optimizer (SGD + Nesterov) steps on the fp32 global copy, with the average as its gradient
4. the model's parameters become the new global parameters; the inner optimizer's state carries over

Since every peer of a group starts a round with the same global parameters and outer state and receives the same
bits, every peer leaves it with the same bits too: no parameter-averaging round is ever needed on top.
"""

from __future__ import annotations

import hashlib
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch
from hivemind import DHT
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.utils import get_dht_time

from p2ptrain.averaging import PseudoGradientAverager, RoundResult
from p2ptrain.averaging.averager import PROTOCOL_VERSION
from p2ptrain.averaging.compression import COMPRESSIONS, ERROR_FEEDBACK_BY_DEFAULT
from p2ptrain.averaging.state_transfer import flatten_state, unflatten_state
from p2ptrain.finite import all_finite
from p2ptrain.outer import add_error_feedback_, outer_step_, pseudo_gradient_
from p2ptrain.swarm.progress import ProgressPublisher, RunMismatch, check_run_settings, fetch_progress

logger = logging.getLogger(__name__)

NO_GROUP_POLICIES = ("apply_local", "wait")
_BEHIND = object()  # _average's answer when the swarm is at a later outer step than this peer
MAX_INCOMPLETE_RETRIES = 2  # re-runs of a round that a member's failure left incomplete, under any policy
LATE_PEER_STALL_S = 30.0
LEAVE_WAIT_S = 10.0
"""a peer that leaves right after a round waits at most this long for the other members to commit it (close)"""
"""a live peer of this outer step whose local step has not moved for this long is not waited for (it is stuck,
or still starting up: it catches up from the swarm's state when it gets to its sync)"""


@dataclass
class RoundOutlook:
    """What the run's progress records say about the round this peer is about to average, read just before it."""

    ahead: bool
    """a live peer holds a later outer step: this round went on without us"""
    ready: List[str]
    """the other live peers at this outer step that reached the sync point (they are averaging or about to)"""
    late: Dict[str, int]
    """the other live peers at this outer step still in their inner steps: peer id -> local step"""


@dataclass
class SyncRecord:
    """The result of one sync, as this peer saw it."""

    outer_step: int
    """the outer step this sync completed (1 for the first sync)"""
    averaged: bool
    """False when no group formed and the peer applied its own pseudo-gradient"""
    group_size: int
    """peers in the group, this one included (1 when not averaged); a member whose parts the reducers refused (a
    bad or hostile peer, see averaging/allreduce.py) still counts, though nothing of it was averaged"""
    seconds: float
    """wall time of the whole sync: matchmaking, all-reduce and the outer step"""
    bytes_sent: int = 0
    bytes_received: int = 0
    samples: int = 0
    """samples this peer trained on since the previous sync (its weight in the average)"""
    failed_fraction: float = 0.0
    """fraction of the vector whose reducer failed mid-round (those values are this peer's own)"""
    attempts: int = 1
    """matchmaking attempts (more than 1 only under the "wait" policy)"""
    group_outer_steps: List[int] = field(default_factory=list)
    """outer step each group member was on; differing values mean the peers were not in sync"""
    caught_up: bool = False
    """True when the peer was behind the swarm and took the state from live peers instead of averaging"""
    repaired: bool = False
    """True when the group's digests showed this peer's global parameters differed and it took the state anew"""
    abandoned: bool = False
    """True when the peer was leaving and no group formed: no outer step was taken (``outer_step`` unchanged)"""
    digest: str = ""
    """digest of the global parameters after this sync: equal on every peer that committed the same round"""
    finished_at: float = 0.0
    """wall-clock time (time.time()) when the sync ended"""
    allreduce_s: float = 0.0
    """seconds of the all-reduce that was applied, from the group's forming; the rest of ``seconds`` is
    matchmaking (and earlier attempts), the outer step and the digest"""

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _SnapshotRequest:
    """A donor snapshot asked for by the state-serving thread, to be copied by whichever thread comes first."""

    staging: torch.Tensor
    done: threading.Event = field(default_factory=threading.Event)
    metadata: Optional[dict] = None


def _digest_of(tensors: Iterable[torch.Tensor]) -> str:
    # sha256, not blake2b: with the SHA extensions of current x86 and ARM CPUs it hashes 100 MB in half the time
    # (0.06 s against 0.11 s), and every sync hashes all the global parameters
    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().contiguous().numpy())
    return digest.hexdigest()[:32]


class DiLoCoOptimizer(torch.optim.Optimizer):
    """A drop-in ``torch.optim.Optimizer`` that trains with DiLoCo across a hivemind swarm.

    :param params: the model's parameters (or parameter groups), handed to the inner optimizer as they are
    :param dht: a started ``hivemind.DHT``; its peers with the same ``run_id`` average together
    :param run_id: namespaces every DHT key of this training run
    :param local_steps: H, inner steps between syncs
    :param inner_optimizer: a callable that builds the inner optimizer from ``params`` (e.g. ``partial(AdamW, ...)``)
    :param outer_optimizer: a callable that builds the outer optimizer from the fp32 global parameters
    :param compression: wire format of pseudo-gradients: "none" (fp32), "fp16", "bf16" (2 bytes per value) or
      "int8" (1 byte per value plus an fp32 scale per 1024 values); see ``p2ptrain/averaging/compression.py``
    :param error_feedback: keep what the wire rounded off this peer's pseudo-gradient (fp32, CPU, one copy of the
      parameters) and add it to the next one, so that nothing is lost for good. None (default): on for "int8" only.
      The residual is dropped when the peer takes the swarm's state or its round is not averaged, and it is in
      neither checkpoints (``state_dict``) nor the state newcomers download
    :param matchmaking_time_s: how long a round looks for peers beyond those the progress records announce; a
      round whose announced peers are all in starts at once. Raise it if peers that are plainly alive end up in
      separate groups (slow links, large swarms)
    :param late_peer_wait_s: how long a round waits for live peers of this outer step that have not reached the
      sync point yet, once another peer is ready to average (None: this peer's last inner phase / the peers expected, at
      least ``matchmaking_time_s``). A peer alone at the sync point waits for the others as long as they make
      progress: a solo outer step would make all of their inner steps worthless
    :param averaging_timeout_s: how long the all-reduce itself may take once a group formed; raise it for large
      models on slow links ("all-reduce timed out" in the log)
    :param min_group_size: a round needs at least this many peers
    :param target_group_size: at most this many peers per group (None: no limit); a full group starts at once
    :param no_group_policy: what a peer does when no group formed: "apply_local" (step with its own
      pseudo-gradient, logged as a warning) or "wait" (look again, logged, until a group forms or ``close()``)
    :param batch_size: samples per inner step, the default weight unit of ``step`` (``step(batch_size=...)`` wins)
    :param client_mode: never accept incoming connections (for peers behind NAT); defaults to the DHT's mode
    :param averager_start_timeout_s: how long the averager process may take to start
    :param progress_period_s: how often the peer's progress record in the DHT is refreshed between syncs
    :param progress: publish progress through this publisher (e.g. one that already carries a shard claim)
    :param catch_up_mid_phase: when the live peers' records show the swarm at a later outer step (this peer was
      left out of a round: paused, or later than ``late_peer_wait_s``), take the swarm's state at the next inner
      step instead of finishing an inner phase whose pseudo-gradient nobody will average. Off for a peer of
      several ranks, whose ranks catch up together at a sync (``hsdp.ShardedDiLoCo``)
    :param max_norm_ratio: a peer's part of the all-reduce (or a reducer's average) whose norm exceeds this many
      times this peer's own values over the same range is refused and the peer excluded for a while; None: no bound
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        dht: DHT,
        run_id: str,
        local_steps: int,
        inner_optimizer: Callable[..., torch.optim.Optimizer],
        outer_optimizer: Callable[..., torch.optim.Optimizer],
        compression: str = "fp16",
        error_feedback: Optional[bool] = None,
        matchmaking_time_s: float = 5.0,
        late_peer_wait_s: Optional[float] = None,
        averaging_timeout_s: float = 60.0,
        min_group_size: int = 2,
        target_group_size: Optional[int] = None,
        no_group_policy: str = "apply_local",
        batch_size: Optional[int] = None,
        client_mode: Optional[bool] = None,
        averager_start_timeout_s: float = 60.0,
        progress_period_s: float = 5.0,
        progress: Optional[ProgressPublisher] = None,
        max_norm_ratio: Optional[float] = 10.0,
        catch_up_mid_phase: bool = True,
    ):
        if local_steps < 1:
            raise ValueError(f"local_steps must be at least 1, got {local_steps}")
        if no_group_policy not in NO_GROUP_POLICIES:
            raise ValueError(f"no_group_policy must be one of {NO_GROUP_POLICIES}, got {no_group_policy!r}")
        if matchmaking_time_s <= 0 or averaging_timeout_s <= 0:
            raise ValueError("matchmaking_time_s and averaging_timeout_s must be positive")
        if late_peer_wait_s is not None and late_peer_wait_s < 0:
            raise ValueError(f"late_peer_wait_s must be at least 0, got {late_peer_wait_s}")
        if min_group_size < 1:
            raise ValueError(f"min_group_size must be at least 1, got {min_group_size}")
        if compression not in COMPRESSIONS:
            raise ValueError(f"unknown compression {compression!r}; use one of: {', '.join(COMPRESSIONS)}")

        self.inner_optimizer = inner_optimizer(params)
        # share the inner optimizer's groups and state: schedulers, grad clipping and zero_grad see the real thing
        super().__init__([p for group in self.inner_optimizer.param_groups for p in group["params"]], {})
        self.param_groups = self.inner_optimizer.param_groups
        self.state = self.inner_optimizer.state
        self.defaults = self.inner_optimizer.defaults

        self.params: List[torch.Tensor] = [p for group in self.param_groups for p in group["params"]]
        # the global parameters: what every peer agreed on at the last sync, fp32 on CPU
        self.global_params = [
            torch.nn.Parameter(p.detach().to("cpu", torch.float32, copy=True), requires_grad=True)
            for p in self.params
        ]
        self.outer_optimizer = outer_optimizer(self.global_params)

        self.dht, self.run_id = dht, run_id
        self.local_steps = local_steps
        self.matchmaking_time_s, self.averaging_timeout_s = matchmaking_time_s, averaging_timeout_s
        self.late_peer_wait_s = late_peer_wait_s
        self.target_group_size, self.min_group_size = target_group_size, min_group_size
        self._phase_started = time.monotonic()  # when this peer's current inner phase began (late_peer_wait_s)
        self.no_group_policy = no_group_policy
        self.batch_size = batch_size
        self.local_step = 0
        self.outer_step = 0
        self._committed_local_step = 0  # local step at which the last outer step was taken
        self._donor_in_round = False  # the last downloaded state came from peers in the middle of a round
        self.samples_since_sync = 0
        self._steps_since_sync = 0  # inner steps in this peer's pseudo-gradient (the norm check's scale)
        self.history: List[SyncRecord] = []
        self._last_group: set = set()  # the other members of our last round that averaged (base58 ids)
        self._closed = threading.Event()
        self._interrupted = threading.Event()  # set: stop looking for peers (the peer is leaving)
        self._sync_lock = threading.Lock()
        # guards what a newcomer downloads (global params, outer and inner state, counters) against the training
        # thread changing it mid-copy; held for one inner step or one outer update at a time
        self._state_lock = threading.Lock()

        # matchmaking requests must time out well inside the matchmaking window (hivemind's deadlock breaker)
        self._request_timeout_s = min(3.0, matchmaking_time_s / 2)
        # the averager owns these buffers (shared memory with its process); we write pseudo-gradients into them
        pseudo_gradients = [torch.zeros_like(g) for g in self.global_params]
        self.averager = PseudoGradientAverager(
            pseudo_gradients,
            dht,
            prefix=f"{run_id}_diloco",
            compression=compression,
            min_group_size=min_group_size,
            target_group_size=target_group_size,
            min_matchmaking_time=matchmaking_time_s,
            request_timeout=self._request_timeout_s,
            allreduce_timeout=averaging_timeout_s,
            next_chunk_timeout=averaging_timeout_s / 2,
            client_mode=client_mode,
            shutdown_timeout=5,
            max_norm_ratio=max_norm_ratio,
        )
        self.error_feedback = compression in ERROR_FEEDBACK_BY_DEFAULT if error_feedback is None else error_feedback
        # error feedback: what the wire dropped of this peer's last averaged pseudo-gradient, to be sent next time.
        # Not part of the shared state: each peer's own, and dropped whenever its rounding no longer applies
        self._residuals: Optional[List[torch.Tensor]] = None
        if self.error_feedback and not self.averager.codec.lossless:
            self._residuals = [torch.zeros_like(g) for g in self.global_params]
        self._digest = self._global_digest()
        self.averager.state_provider = self._shareable_state
        self.averager.set_host_outer_step(0)
        self._staging: Optional[torch.Tensor] = None  # shared-memory buffer the state is copied into for donors
        self._snapshot_request: Optional[_SnapshotRequest] = None
        self.last_donor_pause_s: Optional[float] = None
        """how long serving the last snapshot to newcomers held up this peer's training (the state lock)"""
        self.last_download: Optional[dict] = None
        """how the last state download went: seconds, bytes, chunks per donor, donors that failed"""
        if not hasattr(dht, "auth"):
            logger.warning("this DHT was not started by p2ptrain.swarm.dht.start_dht: its records are not signed, so "
                           "peers started by p2ptrain (the CLI, start_dht) ignore them; it averages only with peers "
                           "that also use a plain hivemind.DHT")
        # a peer with another model or settings would never group with the run's peers (the schema hash differs)
        # and would wait, or train alone, in silence: refuse it now, naming the difference
        # (with what the caller knows beyond the tensors: a Worker sets the model's name, shape and seed in progress)
        settings = {**(progress.settings if progress is not None else {}), **self.run_settings()}
        try:
            check_run_settings(settings, fetch_progress(dht, run_id, timeout_s=5.0), run_id)
        except RunMismatch:
            if progress is not None:  # a shard claim published it: leave the listing (and the rounds) at once
                progress.withdraw()
            raise
        try:
            self.averager.start_in_background(timeout_s=averager_start_timeout_s)
        except Exception as e:
            if "already set" in str(e):
                raise ValueError(
                    f"another DiLoCoOptimizer of run {run_id!r} already uses this DHT; give each optimizer its own "
                    "hivemind.DHT (or its own run_id)"
                ) from None
            raise
        self.progress = progress or ProgressPublisher(dht, run_id, period_s=progress_period_s)
        self.progress.client_mode = self.averager.client_mode
        reachability = getattr(dht, "reachability", None)  # how start_dht chose the mode (swarm/reachability.py)
        self.progress.reachability = str(reachability) if getattr(reachability, "reason", "") else (
            "client" if self.averager.client_mode else "public")
        self._explained_no_group_at = -math.inf
        self.progress.settings = settings
        self._throughput_since = time.monotonic()
        self._throughput_samples = 0
        self.samples_per_s = 0.0
        self.catch_up_mid_phase = catch_up_mid_phase
        self._no_donor_at_outer_step = -1  # a mid-phase catch-up found no donor at this outer step: wait for the sync
        self.progress.watch_swarm = catch_up_mid_phase
        self._publish_progress(force=True)
        self.progress.start_heartbeat()

    # ------------------------------------------------------------------------------------------ the optimizer API

    def step(self, closure: Optional[Callable[[], float]] = None, batch_size: Optional[int] = None):
        """One inner step; every ``local_steps`` inner steps, also a sync. Returns what the closure returned."""
        with self._state_lock:
            loss = self.inner_optimizer.step(closure)
            self.local_step += 1
        self._serve_snapshot_request()  # a donor snapshot asked for since the last step: copy it now, on this core
        samples = batch_size if batch_size is not None else (self.batch_size or 1)
        self.samples_since_sync += samples
        self._steps_since_sync += 1
        self._throughput_samples += samples
        if self.local_step % self.local_steps == 0:
            self.sync()
        elif (self.catch_up_mid_phase and self.progress.swarm_outer_step > self.outer_step
              and self._no_donor_at_outer_step != self.outer_step):
            self._catch_up_mid_phase()
        else:
            self._publish_progress()
        return loss

    def _catch_up_mid_phase(self) -> None:
        """The swarm went on without us: every inner step until our sync point would be thrown away there, so
        take the state now (a sync that averages nothing: the rest of the phase is in step with the swarm)."""
        with self._sync_lock:
            started = time.perf_counter()
            swarm_outer_step = self.swarm_outer_step()
            if swarm_outer_step <= self.outer_step:
                self.progress.swarm_outer_step = swarm_outer_step  # a stale look: nothing to do
                return
            logger.warning(f"{self._tag()} the swarm is at outer step {swarm_outer_step}: discarding this peer's "
                           f"{self._steps_since_sync} inner step(s) since its last sync now rather than at its sync "
                           "point, and taking the state from live peers")
            self._update_throughput()
            if self._catch_up_and_join(started, attempts=0) is None:
                self._no_donor_at_outer_step = self.outer_step  # no donor answered: try again at the sync point

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        # the error-feedback residual is left out on purpose: a resumed peer starts without one (at most one
        # rounding step of its last pseudo-gradient is lost), and a checkpoint stays the same across codecs
        return {
            "inner": self.inner_optimizer.state_dict(),
            "outer": self.outer_optimizer.state_dict(),
            "global_params": [g.detach().clone() for g in self.global_params],
            "local_step": self.local_step,
            "outer_step": self.outer_step,
            "samples_since_sync": self.samples_since_sync,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict["inner"] is not None:  # None: the caller restores the inner optimizer itself (sharded peers)
            self.inner_optimizer.load_state_dict(state_dict["inner"])
        self.outer_optimizer.load_state_dict(state_dict["outer"])
        with torch.no_grad():
            for g, saved in zip(self.global_params, state_dict["global_params"], strict=True):
                g.copy_(saved)
        self._digest = self._global_digest()
        self.local_step = state_dict["local_step"]
        self.outer_step = state_dict["outer_step"]
        self._committed_local_step = self.local_step
        self.averager.set_host_outer_step(self.outer_step)
        self.samples_since_sync = state_dict["samples_since_sync"]
        self._steps_since_sync = self.local_step % self.local_steps
        self._reset_residuals()

    # ------------------------------------------------------------------------------------------------- the sync

    def sync(self) -> SyncRecord:
        """Average pseudo-gradients with the swarm and take one outer step. Never raises for network failures."""
        # close() from another thread waits for this lock: shutting the averager down under a running step()
        # would leave that step waiting for an answer from a process that is gone
        with self._sync_lock:
            return self._sync()

    @torch.no_grad()
    def _sync(self) -> SyncRecord:
        started = time.perf_counter()
        self._update_throughput()
        # tell the others we are at the sync point now, not at the next periodic refresh: a round waits for the
        # live peers that have not got there yet (_plan_round), and would wait for us too
        self._publish_progress(force=True)
        outlook = self.round_outlook()  # one read of the records: this check, and the first attempt's plan
        if outlook.ahead:
            # behind already (paused, or a round went on without us): matchmaking at this outer step is doomed
            logger.warning(f"{self._tag()} the swarm has moved past outer step {self.outer_step}; discarding this "
                           "peer's stale pseudo-gradient and taking the state from live peers")
            record = self._catch_up_and_join(started, attempts=0)
            if record is not None:
                return record
        diverged = False
        with self.averager.get_tensors() as buffers:
            pseudo_gradient_(buffers, self.global_params, self.params)
            if not all(all_finite(buffer) for buffer in buffers):
                # local training diverged: contribute nothing (weight 0, zeros) but still take the group's average,
                # which puts this peer back on the shared parameters; the group is not kept waiting for us
                diverged = True
                for buffer in buffers:
                    buffer.zero_()
                self._reset_residuals()
                logger.error(
                    f"{self._tag()} the pseudo-gradient has NaN/inf values (local training diverged); "
                    "discarding this peer's local progress since the last sync; lower inner_lr if this repeats"
                )
            elif self._residuals is not None:
                # error feedback: send what the wire dropped last time too, and keep what it will drop of this
                # (the same parts, rounded the same way as the all-reduce will); kept only if the round averages
                add_error_feedback_(buffers, self._residuals, self.averager.codec, self.averager.part_size_bytes)

        result, attempts = self._average(weight=0.0 if diverged else float(max(self.samples_since_sync, 1)),
                                         outlook=outlook)
        if not isinstance(result, RoundResult):
            # nothing went through the wire: the peer applies its pseudo-gradient unrounded (apply_local), takes
            # the swarm's state (behind) or abandons the round; either way there is no rounding error to carry
            self._reset_residuals()
        if result is _BEHIND:
            logger.warning(
                f"{self._tag()} the swarm has moved past outer step {self.outer_step}; discarding this peer's "
                "stale pseudo-gradient and taking the state from live peers"
            )
            record = self._catch_up_and_join(started, attempts)
            if record is not None:
                return record
            result = None  # nobody could give us the state: fall back to the no-group policy
        if result is None and self._interrupted.is_set():
            # leaving: commit nothing the swarm did not. The local progress stays in the model's parameters (and in
            # a checkpoint, with the global ones), so a resumed peer takes this round up again.
            logger.warning(f"{self._tag()} leaving: abandoning this round without an outer step")
            return self._record(started, None, attempts, abandoned=True)
        if result is None and attempts == 0:  # alone in the swarm: nobody to wait for
            logger.info(f"{self._tag()} applying this peer's own pseudo-gradient: no other live peer of run "
                        f"{self.run_id!r} is at this outer step")
        elif result is None:  # the buffers still hold our own pseudo-gradient: a failed round never writes them
            self._explain_no_group()
            logger.warning(
                f"{self._tag()} no group formed after {attempts} attempt(s); applying this peer's own "
                "pseudo-gradient (no_group_policy=apply_local)"
            )
        return self._apply(started, result, attempts)

    @torch.no_grad()
    def _apply(self, started: float, result: Optional[RoundResult], attempts: int, **flags) -> SyncRecord:
        """The outer step with what the buffers hold (the group's average, or our own pseudo-gradient)."""
        with self.averager.get_tensors() as buffers, self._state_lock:
            outer_step_(self.outer_optimizer, self.global_params, buffers, self.params)
            self.outer_step += 1
            self._committed_local_step = self.local_step
        self._digest = self._global_digest()  # outside the averager's lock: hashing needs none of its buffers
        self.averager.set_host_outer_step(self.outer_step)
        repaired = result is not None and self._repair_if_diverged(result)
        return self._record(started, result, attempts, repaired=repaired, **flags)

    def catch_up(self) -> bool:
        """Take the swarm's state from live peers now (e.g. when joining a run in progress); if the donors were in
        the middle of a round, take part in it (with weight 0) so this peer leaves it in step with them. Returns
        False if no peer gave a usable state."""
        with self._sync_lock:
            return self._catch_up_and_join(time.perf_counter(), attempts=0) is not None

    def _catch_up_and_join(self, started: float, attempts: int) -> Optional[SyncRecord]:
        if not self.load_state_from_peers(timeout_s=self.averaging_timeout_s):
            return None
        if not self._donor_in_round:
            self._fast_forward()
        if self._donor_in_round:
            # The donors' state is from before the round they are running now. Without joining it, this peer (now
            # in phase with them) would sync exactly when they do next time, find them one step ahead, download
            # again while they average, and stay one round behind for good.
            joined = self._join_round_in_progress(started)
            if joined is not None:
                return joined
        return self._record(started, None, attempts, caught_up=True)

    def _fast_forward(self) -> None:
        """After taking the state mid-phase: the donors trained on while it downloaded (and it may be slower to start
        training again). Skip the inner steps they are ahead by, so that this peer reaches the sync point with them
        instead of late, where the round would wait for it or leave it out again; its pseudo-gradient then holds
        fewer inner steps (the norm check scales with them)."""
        me = self.dht.peer_id.to_base58()
        steps = [r.local_step for r in fetch_progress(self.dht, self.run_id, timeout_s=5.0)
                 if r.peer_id != me and r.outer_step == self.outer_step]
        next_sync = (self.local_step // self.local_steps + 1) * self.local_steps
        target = min(max(steps, default=-1), next_sync - 1)
        if target > self.local_step:
            logger.info(f"{self._tag()} the swarm is {target - self.local_step} inner step(s) further in this phase "
                        "than the state it took: skipping them, to reach the sync point together")
            self.local_step = target

    def _join_round_in_progress(self, started: float) -> Optional[SyncRecord]:
        """One attempt to join the round the swarm is running, with zeros and weight 0: this peer adds nothing to
        the average and commits the same outer step as the others. None (nothing applied) if it was too late."""
        with self.averager.get_tensors() as buffers:
            for buffer in buffers:
                buffer.zero_()
        result, attempts = self._average(weight=0.0, single_attempt=True)
        if not isinstance(result, RoundResult):
            logger.info(f"{self._tag()} too late to join the swarm's round in progress; syncing at the next one")
            return None
        return self._apply(started, result, attempts, caught_up=True)

    def _record(
        self,
        started: float,
        result: Optional[RoundResult],
        attempts: int,
        caught_up: bool = False,
        repaired: bool = False,
        abandoned: bool = False,
    ) -> SyncRecord:
        record = SyncRecord(
            outer_step=self.outer_step,
            averaged=result is not None,
            group_size=result.group_size if result else 1,
            seconds=time.perf_counter() - started,
            bytes_sent=result.bytes_sent if result else 0,
            bytes_received=result.bytes_received if result else 0,
            samples=self.samples_since_sync,
            failed_fraction=result.failed_fraction if result else 0.0,
            attempts=attempts,
            group_outer_steps=sorted(m.get("outer_step", -1) for m in result.gathered.values()) if result else [],
            caught_up=caught_up,
            repaired=repaired,
            abandoned=abandoned,
            digest=self._digest,
            finished_at=time.time(),
            allreduce_s=result.allreduce_s if result else 0.0,
        )
        self.history.append(record)
        me = self.dht.peer_id.to_base58()
        self._last_group = {peer for peer in result.gathered if peer != me} if result else set()
        self._phase_started = time.monotonic()
        if not abandoned:  # an abandoned round's samples are still in the model, to be synced later
            self.samples_since_sync = 0
            self._steps_since_sync = 0
        if result and result.failed_fraction > 0:
            logger.warning(f"{self._tag()} {result.failed_fraction:.1%} of the vector was not averaged (peer failure)")
        if result and len(set(record.group_outer_steps)) > 1:
            logger.warning(f"{self._tag()} group members were at different outer steps {record.group_outer_steps}")
        logger.info(
            f"{self._tag()} sync: group_size={record.group_size} seconds={record.seconds:.2f} "
            f"sent={record.bytes_sent}B received={record.bytes_received}B"
        )
        self._publish_progress(force=True)
        return record

    def _average(self, weight: float, single_attempt: bool = False,
                 outlook: Optional[RoundOutlook] = None) -> tuple[Optional[RoundResult], int]:
        """Run averaging attempts until a group averages, or this peer must go on without one (None).

        Each attempt is planned from the progress records (``_plan_round``): its group starts as soon as every live
        peer of this outer step is in, and waits a bounded time for those still in their inner steps. Under
        "apply_local", a peer goes on alone only when no other live peer is at its outer step: a solo outer step
        next to such a peer would throw all of that peer's inner steps away (it would have to take our state).
        Under "wait" it never goes on alone. ``outlook``: the records as the caller just read them (else read here).
        """
        attempts, incomplete_retries = 0, 0
        unjoinable_since: Optional[float] = None  # when ready peers first failed to group with us
        # members whose range failed a round of this sync: not counted in the target again. They still keep this
        # peer from stepping alone: a failed round can also name a live member (one stuck behind the dead one)
        excluded: set = set()
        late_deadline = None  # set at the first look, from how many peers are expected
        last_moved: Dict[str, tuple] = {}  # late peer -> (its local step, when we first saw it there)
        while not self._interrupted.is_set():
            outlook = outlook if outlook is not None and attempts == 0 else self.round_outlook()
            if outlook.ahead:
                return _BEHIND, attempts
            now = time.monotonic()
            for peer, local_step in outlook.late.items():
                if last_moved.get(peer, (None,))[0] != local_step:
                    last_moved[peer] = (local_step, now)
            moving = [peer for peer in outlook.late if now - last_moved[peer][1] < LATE_PEER_STALL_S]
            ready = [peer for peer in outlook.ready if peer not in excluded]
            late = [peer for peer in moving if peer not in excluded]
            if late_deadline is None:
                late_deadline = now + self._late_peer_wait_s(1 + len(ready) + len(late))
            alone = not outlook.ready and not moving and not single_attempt and self.no_group_policy == "apply_local"
            # ... but looks once when others may yet be there with no record to show for it: in a new swarm's first
            # round (they may still be starting), or when this peer saw another live peer recently (a record that
            # was slow to store, or a read that timed out, must not make it step alone next to that peer)
            # (a live peer refreshes its record every period: not seen for two of them, it is gone)
            recently = time.monotonic() - self.progress.others_seen_at < 2 * self.progress.period_s
            if alone and (self.outer_step > 0 and not recently or attempts > 0):
                if attempts == 0:
                    logger.info(f"{self._tag()} no other live peer is at outer step {self.outer_step}: not "
                                "looking for a group")
                break
            attempts += 1
            if not self.averager.is_alive():
                logger.error(f"{self._tag()} the averager process is gone; this peer can no longer average")
                break
            target, window_s = self._plan_round(ready, late, late_deadline - now)
            self.averager.set_round_plan(target, window_s, expected=[*ready, *late],
                                         max_group_size=self.target_group_size)
            logger.debug(f"{self._tag()} attempt {attempts}: ready {[p[-8:] for p in ready]}, late "
                         f"{ {p[-8:]: outlook.late[p] for p in late} } at local step {self.local_step}: "
                         f"target {target}, window {window_s:.1f}s")
            incomplete_before = self.averager.incomplete_rounds
            result = self._attempt(weight, target, window_s, attempts)
            if result is not None:
                return result, attempts
            if single_attempt:
                break
            incomplete = self.averager.incomplete_rounds != incomplete_before
            if incomplete:
                # a member died mid-round: nothing was applied here. Members that got every part may have committed
                # the round; give them a moment to say so (then we take their state), else run it again with the
                # survivors, without waiting for the members whose range failed. Never fall back to our own
                # pseudo-gradient here: the survivors would each apply a different one.
                excluded |= self.averager.last_failed_members
                time.sleep(1.0)
                if self.swarm_outer_step() > self.outer_step:
                    return _BEHIND, attempts
                if incomplete_retries < MAX_INCOMPLETE_RETRIES:
                    incomplete_retries += 1
                    logger.warning(f"{self._tag()} a group member failed mid-round; running the round again with "
                                   f"the survivors (retry {incomplete_retries}/{MAX_INCOMPLETE_RETRIES})")
                    continue
            if not outlook.ready:
                unjoinable_since = None
            elif unjoinable_since is None:
                unjoinable_since = now
            if self.no_group_policy == "apply_local":
                if moving and not outlook.ready:
                    continue  # the others are still training and making progress: wait for them
                # peers at the sync point that did not group with us are in a round of their own (a failed one
                # takes at most the averaging timeout) or refuse us: wait that long, then go on
                # (a peer with weight 0 adds nothing: a group of such peers is refused by all its members alike, so
                # waiting for one is pointless)
                if outlook.ready and weight > 0 and \
                        now - unjoinable_since < self.averaging_timeout_s + self.matchmaking_time_s:
                    continue
                break
            self._explain_no_group()
            logger.warning(
                f"{self._tag()} no group formed (attempt {attempts}); waiting for peers (no_group_policy=wait)"
            )
        return None, attempts

    def _late_peer_wait_s(self, expected: int) -> float:
        """How long the ready peers wait for late ones. Waiting t seconds idles the ready peers, (expected - 1) * t
        compute-seconds; leaving a late peer out throws away its phase so far, about phase - t: so the default waits
        up to a phase / expected (the break-even), and at least the matchmaking window."""
        if self.late_peer_wait_s is not None:
            return self.late_peer_wait_s
        return max(self.matchmaking_time_s, (time.monotonic() - self._phase_started) / max(expected, 2))

    def _plan_round(self, ready: List[str], late: List[str], late_left_s: float) -> tuple[Optional[int], float]:
        """(target group size, matchmaking window) for one attempt. The group starts the moment it holds every
        live peer we expect; the window bounds the wait for the ones that are late."""
        if late and (late_left_s > 0 or not ready):
            # wait for the late ones too: until the bound while others are ready, else in windows, re-planned
            target, window_s = 1 + len(ready) + len(late), max(self.matchmaking_time_s, late_left_s)
        else:
            target, window_s = (1 + len(ready) if ready else None), self.matchmaking_time_s
        if self.target_group_size is not None and target is not None:
            target = min(target, self.target_group_size)
        if target is not None:
            target = max(target, self.min_group_size)  # a group of fewer could not start anyway
        return (target if target is not None else self.target_group_size), window_s

    def _attempt(self, weight: float, target: Optional[int], window_s: float, attempt: int) -> Optional[RoundResult]:
        """One matchmaking + all-reduce attempt; None if it formed no group or failed (logged at debug level: the
        caller decides what a failure means)."""
        try:
            # peers only group with peers at the same outer step: a peer that fell behind finds nobody and
            # catches up from live peers instead of averaging a pseudo-gradient computed from stale parameters
            self.averager.set_group_bits(format(self.outer_step % 256, "08b"))
            # the leader waits window_s for followers; allow a request timeout on top
            matchmaking_timeout_s = window_s + self._request_timeout_s + 1.0
            control = self.averager.step(
                weight=weight,
                # the digest of the global parameters this round starts from: every member must have the same
                gather={"outer_step": self.outer_step, "samples": self.samples_since_sync,
                        "digest": self._digest,
                        # a pseudo-gradient of fewer inner steps than H (a newcomer's first, after it took
                        # the state mid-phase) is smaller than the others': widen its norm check in proportion
                        "norm_scale": self.local_steps / max(1, min(self._steps_since_sync, self.local_steps))},
                scheduled_time=get_dht_time() + window_s,
                timeout=matchmaking_timeout_s,
                allow_retries=True,
                wait=False,
            )
            # bounded even if the averager process dies mid-round: then this raises TimeoutError
            result = control.result(timeout=matchmaking_timeout_s + self.averaging_timeout_s + 10.0)
            if isinstance(result, RoundResult):
                return result
        except (AllreduceException, MatchmakingException, TimeoutError, RuntimeError) as e:
            logger.debug(f"{self._tag()} averaging attempt {attempt} failed: {e!r}")
        except Exception as e:  # a network failure is a value: log it, never let it kill training
            logger.warning(f"{self._tag()} averaging attempt {attempt} failed unexpectedly: {e!r}")
        return None

    def round_outlook(self, excluded: Iterable[str] = ()) -> RoundOutlook:
        """Read the run's progress records: is the swarm ahead, and who at this outer step is ready or late."""
        me, excluded = self.dht.peer_id.to_base58(), set(excluded)
        ready, late, ahead = [], {}, False
        for record in fetch_progress(self.dht, self.run_id, timeout_s=5.0):
            if record.peer_id == me or record.peer_id in excluded:
                continue
            self.progress.others_seen_at = time.monotonic()
            ahead |= record.outer_step > self.outer_step
            if record.outer_step != self.outer_step:
                continue
            if record.local_step >= self.local_step:
                ready.append(record.peer_id)
            else:
                late[record.peer_id] = record.local_step
        return RoundOutlook(ahead=ahead, ready=ready, late=late)

    def _reset_residuals(self) -> None:
        if self._residuals is not None:
            for residual in self._residuals:
                residual.zero_()

    def _global_digest(self) -> str:
        """A digest of the exact bits of the global parameters: equal on every peer after every committed round."""
        return _digest_of(self.global_params)

    def _repair_if_diverged(self, result: RoundResult) -> bool:
        """Compare the digests the group's members started the round from. If they differ (a peer missed part of an
        earlier round, applied a local step, or was corrupted), every member agrees on one reference digest (the most
        common; ties go to the smallest peer id) and the members that did not hold it take the state anew from a peer
        that did. Returns True if this peer repaired itself."""
        digests = {peer: info.get("digest") for peer, info in result.gathered.items()}
        if len(set(digests.values())) <= 1:
            return False
        counts: dict = {}
        for digest in digests.values():
            counts[digest] = counts.get(digest, 0) + 1
        reference = min(digests.items(), key=lambda item: (-counts[item[1]], item[0]))[1]
        mine = digests.get(self.dht.peer_id.to_base58())
        logger.error(
            f"{self._tag()} the group started this round from {len(counts)} different parameter versions "
            f"({', '.join(f'{d[:8]}x{n}' for d, n in counts.items())}); the reference is {reference[:8]}"
        )
        if mine == reference:
            return False
        # stop serving our state while it is the wrong one, so the download comes from a peer that has the reference
        self.averager.allow_state_sharing = False
        try:
            return self.load_state_from_peers(timeout_s=self.averaging_timeout_s)
        finally:
            if not self.averager.client_mode:
                self.averager.allow_state_sharing = True

    def run_settings(self) -> dict:
        """What every peer of the run must agree on (swarm/progress.SETTINGS), as this peer has it."""
        schema = hashlib.sha256(repr([(tuple(g.shape), str(g.dtype)) for g in self.global_params]).encode())
        return dict(params_schema=schema.hexdigest()[:16], num_parameters=sum(g.numel() for g in self.global_params),
                    num_tensors=len(self.global_params), local_steps=self.local_steps,
                    compression=self.averager.compression_name, protocol=PROTOCOL_VERSION)

    def _explain_no_group(self) -> None:
        """If no group can form because no live peer can lead one (all behind NAT, in client mode), say so: at
        most once a minute, instead of waiting in silence."""
        if not self.averager.client_mode or time.monotonic() - self._explained_no_group_at < 60.0:
            return
        me = self.dht.peer_id.to_base58()
        others = [r for r in fetch_progress(self.dht, self.run_id, timeout_s=5.0) if r.peer_id != me]
        if any(not r.client_mode for r in others):
            return
        self._explained_no_group_at = time.monotonic()
        who = (f"so are all {len(others)} other live peer(s) of run {self.run_id!r}" if others else
               f"no other peer of run {self.run_id!r} is live")
        logger.error(
            f"{self._tag()} no group can form: this peer is behind NAT (client mode) and {who}; only a peer that "
            "others can dial can lead a group and reduce its parts: start at least one worker on a host with a "
            "public IP or a forwarded port (README, 'Behind NAT')"
        )

    def swarm_outer_step(self) -> int:
        """The highest outer step among the run's other live peers (from their progress records), or -1."""
        me = self.dht.peer_id.to_base58()
        steps = [r.outer_step for r in fetch_progress(self.dht, self.run_id, timeout_s=5.0) if r.peer_id != me]
        return max(steps, default=-1)

    # ------------------------------------------------------------------------------------------ state transfer

    def _shareable_state(self) -> tuple:
        """What a newcomer downloads from this peer (called in this process by hivemind's state-serving thread):
        metadata (counters, shapes, the inner optimizer's layout) and the state as one flat float32 vector (global
        params, outer momentum, inner state tensors) in a shared-memory staging buffer kept between snapshots.

        The copy into the buffer is made by the training thread itself at its next inner step (``step()`` calls
        ``_serve_snapshot_request``), so training pauses for one warm memory copy on its own core, never waiting
        for a busier thread; if no step comes within a second (the trainer is in a sync, or idle), this thread
        copies under the state lock. The averager process copies the buffer before it asks for the next one."""
        for _ in range(3):  # the layout can change between the two looks (e.g. the inner optimizer's first step)
            with self._state_lock:
                size = sum(t.numel() for t in self._state_layout()[0])
            if self._staging is None or self._staging.numel() != size:
                # allocated and touched outside the lock: the page faults are not the trainer's problem
                self._staging = torch.zeros(size, dtype=torch.float32).share_memory_()
            request = _SnapshotRequest(self._staging)
            self._snapshot_request = request
            if not request.done.wait(timeout=1.0):
                self._serve_snapshot_request()
            self._snapshot_request = None
            if request.metadata is not None:
                return request.metadata, [self._staging], None
        raise RuntimeError("the optimizer's state kept changing shape while a snapshot was taken")

    def _serve_snapshot_request(self) -> None:
        """Copy the state into the staging buffer if a donor snapshot was asked for (any thread)."""
        request = self._snapshot_request
        if request is None or request.done.is_set():
            return
        with self._state_lock:
            if request.done.is_set():
                return
            started = time.perf_counter()
            tensors, metadata = self._state_layout()
            if sum(t.numel() for t in tensors) == request.staging.numel():
                flatten_state(tensors, out=request.staging)
                request.metadata = metadata
            self.last_donor_pause_s = time.perf_counter() - started
            request.done.set()

    def _state_layout(self) -> tuple:
        """The tensors a newcomer needs, in order, and the metadata that describes them. Call under the lock."""
        tensors = list(self.global_params)
        momentum = [self.outer_optimizer.state.get(g, {}).get("momentum_buffer") for g in self.global_params]
        has_momentum = all(m is not None for m in momentum)
        if has_momentum:
            tensors += momentum
        inner = []
        for p in self.params:
            state = self.inner_optimizer.state.get(p, {})
            names = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0)
            numbers = (int, float, torch.Tensor)
            scalars = {k: float(v) for k, v in state.items() if k not in names and isinstance(v, numbers)}
            tensors += [state[name] for name in names]
            inner.append({"tensors": names, "scalars": scalars})
        metadata = {
            "outer_step": self.outer_step,
            "local_step": self.local_step,
            # at a sync point but not yet past it: this peer is in a round right now
            "in_round": self.local_step % self.local_steps == 0 and self._committed_local_step != self.local_step,
            "digest": self._digest,
            "has_momentum": has_momentum,
            "inner": inner,
            "lrs": [group["lr"] for group in self.param_groups],
            "shapes": [list(t.shape) for t in tensors],
        }
        return tensors, metadata

    def load_state_from_peers(self, timeout_s: float = 120.0) -> bool:
        """Take the swarm's state from live peers: global parameters, outer momentum, inner optimizer state, LR and
        step counters; the model's parameters become the global ones. The state comes in chunks from every donor at
        the swarm's latest outer step (``averaging/state_transfer.py``). Returns False (and logs why) if no peer
        gave a usable state; the peer then keeps its own."""
        started = time.perf_counter()
        try:
            downloaded = self.averager.download_state(timeout_s=timeout_s)
        except Exception as e:
            downloaded = None
            logger.warning(f"{self._tag()} downloading the state from peers failed: {e!r}")
        if downloaded is None:
            logger.warning(f"{self._tag()} no live peer shared its state; keeping this peer's own")
            return False
        metadata = downloaded.metadata
        try:
            tensors = unflatten_state(downloaded.flat, metadata["shapes"])
        except (KeyError, TypeError, ValueError) as e:
            logger.warning(f"{self._tag()} ignoring a downloaded state: malformed layout ({e!r})")
            return False
        problem = self._check_downloaded_state(metadata, tensors)
        if problem:
            logger.warning(f"{self._tag()} ignoring a downloaded state: {problem}")
            return False
        with torch.no_grad(), self._state_lock:
            n = len(self.global_params)
            for g, t in zip(self.global_params, tensors[:n]):
                g.copy_(t)
            rest = tensors[n:]
            if metadata["has_momentum"]:
                for g, m in zip(self.global_params, rest[:n]):
                    self.outer_optimizer.state[g]["momentum_buffer"] = m.clone()
                rest = rest[n:]
            for p, spec in zip(self.params, metadata["inner"]):
                # clones: the flat download buffer is freed once loaded
                state = {name: rest[i].to(p.device, p.dtype, copy=True) for i, name in enumerate(spec["tensors"])}
                rest = rest[len(spec["tensors"]):]
                state.update({k: torch.tensor(v, dtype=torch.float32) for k, v in spec["scalars"].items()})
                self.inner_optimizer.state[p] = state
            for group, lr in zip(self.param_groups, metadata["lrs"]):
                group["lr"] = lr
            for p, g in zip(self.params, self.global_params):
                p.copy_(g)
            self.outer_step = int(metadata["outer_step"])
            # the donor's local step puts this peer's next sync in phase with the swarm's
            self.local_step = int(metadata["local_step"])
            self._donor_in_round = bool(metadata.get("in_round", False))
            self._committed_local_step = -1 if self._donor_in_round else self.local_step
            self.samples_since_sync = 0
            self._steps_since_sync = 0
            self._digest = self._global_digest()
            self._reset_residuals()  # our rounding residual belongs to a trajectory this peer just left
        self.averager.set_host_outer_step(self.outer_step)
        self.last_download = {
            "seconds": time.perf_counter() - started,
            "bytes": downloaded.num_bytes,
            "chunks_by_donor": downloaded.chunks_by_donor,
            "failed_donors": downloaded.failed_donors,
        }
        logger.info(
            f"{self._tag()} took the swarm's state (outer step {self.outer_step}, {downloaded.num_bytes / 2**20:.1f} "
            f"MiB) in {self.last_download['seconds']:.2f}s from {len(downloaded.chunks_by_donor)} donor(s)"
            + (f"; resumed past {len(downloaded.failed_donors)} failed donor(s)" if downloaded.failed_donors else "")
        )
        return True

    def _check_downloaded_state(self, metadata: Any, tensors: List[torch.Tensor]) -> str:
        """Why a peer's state must not be loaded, or an empty string: it comes from another host, so check it."""
        try:
            n = len(self.global_params)
            inner_counts = [len(spec["tensors"]) for spec in metadata["inner"]]
            expected = n * (2 if metadata["has_momentum"] else 1) + sum(inner_counts)
            if len(metadata["inner"]) != len(self.params) or len(metadata["lrs"]) != len(self.param_groups):
                return "it describes a different set of parameters"
            if len(tensors) != expected:
                return f"{len(tensors)} tensors where {expected} were announced"
            shapes = [g.shape for g in self.global_params] * (2 if metadata["has_momentum"] else 1)
            shapes += [p.shape for p, count in zip(self.params, inner_counts) for _ in range(count)]
            if any(t.shape != shape for t, shape in zip(tensors, shapes)):
                return "tensor shapes do not match this model (another model size?)"
            if not all(all_finite(t) for t in tensors):
                return "it contains NaN or infinite values"
            if not all(type(metadata[name]) is int and metadata[name] >= 0 for name in ("outer_step", "local_step")):
                return "its step counters are not non-negative integers"
            for spec in metadata["inner"]:
                if not (isinstance(spec["scalars"], dict)
                        and all(isinstance(k, str) and type(v) in (int, float) and math.isfinite(v)
                                for k, v in spec["scalars"].items())
                        and all(isinstance(name, str) for name in spec["tensors"])):
                    return "the inner optimizer's state is malformed"
            if not all(type(lr) in (int, float) and math.isfinite(lr) and lr >= 0 for lr in metadata["lrs"]):
                return "its learning rates are not finite non-negative numbers"
            if _digest_of(tensors[:n]) != metadata["digest"]:
                return "its global parameters do not match the digest the donors announced"
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            return f"malformed metadata ({e!r})"
        return ""

    # ------------------------------------------------------------------------------------------- housekeeping

    def _update_throughput(self) -> None:
        now = time.monotonic()
        elapsed = now - self._throughput_since
        if elapsed > 0 and self._throughput_samples:
            self.samples_per_s = self._throughput_samples / elapsed
        self._throughput_since, self._throughput_samples = now, 0

    def _publish_progress(self, force: bool = False) -> None:
        if force or self.progress.due():
            if not force:
                self._update_throughput()
            self.progress.publish(
                outer_step=self.outer_step,
                local_step=self.local_step,
                samples_per_s=self.samples_per_s,
                samples_since_sync=self.samples_since_sync,
            )

    def _tag(self) -> str:
        return f"[{self.dht.peer_id.to_base58()[-8:]} outer_step={self.outer_step}]"

    def interrupt(self) -> None:
        """Stop waiting for peers: a sync in progress ends after its current attempt (applying this peer's own
        pseudo-gradient if that attempt fails). Safe to call from a signal handler or another thread."""
        self._interrupted.set()

    def close(self) -> None:
        """Stop the averager process. The DHT belongs to the caller and stays up. Safe to call twice."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.interrupt()
        # a sync in flight stops retrying once interrupted; let its current attempt finish (bounded)
        attempt_s = self.matchmaking_time_s + self._request_timeout_s + self.averaging_timeout_s + 15.0
        acquired = self._sync_lock.acquire(timeout=attempt_s)
        try:
            self._wait_for_last_group(LEAVE_WAIT_S)
            self.progress.withdraw()
            if self.averager.is_alive():
                self.averager.shutdown()
        finally:
            if acquired:
                self._sync_lock.release()

    shutdown = close

    def _wait_for_last_group(self, timeout_s: float) -> None:
        """Before leaving: wait (bounded) until the other members of our last round have committed it too. Our
        part of that all-reduce may still be on its way to a slower member when we have our own result (a peer that
        ends the run at an absolute outer step leaves at once); stopping the p2p daemon then would cut it off, and
        a member whose round failed could no longer take the state from us."""
        members = self._last_group
        deadline = time.monotonic() + timeout_s
        while members and self.averager.is_alive():
            behind = sorted(r.peer_id[-8:] for r in fetch_progress(self.dht, self.run_id, timeout_s=2.0)
                            if r.peer_id in members and r.outer_step < self.outer_step)
            if not behind:
                return
            if time.monotonic() > deadline:
                logger.warning(f"{self._tag()} leaving although member(s) {behind} of the last round have not "
                               f"committed it after {timeout_s:.0f}s")
                return
            time.sleep(0.2)
