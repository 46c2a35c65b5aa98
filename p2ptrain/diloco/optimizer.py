"""``DiLoCoOptimizer``: the optimizer API (inner steps, syncs, checkpoints), the outer step and the peer's life
(start, progress records, shutdown). It asks its ``Rounds`` (``rounds.py``) for each sync's outcome; the blocking
sync (``sync.py``), the streaming sync (``streaming.py``) and the state transfer (``state.py``) are its mixins."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from typing import Any, Callable, Iterable, List, Optional

import torch
from hivemind import DHT

from p2ptrain.averaging import PseudoGradientAverager
from p2ptrain.averaging.averager import PROTOCOL_VERSION
from p2ptrain.averaging.audit import AUDIT_PARTS
from p2ptrain.averaging.compression import COMPRESSION_CHOICES, ERROR_FEEDBACK_BY_DEFAULT, SPARSE
from p2ptrain.averaging.sparse import DEFAULT_DECAY, DEFAULT_K
from p2ptrain.diloco.membership import Membership
from p2ptrain.clock import PhaseClock
from p2ptrain.diloco.records import NO_GROUP_POLICIES, SyncRecord, Throughput
from p2ptrain.diloco.rounds import Rounds, RoundSettings
from p2ptrain.diloco.state import StateSharingMixin, _SnapshotRequest
from p2ptrain.diloco.streaming import StreamingMixin
from p2ptrain.diloco.sync import BlockingSyncMixin
from p2ptrain.fragments import DEFAULT_MERGE_ALPHA, FragmentPlan
from p2ptrain.pace import Pace
from p2ptrain.schedules import Schedule, scale_lrs
from p2ptrain.swarm.progress import FORCED_STORE_WAIT_S, ProgressPublisher

logger = logging.getLogger(__package__)  # one logger name for the whole optimizer, as users grep for it

class DiLoCoOptimizer(BlockingSyncMixin, StreamingMixin, StateSharingMixin, torch.optim.Optimizer):
    """A drop-in ``torch.optim.Optimizer`` that trains with DiLoCo across a hivemind swarm.

    :param params: the model's parameters (or parameter groups), handed to the inner optimizer as they are
    :param dht: a started ``hivemind.DHT``; its peers with the same ``run_id`` average together
    :param run_id: namespaces every DHT key of this training run
    :param local_steps: H, inner steps between syncs
    :param inner_optimizer: a callable that builds the inner optimizer from ``params`` (e.g. ``partial(AdamW, ...)``)
    :param outer_optimizer: a callable that builds the outer optimizer from the fp32 global parameters
    :param compression: wire format of pseudo-gradients: "none" (fp32), "fp16", "bf16" (2 bytes per value) or
      "int8" (1 byte per value plus an fp32 scale per 1024 values); see ``p2ptrain/averaging/compression.py``
    :param aggregation: how each reducer combines its group's parts: "mean" (weighted by samples), "clip" (centered
      clipping) or "trim" (coordinate-wise trimmed mean); see ``p2ptrain/averaging/robust.py``. Not with "sparse"
    :param audit_parts: parts of other reducers' ranges to recompute from their inputs after each round (0: none);
      see ``p2ptrain/averaging/audit.py``
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
    :param target_group_size: at most this many peers per group (None: no limit); a full group starts at once.
      Below the swarm's size, groups change every round (``p2ptrain/mixing.py``), and a group whose members hold
      different global parameters averages their stepped states (parameters and outer momenta, fp32) instead of
      their pseudo-gradients; needs the outer SGD with Nesterov or no momentum (else its groups repair as before)
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
    :param inner_lr_schedule: ``local_step -> factor`` of each inner param group's base learning rate (see
      ``p2ptrain/schedules.py``), applied before every inner step; None: the inner optimizer's LRs are left alone
    :param outer_lr_schedule: ``outer_step -> factor`` of the outer optimizer's base learning rate, applied before
      every outer step; None: left alone
    :param fragments: streaming sync (``p2ptrain/fragments.py``): cut the parameters into this many runs of
      consecutive tensors of about equal size, each averaged at its own inner step of the phase, in the background
    :param overlap_steps: streaming sync: inner steps that go on while a fragment's round runs before its average is
      applied (tau); at most ``local_steps // fragments - 1``. ``fragments=1, overlap_steps=0``: the blocking sync
    :param merge_alpha: streaming sync with overlap: the share of the model's own values of a fragment kept when its
      average is applied (``local = alpha * local + (1 - alpha) * global``)
    :param max_extra_steps: streaming sync: inner steps per phase a peer may take beyond the schedule while a
      fragment's round it must apply is still running (another member launched it later), instead of idling; they do
      not move ``local_step``. None: ``local_steps // 2``; 0: wait
    :param adaptive_steps: a peer persistently slower than the fastest live peer (its inner step takes 1.15x or
      more) takes fewer inner steps per phase, H over that ratio, spreading the phase's local steps over them
      (``p2ptrain/pace.py``), so it reaches each sync with the others; its pseudo-gradient weighs the samples it
      trained on. Needs the swarm watched (``catch_up_mid_phase``)

    Learning-rate schedules: the base LR of a param group is its ``lr`` when the schedule first sees it, kept as
    ``group["initial_lr"]`` (as torch's LR schedulers do, so it is in checkpoints too). A schedule's LR is a pure
    function of ``local_step`` or ``outer_step``, which checkpoints (``state_dict``) and the state newcomers download
    carry, so a resumed peer or a newcomer continues the swarm's schedule exactly; it is applied again right after
    either kind of load, so ``param_groups[i]["lr"]`` is always the one the next step will use. Use these instead
    of a ``torch.optim.lr_scheduler`` on this optimizer: such a scheduler counts its own steps, which a newcomer
    does not take with the state.
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
        inner_lr_schedule: Optional[Schedule] = None,
        outer_lr_schedule: Optional[Schedule] = None,
        fragments: int = 1,
        overlap_steps: int = 0,
        merge_alpha: float = DEFAULT_MERGE_ALPHA,
        max_extra_steps: Optional[int] = None,
        adaptive_steps: bool = True,
        sparse_k: int = DEFAULT_K,
        sparse_decay: float = DEFAULT_DECAY,
        aggregation: str = "mean",
        audit_parts: int = AUDIT_PARTS,
    ):
        _check_arguments(local_steps=local_steps, no_group_policy=no_group_policy,
                         matchmaking_time_s=matchmaking_time_s, averaging_timeout_s=averaging_timeout_s,
                         late_peer_wait_s=late_peer_wait_s, min_group_size=min_group_size, compression=compression)
        if compression == SPARSE and target_group_size is not None:
            raise ValueError("compression 'sparse' averages the whole swarm in one group: no target_group_size")

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
        self.plan = FragmentPlan.build([g.numel() for g in self.global_params], local_steps, fragments,
                                       overlap_steps, merge_alpha)
        self.mixing = _mixes_groups(target_group_size, self.plan.streaming, self.outer_optimizer)
        """groups of at most target_group_size: when a group's members start from different global parameters
        (they averaged in different groups last round), it averages their stepped states (p2ptrain/mixing.py)"""
        self.max_extra_steps = local_steps // 2 if max_extra_steps is None else max_extra_steps
        self.inner_lr_schedule, self.outer_lr_schedule = inner_lr_schedule, outer_lr_schedule

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
        self._apply_lr_schedules()  # records the base LRs before anything else can change them
        self._committed_local_step = 0  # local step at which the last outer step was taken
        self._donor_in_round = False  # the last downloaded state came from peers in the middle of a round
        self._donor_in_flight = None  # ... of a fragment's round (streaming sync): [fragment, launch step]
        self.samples_since_sync = 0
        self._steps_since_sync = 0  # inner steps in this peer's pseudo-gradient (the norm check's scale)
        self.history: List[SyncRecord] = []
        self.blocked_s = 0.0
        """seconds ``step()`` spent on anything but the inner step (syncs, catching up, serving a snapshot): what a
        training loop subtracts to count compute time"""
        self._clock = PhaseClock()  # the sync in progress's phases (SyncRecord.phases)
        self._last_group: set = set()  # the other members of our last round that averaged (base58 ids)
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
            sparse_k=sparse_k,
            aggregation=aggregation,
            audit_parts=audit_parts,
            fragments=self.plan.tensors,
            # mixing groups: this peer's stepped global parameters and outer momenta (sync._fill_stepped_state)
            state_tensors=[torch.zeros_like(g) for _ in range(2) for g in self.global_params] if self.mixing else (),
        )
        self.error_feedback = compression in ERROR_FEEDBACK_BY_DEFAULT if error_feedback is None else error_feedback
        # error feedback: what the wire dropped of this peer's last averaged pseudo-gradient, to be sent next time.
        # Not part of the shared state: each peer's own, and dropped whenever its rounding no longer applies
        self._residuals: Optional[List[torch.Tensor]] = None
        if self.error_feedback and not self.averager.codec.lossless:
            self._residuals = [torch.zeros_like(g) for g in self.global_params]
        # compression "sparse": this peer's error-feedback accumulator (SparseLoCo), its own: never in a state a
        # newcomer downloads (a newcomer starts from zeros), kept in checkpoints
        self.sparse_decay = sparse_decay
        self.sparse_message_bytes = 0
        """the length of this peer's last sparse message (its places' code makes each one's its own)"""
        self._accumulator: Optional[List[torch.Tensor]] = \
            [torch.zeros_like(g) for g in self.global_params] if compression == SPARSE else None
        self._digest = self._global_digest()
        self.averager.state_provider = self._shareable_state
        self.averager.set_host_outer_step(0)
        self._staging: Optional[torch.Tensor] = None  # shared-memory buffer the state is copied into for donors
        self._snapshot_request: Optional[_SnapshotRequest] = None
        self.last_donor_pause_s: Optional[float] = None
        """how long serving the last snapshot to newcomers held up this peer's training (the state lock)"""
        self.last_download: Optional[dict] = None
        """how the last state download went: seconds, bytes, chunks per donor, donors that failed"""
        self.states_taken, self.state_bytes_taken = 0, 0
        """state downloads this peer completed, and their bytes (metrics)"""
        self.throughput = Throughput()
        self.catch_up_mid_phase = catch_up_mid_phase
        self._no_donor_at_outer_step = -1  # a mid-phase catch-up found no donor at this outer step: wait for the sync
        self._init_streaming()
        self.pace = Pace(local_steps, enabled=adaptive_steps)
        self._last_step_end: Optional[float] = None
        self.membership = Membership(dht, run_id, self.averager, progress, progress_period_s=progress_period_s,
                                     settings=self.run_settings(), watch_swarm=catch_up_mid_phase,
                                     averager_start_timeout_s=averager_start_timeout_s,
                                     publish_first=lambda: self._publish_progress(force=True), tag=self._tag)
        self.progress = self.membership.progress
        self.progress.excluded = lambda: self.averager.banned_peers  # a caught insider's records stop counting
        self.rounds = Rounds(self.averager, dht, run_id, self.progress, RoundSettings(
            no_group_policy=no_group_policy, matchmaking_time_s=matchmaking_time_s,
            averaging_timeout_s=averaging_timeout_s, late_peer_wait_s=late_peer_wait_s, min_group_size=min_group_size,
            target_group_size=target_group_size, request_timeout_s=self._request_timeout_s, mixing=self.mixing,
        ), self._interrupted, self._tag)

    # ------------------------------------------------------------------------------------------------ its life

    def start(self) -> "DiLoCoOptimizer":
        """Join the run: check this peer's settings against the live peers', start the averager process, publish
        this peer's progress record and keep it fresh. Returns ``self``; a second call does nothing. If it fails,
        whatever it had started is stopped again (``shutdown()`` stays safe to call)."""
        self.membership.join()
        return self

    def __enter__(self) -> "DiLoCoOptimizer":
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    def _require_started(self) -> None:
        if not self.membership.started:
            raise RuntimeError("DiLoCoOptimizer.start() was not called: call it (or use `with DiLoCoOptimizer(...) "
                               "as opt:`) before the first step()")

    # ------------------------------------------------------------------------------------------ the optimizer API

    def step(self, closure: Optional[Callable[[], float]] = None, batch_size: Optional[int] = None):
        """One inner step; every ``local_steps`` inner steps, also a sync. Returns what the closure returned."""
        self._require_started()
        samples = batch_size if batch_size is not None else (self.batch_size or 1)
        # streaming: an extra inner step while a round late at its apply step runs (it does not move local_step)
        extra = self.plan.streaming and self._finish_overdue()
        with self._state_lock:
            self._apply_lr_schedules()  # local_step may have jumped since the last step (a catch-up)
            loss = self.inner_optimizer.step(closure)
            stepped = time.perf_counter()
            if self._last_step_end is not None:  # this inner step's time: forward, backward, data, the update
                self.pace.record_step(stepped - self._last_step_end)
            if extra:
                advance = 0
                self._count_step(samples, real=True)
            else:
                advance = self.pace.advance(self.local_step)
                self.local_step += 1
                if self.plan.streaming:  # a fragment's round starts here, under the lock: a donor sees it all or none
                    self._launch_due(samples, real=True)
        self.samples_since_sync += samples
        self._steps_since_sync += 1
        self.throughput.samples += samples
        for _ in range(advance - 1):  # a slow peer's stride: its local step keeps up with the swarm's (pace.py)
            if self.plan.streaming:
                self._streaming_after_step()
            with self._state_lock:
                self.local_step += 1
                if self.plan.streaming:
                    self._launch_due(0, real=False)
        self._serve_snapshot_request()  # a donor snapshot asked for since the last step: copy it now, on this core
        if self.plan.streaming:
            self._streaming_after_step(may_defer=True)
        if self.plan.streaming and self._in_flight is not None:
            self._publish_progress()
        elif not self.plan.streaming and self.local_step % self.local_steps == 0:
            self.sync()
        elif (self.catch_up_mid_phase and self.progress.swarm_outer_step > self.outer_step + self.mixing
              and self._no_donor_at_outer_step != self.outer_step):
            # (mixing groups finish a round at their own pace: another group one step ahead is no news)
            self._catch_up_mid_phase()
        else:
            self._publish_progress()
        self._last_step_end = time.perf_counter()
        self.blocked_s += self._last_step_end - stepped
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        self.flush()  # a fragment round in flight ends first: the state holds no half-done round
        # the error-feedback residual is left out on purpose: a resumed peer starts without one (at most one
        # rounding step of its last pseudo-gradient is lost), and a checkpoint stays the same across codecs
        return {
            "inner": self.inner_optimizer.state_dict(),
            "outer": self.outer_optimizer.state_dict(),
            "global_params": [g.detach().clone() for g in self.global_params],
            "local_step": self.local_step,
            "outer_step": self.outer_step,
            "samples_since_sync": self.samples_since_sync,
            **({"sparse_accumulator": [e.clone() for e in self._accumulator]} if self._accumulator is not None else {}),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        if state_dict["inner"] is not None:  # None: the caller restores the inner optimizer itself (sharded peers)
            self.inner_optimizer.load_state_dict(state_dict["inner"])
        # torch's load_state_dict replaces the inner optimizer's param_groups and state with new objects (here, or
        # the caller's load of a sharded checkpoint): share them again
        self.param_groups = self.inner_optimizer.param_groups
        self.state = self.inner_optimizer.state
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
        if self._accumulator is not None:  # a checkpoint of another codec has none: start from zeros
            saved = state_dict.get("sparse_accumulator") or [torch.zeros_like(e) for e in self._accumulator]
            with torch.no_grad():
                for e, value in zip(self._accumulator, saved, strict=True):
                    e.copy_(value)
        self._reset_fragment_counters()
        self._apply_lr_schedules()

    def load_state_from_peers(self, timeout_s: float = 120.0) -> bool:
        """``StateSharingMixin.load_state_from_peers``, then this peer's schedules at the counters it took (the
        donor's LRs came with them, but the schedules are this peer's to apply)."""
        loaded = super().load_state_from_peers(timeout_s)
        if loaded:
            with self._state_lock:
                self._apply_lr_schedules()
        return loaded

    def _apply_lr_schedules(self) -> None:
        """Set the inner and outer LRs for the current ``local_step`` and ``outer_step`` (the next steps')."""
        if self.inner_lr_schedule is not None:
            scale_lrs(self.inner_optimizer.param_groups, self.inner_lr_schedule(self.local_step))
        if self.outer_lr_schedule is not None:
            scale_lrs(self.outer_optimizer.param_groups, self.outer_lr_schedule(self.outer_step))

    def swarm_outer_step(self) -> int:
        """The highest outer step among the run's other live peers (from their progress records), or -1."""
        return self.rounds.swarm_outer_step()

    def run_settings(self) -> dict:
        """What every peer of the run must agree on (swarm/progress.SETTINGS), as this peer has it."""
        schema = hashlib.sha256(repr([(tuple(g.shape), str(g.dtype)) for g in self.global_params]).encode())
        return dict(params_schema=schema.hexdigest()[:16], num_parameters=sum(g.numel() for g in self.global_params),
                    num_tensors=len(self.global_params), local_steps=self.local_steps,
                    # sparse: peers of another k cannot read our messages (it is in the averager's schema too)
                    compression=self.averager.compression_name + (
                        f" k={self.averager.sparse_layout.k}" if self.averager.sparse_layout else ""),
                    protocol=PROTOCOL_VERSION,
                    sync_schedule=self.plan.describe())

    # ------------------------------------------------------------------------------------------- housekeeping

    @property
    def samples_per_s(self) -> float:
        """Inner-step samples per second over the last stretch between two syncs (or progress refreshes)."""
        return self.throughput.per_s

    def _publish_progress(self, force: bool = False, wait: bool = True):
        """A periodic refresh in the background; a forced one (our first record, a sync point, a commit) is waited
        for, at most ``FORCED_STORE_WAIT_S``, unless ``wait`` is False (the caller waits on the returned future when
        it must, ``wait_until_stored``): a peer reading the records a moment later must see it (a fast peer read
        before a slow one's record was stored, found itself alone and stepped alone, in CI)."""
        if force or self.progress.due():
            if not force:
                self.throughput.update()
            return self.progress.publish(
                outer_step=self.outer_step,
                local_step=self.local_step,
                samples_per_s=self.samples_per_s,
                samples_since_sync=self.samples_since_sync,
                wait_s=FORCED_STORE_WAIT_S if force and wait else 0.0,
                step_s=self.pace.step_s or 0.0,
            )
        return None

    def _tag(self) -> str:
        return f"[{self.dht.peer_id.to_base58()[-8:]} outer_step={self.outer_step}]"

    def interrupt(self) -> None:
        """Stop waiting for peers: a sync in progress ends with its current attempt, whose matchmaking stops at
        once (an all-reduce that began runs to its end; applying this peer's own pseudo-gradient if it fails). Safe to call from a signal handler or another thread."""
        self._interrupted.set()

    def shutdown(self) -> None:
        """Leave the run: stop looking for peers, let the last round's members commit it (bounded), withdraw this
        peer's progress record and stop the averager process. The DHT belongs to the caller and stays up. Safe to
        call twice, before ``start()`` and after a failed one."""
        # a sync in flight stops retrying once interrupted; its current attempt may finish (bounded)
        if getattr(self, "_in_flight", None) is not None and self.membership.started:
            self.interrupt()
            self.flush()  # a fragment round in flight: applied if its group averaged, else abandoned
        attempt_s = self.matchmaking_time_s + self._request_timeout_s + self.averaging_timeout_s + 15.0
        self.membership.leave(self.interrupt, self._sync_lock, attempt_s,
                              last_round=lambda: (self._last_group, self.outer_step))

    close = shutdown


def _check_arguments(*, local_steps: int, no_group_policy: str, matchmaking_time_s: float, averaging_timeout_s: float,
                     late_peer_wait_s: Optional[float], min_group_size: int, compression: str) -> None:
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
    if compression not in COMPRESSION_CHOICES:
        raise ValueError(f"unknown compression {compression!r}; use one of: {', '.join(COMPRESSION_CHOICES)}")


def _mixes_groups(target_group_size: Optional[int], streaming: bool, outer_optimizer: torch.optim.Optimizer) -> bool:
    """Whether this peer keeps the stepped-state buffers of mixing groups: it caps its groups (below the swarm's size
    several groups form each round), syncs all parameters at once (a fragment's round has no such path yet), and its
    outer optimizer is SGD with plain or Nesterov momentum and no weight decay or dampening, whose step is linear in
    (parameters, momentum, pseudo-gradient) (``outer.stepped_state_``)."""
    if target_group_size is None or streaming or type(outer_optimizer) is not torch.optim.SGD:
        return False
    group = outer_optimizer.param_groups[0]
    return (len(outer_optimizer.param_groups) == 1 and group["weight_decay"] == 0 and group["dampening"] == 0
            and (group["nesterov"] or group["momentum"] == 0) and not group.get("maximize", False))
