"""``DiLoCoOptimizer``: the optimizer API (inner steps, syncs, checkpoints) and the peer's life (start, shutdown),
as a facade over parts it holds. Each part gets the ``PeerState`` (``context.py``: tensors, counters, locks, the
averager) and the other parts it calls, never the optimizer:

- ``Contribution`` (``pseudo.py``): this peer's pseudo-gradient, error feedback and sparse message into the buffers
- ``Reporter`` (``reporting.py``): progress records, where the peer stands for a round, each sync's record
- ``BlockingSync`` (``sync.py``) / ``StreamingSync`` (``streaming.py``): one round of all parameters, or of each
  fragment on the plan's schedule, through ``Rounds`` (``rounds.py``), and the outer step
- ``StateSharing`` (``state.py``): the donor's snapshot, the download of the swarm's state, the repair
- ``CatchUp`` (``catch_up.py``): a peer left behind takes the state and joins the donors' round
- ``Membership`` (``membership.py``): joining and leaving the run
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Callable, Iterable, Optional

import torch
from hivemind import DHT

from p2ptrain.averaging import PseudoGradientAverager
from p2ptrain.averaging.compression import ERROR_FEEDBACK_BY_DEFAULT, SPARSE
from p2ptrain.averaging.round import PROTOCOL_VERSION
from p2ptrain.config import DiLoCoConfig
from p2ptrain.diloco.catch_up import CatchUp
from p2ptrain.diloco.context import PeerState
from p2ptrain.diloco.membership import Membership
from p2ptrain.diloco.options import DiLoCoOptions, resolve
from p2ptrain.diloco.pseudo import Contribution
from p2ptrain.diloco.records import SyncRecord, Throughput
from p2ptrain.diloco.replay import replay_check_of
from p2ptrain.diloco.reporting import Reporter
from p2ptrain.diloco.round_policy import RoundSettings
from p2ptrain.diloco.rounds import Rounds
from p2ptrain.diloco.state import StateSharing
from p2ptrain.diloco.streaming import StreamingSync
from p2ptrain.diloco.sync import BlockingSync
from p2ptrain.fragments import FragmentPlan
from p2ptrain.outer import mixes_groups
from p2ptrain.pace import Pace
from p2ptrain.swarm.relays import averages_as_client


def _shared(name: str) -> property:
    """An attribute of the optimizer that is the ``PeerState``'s (its parts read and write it there)."""
    return property(lambda self: getattr(self._state, name), lambda self, value: setattr(self._state, name, value))


def _of_sharing(name: str) -> property:
    """A read-only metric of the optimizer's ``StateSharing``."""
    return property(lambda self: getattr(self._sharing, name))


