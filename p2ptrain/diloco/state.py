"""The swarm's state between peers: a donor's snapshot for newcomers, a newcomer's (or a peer left behind) download
and check of it, and joining the round the donors are in (``StateSharingMixin``, part of ``DiLoCoOptimizer``)."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, List, Optional

import torch

from p2ptrain.averaging import RoundResult
from p2ptrain.averaging.state_transfer import flatten_state, unflatten_state
from p2ptrain.diloco.records import Outcome, SyncRecord, _digest_of
from p2ptrain.finite import all_finite

logger = logging.getLogger(__package__)  # one logger name for the whole optimizer, as users grep for it


@dataclass
class _SnapshotRequest:
    """A donor snapshot asked for by the state-serving thread, to be copied by whichever thread comes first."""

    staging: torch.Tensor
    done: threading.Event = field(default_factory=threading.Event)
    metadata: Optional[dict] = None


class StateSharingMixin:
    """The state-transfer methods of ``DiLoCoOptimizer``: they read its tensors, averager and DHT."""

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
            self.throughput.update()
            if self._catch_up_and_join(started, attempts=0) is None:
                self._no_donor_at_outer_step = self.outer_step  # no donor answered: try again at the sync point

    def catch_up(self) -> bool:
        """Take the swarm's state from live peers now (e.g. when joining a run in progress); if the donors were in
        the middle of a round, take part in it (with weight 0) so this peer leaves it in step with them. Returns
        False if no peer gave a usable state."""
        with self._sync_lock:
            return self._catch_up_and_join(time.perf_counter(), attempts=0) is not None

    def _catch_up_and_join(self, started: float, attempts: int) -> Optional[SyncRecord]:
        if not self.load_state_from_peers(timeout_s=self.averaging_timeout_s):
            return None
        if self.plan.streaming and self._donor_in_flight:
            # the donors are in a fragment's round: join it with weight 0, so that this peer applies the same
            # average to that fragment at its apply step (else it would keep the fragment's older version)
            self._join_fragment_in_progress(*self._donor_in_flight)
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
        steps = [r.local_step for r in self.progress.others(5.0) if r.outer_step == self.outer_step]
        next_sync = (self.local_step // self.local_steps + 1) * self.local_steps
        if self.plan.streaming:
            # never skip a fragment's launch step (its round would start without us), nor the apply step of the
            # round it joined (it applies it there, like the donors)
            phase_start = next_sync - self.local_steps
            steps = [phase_start + self.plan.launch_at(f) for f in range(self.plan.fragments)]
            if self._in_flight is not None:
                steps.append(self._apply_step_of(self._in_flight))
            next_sync = min([step for step in steps if step > self.local_step], default=next_sync)
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
        self._fill_stepped_state()  # weight 0 adds nothing, but a mixing group still needs finite values from us
        outcome = self.rounds.run(0.0, self._position(), single_attempt=True)
        if outcome.kind is not Outcome.AVERAGED:
            logger.info(f"{self._tag()} too late to join the swarm's round in progress; syncing at the next one")
            return None
        return self._apply(started, outcome.result, outcome.attempts, caught_up=True)

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
            # streaming sync: the fragment whose round is in flight, and the local step it was launched at; its
            # values here are still the version before that round (a newcomer joins it, with weight 0)
            "in_flight": [self._in_flight.fragment, self._in_flight.local_step] if self._in_flight else None,
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
            self._donor_in_flight = metadata.get("in_flight")
            self._committed_local_step = -1 if self._donor_in_round else self.local_step
            self.samples_since_sync = 0
            self._steps_since_sync = 0
            self._reset_fragment_counters()
            self._digest = self._global_digest()
            self._reset_residuals()  # our rounding residual belongs to a trajectory this peer just left
        self.averager.set_host_outer_step(self.outer_step)
        self.states_taken += 1
        self.state_bytes_taken += downloaded.num_bytes
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