class DiLoCoOptimizer(torch.optim.Optimizer):
    """A drop-in ``torch.optim.Optimizer`` that trains with DiLoCo across a hivemind swarm.

    :param params: the model's parameters (or parameter groups), handed to the inner optimizer as they are
    :param dht: a started ``hivemind.DHT``; its peers with the same ``run_id`` average together
    :param run_id: namespaces every DHT key of this training run
    :param local_steps: H, inner steps between syncs; given, it wins over ``settings.local_steps``
    :param inner_optimizer: a callable that builds the inner optimizer from ``params`` (e.g. ``partial(AdamW, ...)``)
    :param outer_optimizer: a callable that builds the outer optimizer from the fp32 global parameters
    :param settings: the run's settings, which every peer of it must agree on (``p2ptrain.config.DiLoCoConfig``: its
      codec, aggregation, audits, streaming sync, group sizes, matchmaking and averaging timeouts, no-group policy;
      each field's docstring says what it does). Only the fields about the sync are read; the inner and outer
      optimizers and schedules are the caller's. None: the config's defaults with ``local_steps``
    :param options: this peer's own knobs (``DiLoCoOptions``: batch size, error feedback, norm bound, mid-phase
      catch-up, LR schedules, progress publisher and period, client mode, averager start timeout)
    :param legacy_kwargs: the settings and options as keyword arguments of their own, as before ``settings`` and
      ``options`` (deprecated: a ``DeprecationWarning`` names the new spelling); they win over both

    With ``settings.fragments`` 1 and ``overlap_steps`` 0, ``step()`` runs the blocking sync (``sync()``) every
    ``local_steps`` inner steps; otherwise each fragment is averaged at its own step of the phase, in the background.

    Learning-rate schedules: the base LR of a param group is its ``lr`` when the schedule first sees it, kept as
    ``group["initial_lr"]`` (as torch's LR schedulers do, so it is in checkpoints too). A schedule's LR is a pure
    function of ``local_step`` or ``outer_step``, which checkpoints (``state_dict``) and the state newcomers download
    carry, so a resumed peer or a newcomer continues the swarm's schedule exactly; it is applied again right after
    either kind of load, so ``param_groups[i]["lr"]`` is always the one the next step will use. Use these instead
    of a ``torch.optim.lr_scheduler`` on this optimizer: such a scheduler counts its own steps, which a newcomer
    does not take with the state.
    """

    def __init__(self, params: Iterable[Any], *, dht: DHT, run_id: str, local_steps: Optional[int] = None,
                 inner_optimizer: Callable[..., torch.optim.Optimizer],
                 outer_optimizer: Callable[..., torch.optim.Optimizer],
                 settings: Optional[DiLoCoConfig] = None, options: Optional[DiLoCoOptions] = None, **legacy_kwargs):
        settings, options = resolve(local_steps, settings, options, legacy_kwargs)
        self.settings, self.options = settings, options
        self.inner_optimizer = inner_optimizer(params)
        # share the inner optimizer's groups and state: schedulers, grad clipping and zero_grad see the real thing
        super().__init__([p for group in self.inner_optimizer.param_groups for p in group["params"]], {})
        self.param_groups = self.inner_optimizer.param_groups
        self.state = self.inner_optimizer.state
        self.defaults = self.inner_optimizer.defaults

        self.params = [p for group in self.param_groups for p in group["params"]]
        # the global parameters: what every peer agreed on at the last sync, fp32 on CPU
        self.global_params = [
            torch.nn.Parameter(p.detach().to("cpu", torch.float32, copy=True), requires_grad=True)
            for p in self.params
        ]
        self.outer_optimizer = outer_optimizer(self.global_params)
        self.plan = FragmentPlan.build([g.numel() for g in self.global_params], settings.local_steps,
                                       settings.fragments, settings.overlap_steps, settings.merge_alpha)
        self.mixing = mixes_groups(settings.target_group_size, self.plan.streaming, self.outer_optimizer)
        """groups of at most target_group_size: when a group's members start from different global parameters
        (they averaged in different groups last round), it averages their stepped states (p2ptrain/mixing.py)"""
        self.dht, self.run_id = dht, run_id
        self.batch_size = options.batch_size
        self.blocked_s = 0.0
        """seconds ``step()`` spent on anything but the inner step (syncs, catching up, serving a snapshot): what a
        training loop subtracts to count compute time"""
        # matchmaking requests must time out well inside the matchmaking window (hivemind's deadlock breaker)
        self._request_timeout_s = min(3.0, settings.matchmaking_time_s / 2)
        self.averager = self._build_averager(settings, options)
        self.error_feedback = (settings.compression in ERROR_FEEDBACK_BY_DEFAULT if options.error_feedback is None
                               else options.error_feedback)
        state = self._state = PeerState(
            params=self.params, global_params=self.global_params, inner_optimizer=self.inner_optimizer,
            outer_optimizer=self.outer_optimizer, averager=self.averager, plan=self.plan,
            local_steps=settings.local_steps, mixing=self.mixing, peer_id=dht.peer_id.to_base58(), run_id=run_id,
            inner_lr_schedule=options.inner_lr_schedule, outer_lr_schedule=options.outer_lr_schedule,
            residuals=([torch.zeros_like(g) for g in self.global_params]
                       if self.error_feedback and not self.averager.codec.lossless else None),
            accumulator=([torch.zeros_like(g) for g in self.global_params]
                         if settings.compression == SPARSE else None),
            sparse_decay=settings.sparse_decay,
        )
        state.apply_lr_schedules()  # records the base LRs before anything else can change them
        state.digest = state.global_digest()
        self.averager.set_host_outer_step(0)
        self.throughput = Throughput()
        self._replay = replay_check_of(settings, options, state, inner_optimizer, self.averager.serializer)
        self.pace = Pace(settings.local_steps, enabled=settings.adaptive_steps)
        self._last_step_end: Optional[float] = None
        self.membership = Membership(dht, run_id, self.averager, options.progress,
                                     progress_period_s=options.progress_period_s, settings=self.run_settings(),
                                     watch_swarm=options.catch_up_mid_phase,
                                     averager_start_timeout_s=options.averager_start_timeout_s,
                                     publish_first=lambda: self._reporter.publish(force=True), tag=state.tag)
        self.progress = self.membership.progress
        self.progress.excluded = lambda: self.averager.banned_peers  # a caught insider's records stop counting
        self.rounds = Rounds(self.averager, dht, run_id, self.progress, RoundSettings(
            no_group_policy=settings.no_group_policy, matchmaking_time_s=settings.matchmaking_time_s,
            averaging_timeout_s=settings.averaging_timeout_s, late_peer_wait_s=settings.late_peer_wait_s,
            min_group_size=settings.min_group_size, target_group_size=settings.target_group_size,
            request_timeout_s=self._request_timeout_s, mixing=self.mixing,
        ), state.interrupted, state.tag)
        self._build_parts(state, Reporter(state, self.progress, self.pace, self.throughput, self.rounds))

    def _build_averager(self, settings: DiLoCoConfig, options: DiLoCoOptions) -> PseudoGradientAverager:
        # the averager owns these buffers (shared memory with its process); we write pseudo-gradients into them
        return PseudoGradientAverager(
            [torch.zeros_like(g) for g in self.global_params], self.dht, prefix=f"{self.run_id}_diloco",
            compression=settings.compression, min_group_size=settings.min_group_size,
            target_group_size=settings.target_group_size, min_matchmaking_time=settings.matchmaking_time_s,
            request_timeout=self._request_timeout_s, allreduce_timeout=settings.averaging_timeout_s,
            next_chunk_timeout=settings.averaging_timeout_s / 2, shutdown_timeout=5,
            client_mode=averages_as_client(self.dht) if options.client_mode is None else options.client_mode,
            max_norm_ratio=options.max_norm_ratio, sparse_k=settings.sparse_k, aggregation=settings.aggregation,
            audit_parts=settings.audit_parts, fragments=self.plan.tensors, replay=settings.replay_rate > 0,
            # mixing groups: this peer's stepped global parameters and outer momenta (Contribution.fill_stepped_state)
            state_tensors=[torch.zeros_like(g) for _ in range(2) for g in self.global_params] if self.mixing else (),
        )

    def _build_parts(self, state: PeerState, reporter: Reporter) -> None:
        """The parts, each given the state and the parts it calls. The syncs and the catch-up call each other (a
        round may find this peer behind; a catch-up joins the donors' round): the syncs get the catch-up as a
        function, bound once it exists."""
        settings = self.settings
        self._reporter, self._contribution = reporter, Contribution(state)
        self._sharing = StateSharing(state, lambda: self._streaming.reset_counters(),
                                     download_timeout_s=settings.averaging_timeout_s)
        self.averager.state_provider = self._sharing.shareable_state
        catch_up = (lambda started, attempts: self._catching_up.catch_up_and_join(started, attempts))
        judge = self._replay.after_round if self._replay is not None else None  # the replay check (replay.py)
        self._blocking = BlockingSync(state, self._contribution, reporter, self.rounds,
                                      self._sharing.repair_if_diverged, catch_up, judge)
        max_extra_steps = settings.local_steps // 2 if settings.max_extra_steps is None else settings.max_extra_steps
        self._streaming = StreamingSync(state, self._contribution, reporter, self.rounds,
                                        self._sharing.repair_if_diverged, catch_up, max_extra_steps)
        self._catching_up = CatchUp(state, self._sharing, self._contribution, reporter, self.rounds,
                                    self._blocking.apply, self._streaming.join_fragment_in_progress,
                                    download_timeout_s=settings.averaging_timeout_s,
                                    mid_phase=self.options.catch_up_mid_phase)

    # what the parts share, read and written where it lives (tests and the trainer read these)
    local_step, outer_step, samples_since_sync = _shared("local_step"), _shared("outer_step"), \
        _shared("samples_since_sync")
    local_steps, history, sparse_message_bytes, last_outer_step = _shared("local_steps"), _shared("history"), \
        _shared("sparse_message_bytes"), _shared("last_outer_step")
    _digest, _residuals, _accumulator = _shared("digest"), _shared("residuals"), _shared("accumulator")

    # the state transfer's metrics: the last download (seconds, bytes, chunks per donor, failed donors), how long
    # serving the last snapshot held up training, the downloads completed and their bytes
    last_download, last_donor_pause_s = _of_sharing("last_download"), _of_sharing("last_donor_pause_s")
    replay_check = property(lambda self: self._replay)  # the replay check (diloco/replay.py), or None
    states_taken, state_bytes_taken = _of_sharing("states_taken"), _of_sharing("state_bytes_taken")

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
        s = self._state
        streaming = self._streaming if self.plan.streaming else None
        samples = batch_size if batch_size is not None else (self.batch_size or 1)
        # streaming: an extra inner step while a round late at its apply step runs (it does not move local_step)
        extra = streaming is not None and streaming.finish_overdue()
        with s.state_lock:
            s.apply_lr_schedules()  # local_step may have jumped since the last step (a catch-up)
            if self._replay is not None:
                self._replay.before_inner_step()  # a phase's first step claims the phase (replay.py)
            loss = self.inner_optimizer.step(closure)
            stepped = time.perf_counter()
            if self._last_step_end is not None:  # this inner step's time: forward, backward, data, the update
                self.pace.record_step(stepped - self._last_step_end)
            if extra:
                advance = 0
                streaming.count_step(samples, real=True)
            else:
                advance = self.pace.advance(s.local_step)
                s.local_step += 1
                if streaming:  # a fragment's round starts here, under the lock: a donor sees it all or none
                    streaming.launch_due(samples, real=True)
        s.samples_since_sync += samples
        s.steps_since_sync += 1
        self.throughput.samples += samples
        for _ in range(advance - 1):  # a slow peer's stride: its local step keeps up with the swarm's (pace.py)
            if streaming:
                streaming.after_step()
            with s.state_lock:
                s.local_step += 1
                if streaming:
                    streaming.launch_due(0, real=False)
        self._sharing.serve_snapshot_request()  # a donor snapshot asked for since the last step: copy it now
        if streaming:
            streaming.after_step(may_defer=True)
        if streaming and s.in_flight is not None:
            self._reporter.publish()
        elif not streaming and s.local_step % s.local_steps == 0:
            self.sync()
        elif self._catching_up.due():
            self._catching_up.catch_up_mid_phase()
        else:
            self._reporter.publish()
        self._last_step_end = time.perf_counter()
        self.blocked_s += self._last_step_end - stepped
        return loss

    def sync(self) -> SyncRecord:
        """Average pseudo-gradients with the swarm and take one outer step. Never raises for network failures."""
        self._require_started()
        if self.plan.streaming:
            raise RuntimeError("this optimizer syncs its fragments on their own schedule inside step() (fragments > 1 "
                               "or overlap_steps > 0); sync() is the blocking sync of all parameters")
        # close() from another thread waits for this lock: shutting the averager down under a running step()
        # would leave that step waiting for an answer from a process that is gone
        with self._state.sync_lock:
            return self._blocking.sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        self.flush()  # a fragment round in flight ends first: the state holds no half-done round
        # the error-feedback residual is left out on purpose: a resumed peer starts without one (at most one
        # rounding step of its last pseudo-gradient is lost), and a checkpoint stays the same across codecs
        s = self._state
        return {
            "inner": self.inner_optimizer.state_dict(),
            "outer": self.outer_optimizer.state_dict(),
            "global_params": [g.detach().clone() for g in self.global_params],
            "local_step": s.local_step,
            "outer_step": s.outer_step,
            "samples_since_sync": s.samples_since_sync,
            **({"sparse_accumulator": [e.clone() for e in s.accumulator]} if s.accumulator is not None else {}),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        s = self._state
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
        s.digest = s.global_digest()
        s.local_step = state_dict["local_step"]
        s.outer_step = state_dict["outer_step"]
        s.committed_local_step = s.local_step
        self.averager.set_host_outer_step(s.outer_step)
        s.samples_since_sync = state_dict["samples_since_sync"]
        s.steps_since_sync = s.local_step % s.local_steps
        s.reset_residuals()
        if s.accumulator is not None:  # a checkpoint of another codec has none: start from zeros
            saved = state_dict.get("sparse_accumulator") or [torch.zeros_like(e) for e in s.accumulator]
            with torch.no_grad():
                for e, value in zip(s.accumulator, saved, strict=True):
                    e.copy_(value)
        self._streaming.reset_counters()
        s.apply_lr_schedules()

    def load_state_from_peers(self, timeout_s: float = 120.0) -> bool:
        """Take the swarm's state from live peers (``StateSharing.load_state_from_peers``): global parameters, outer
        momentum, inner optimizer state, LRs and step counters, then this peer's schedules at those counters. False
        (logged) if no peer gave a usable state; the peer then keeps its own."""
        return self._sharing.load_state_from_peers(timeout_s)

    def catch_up(self) -> bool:
        """Take the swarm's state from live peers now (e.g. when joining a run in progress); if the donors were in
        the middle of a round, take part in it (with weight 0) so this peer leaves it in step with them. Returns
        False if no peer gave a usable state."""
        return self._catching_up.catch_up()

    def flush(self) -> None:
        """Finish the fragment round in flight, if any (wait for it and apply it), so the optimizer's state holds
        no half-done round: ``state_dict`` and ``shutdown`` call it."""
        self._streaming.flush()

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
        """``Reporter.publish``: this peer's progress record, now (``force``) or when due."""
        return self._reporter.publish(force, wait)

    def _global_digest(self) -> str:
        return self._state.global_digest()

    def interrupt(self) -> None:
        """Stop waiting for peers: a sync in progress ends with its current attempt, whose matchmaking stops at
        once (an all-reduce that began runs to its end; applying this peer's own pseudo-gradient if it fails). Safe
        to call from a signal handler or another thread."""
        self._state.interrupted.set()

    def shutdown(self) -> None:
        """Leave the run: stop looking for peers, let the last round's members commit it (bounded), withdraw this
        peer's progress record and stop the averager process. The DHT belongs to the caller and stays up. Safe to
        call twice, before ``start()`` and after a failed one."""
        # a sync in flight stops retrying once interrupted; its current attempt may finish (bounded)
        state = getattr(self, "_state", None)
        if state is not None and state.in_flight is not None and self.membership.started:
            self.interrupt()
            self.flush()  # a fragment round in flight: applied if its group averaged, else abandoned
        if getattr(self, "_replay", None) is not None:
            self._replay.settle(stop=True)  # the replay in progress ends; the averager must outlive it
        settings = self.settings
        attempt_s = settings.matchmaking_time_s + self._request_timeout_s + settings.averaging_timeout_s + 15.0
        self.membership.leave(self.interrupt, self._state.sync_lock, attempt_s,
                              last_round=lambda: (self._state.last_group, self._state.outer_step))

    close = shutdown

