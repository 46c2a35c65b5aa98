"""DiLoCo as one drop-in optimizer: an inner optimizer every step, an averaged outer step every ``local_steps``.

One sync (an "outer step"), on every peer:

1. pseudo-gradient = (global parameters at the last sync) - (current parameters), fp32 on CPU
2. average it with the peers that are ready (``PseudoGradientAverager``), each weighted by the samples it trained on
   since the last sync; fp16 on the wire by default, fp32 accumulation; bit-identical result on every peer
3. outer optimizer (SGD + Nesterov) steps on the fp32 global copy, with the average as its gradient
4. the model's parameters become the new global parameters; the inner optimizer's state carries over

Since every peer of a group starts a round with the same global parameters and outer state and receives the same
bits, every peer leaves it with the same bits too: no parameter-averaging round is ever needed on top.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, List, Optional

import torch
from hivemind import DHT
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException

from p2ptrain.averaging import PseudoGradientAverager, RoundResult
from p2ptrain.swarm.progress import ProgressPublisher, fetch_progress

logger = logging.getLogger(__name__)

NO_GROUP_POLICIES = ("apply_local", "wait")
_BEHIND = object()  # _average's answer when the swarm is at a later outer step than this peer


@dataclass
class SyncRecord:
    """The result of one sync, as this peer saw it."""

    outer_step: int
    """the outer step this sync completed (1 for the first sync)"""
    averaged: bool
    """False when no group formed and the peer applied its own pseudo-gradient"""
    group_size: int
    """peers whose pseudo-gradients were averaged, this one included (1 when not averaged)"""
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

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class DiLoCoOptimizer(torch.optim.Optimizer):
    """A drop-in ``torch.optim.Optimizer`` that trains with DiLoCo across a hivemind swarm.

    :param params: the model's parameters (or parameter groups), handed to the inner optimizer as they are
    :param dht: a started ``hivemind.DHT``; its peers with the same ``run_id`` average together
    :param run_id: namespaces every DHT key of this training run
    :param local_steps: H, inner steps between syncs
    :param inner_optimizer: a callable that builds the inner optimizer from ``params`` (e.g. ``partial(AdamW, ...)``)
    :param outer_optimizer: a callable that builds the outer optimizer from the fp32 global parameters
    :param compression: wire format of pseudo-gradients: "none" or "fp16"
    :param matchmaking_time_s: how long a peer looks for others before the round; raise it if peers that are
      plainly alive end up in separate groups (slow links, large swarms)
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
        matchmaking_time_s: float = 5.0,
        averaging_timeout_s: float = 60.0,
        min_group_size: int = 2,
        target_group_size: Optional[int] = None,
        no_group_policy: str = "apply_local",
        batch_size: Optional[int] = None,
        client_mode: Optional[bool] = None,
        averager_start_timeout_s: float = 60.0,
        progress_period_s: float = 5.0,
        progress: Optional[ProgressPublisher] = None,
    ):
        if local_steps < 1:
            raise ValueError(f"local_steps must be at least 1, got {local_steps}")
        if no_group_policy not in NO_GROUP_POLICIES:
            raise ValueError(f"no_group_policy must be one of {NO_GROUP_POLICIES}, got {no_group_policy!r}")
        if matchmaking_time_s <= 0 or averaging_timeout_s <= 0:
            raise ValueError("matchmaking_time_s and averaging_timeout_s must be positive")
        if min_group_size < 1:
            raise ValueError(f"min_group_size must be at least 1, got {min_group_size}")

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
        self.no_group_policy = no_group_policy
        self.batch_size = batch_size
        self.local_step = 0
        self.outer_step = 0
        self.samples_since_sync = 0
        self.history: List[SyncRecord] = []
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
        )
        self._digest = self._global_digest()
        self.averager.state_provider = self._shareable_state
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
        self._throughput_since = time.monotonic()
        self._throughput_samples = 0
        self.samples_per_s = 0.0
        self._publish_progress(force=True)

    # ------------------------------------------------------------------------------------------ the optimizer API

    def step(self, closure: Optional[Callable[[], float]] = None, batch_size: Optional[int] = None):
        """One inner step; every ``local_steps`` inner steps, also a sync. Returns what the closure returned."""
        with self._state_lock:
            loss = self.inner_optimizer.step(closure)
            self.local_step += 1
        samples = batch_size if batch_size is not None else (self.batch_size or 1)
        self.samples_since_sync += samples
        self._throughput_samples += samples
        if self.local_step % self.local_steps == 0:
            self.sync()
        else:
            self._publish_progress()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner_optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {
            "inner": self.inner_optimizer.state_dict(),
            "outer": self.outer_optimizer.state_dict(),
            "global_params": [g.detach().clone() for g in self.global_params],
            "local_step": self.local_step,
            "outer_step": self.outer_step,
            "samples_since_sync": self.samples_since_sync,
        }

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner_optimizer.load_state_dict(state_dict["inner"])
        self.outer_optimizer.load_state_dict(state_dict["outer"])
        with torch.no_grad():
            for g, saved in zip(self.global_params, state_dict["global_params"], strict=True):
                g.copy_(saved)
        self._digest = self._global_digest()
        self.local_step = state_dict["local_step"]
        self.outer_step = state_dict["outer_step"]
        self.samples_since_sync = state_dict["samples_since_sync"]

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
        diverged = False
        with self.averager.get_tensors() as buffers:
            for buffer, g, p in zip(buffers, self.global_params, self.params):
                torch.sub(g, p.detach().to("cpu", torch.float32), out=buffer)
            if not all(torch.isfinite(buffer).all() for buffer in buffers):
                # local training diverged: contribute nothing (weight 0, zeros) but still take the group's average,
                # which puts this peer back on the shared parameters; the group is not kept waiting for us
                diverged = True
                for buffer in buffers:
                    buffer.zero_()
                logger.error(
                    f"{self._tag()} the pseudo-gradient has NaN/inf values (local training diverged); "
                    "discarding this peer's local progress since the last sync; lower inner_lr if this repeats"
                )

        result, attempts = self._average(weight=0.0 if diverged else float(max(self.samples_since_sync, 1)))
        if result is _BEHIND:
            logger.warning(
                f"{self._tag()} the swarm has moved past outer step {self.outer_step}; discarding this peer's "
                "stale pseudo-gradient and taking the state from live peers"
            )
            if self.load_state_from_peers(timeout_s=self.averaging_timeout_s):
                return self._record(started, None, attempts, caught_up=True)
            result = None  # nobody could give us the state: fall back to the no-group policy
        with self.averager.get_tensors() as buffers:
            if result is None:  # the buffers still hold our own pseudo-gradient: a failed round never writes them
                logger.warning(
                    f"{self._tag()} no group formed within {self.matchmaking_time_s:.1f}s; "
                    "applying this peer's own pseudo-gradient (no_group_policy=apply_local)"
                )
            with self._state_lock:
                for g, buffer in zip(self.global_params, buffers):
                    g.grad = buffer
                self.outer_optimizer.step()
                for g in self.global_params:
                    g.grad = None
                for p, g in zip(self.params, self.global_params):
                    p.copy_(g)  # to the parameter's own device and dtype
                self.outer_step += 1
        self._digest = self._global_digest()  # outside the averager's lock: hashing needs none of its buffers
        repaired = result is not None and self._repair_if_diverged(result)
        return self._record(started, result, attempts, repaired=repaired)

    def _record(
        self,
        started: float,
        result: Optional[RoundResult],
        attempts: int,
        caught_up: bool = False,
        repaired: bool = False,
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
        )
        self.history.append(record)
        self.samples_since_sync = 0
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

    def _average(self, weight: float) -> tuple[Optional[RoundResult], int]:
        """Run averaging rounds under the no-group policy; None if this peer must go on alone."""
        attempts = 0
        while not self._interrupted.is_set():
            attempts += 1
            if not self.averager.is_alive():
                logger.error(f"{self._tag()} the averager process is gone; this peer can no longer average")
                break
            try:
                # peers only group with peers at the same outer step: a peer that fell behind finds nobody and
                # catches up from live peers instead of averaging a pseudo-gradient computed from stale parameters
                self.averager.set_group_bits(format(self.outer_step % 256, "08b"))
                # the leader waits matchmaking_time_s for followers; allow a request timeout on top
                matchmaking_timeout_s = self.matchmaking_time_s + self._request_timeout_s + 1.0
                control = self.averager.step(
                    weight=weight,
                    # the digest of the global parameters this round starts from: every member must have the same
                    gather={"outer_step": self.outer_step, "samples": self.samples_since_sync,
                            "digest": self._digest},
                    timeout=matchmaking_timeout_s,
                    allow_retries=True,
                    wait=False,
                )
                # bounded even if the averager process dies mid-round: then this raises TimeoutError
                result = control.result(timeout=matchmaking_timeout_s + self.averaging_timeout_s + 10.0)
                if isinstance(result, RoundResult):
                    return result, attempts
            except (AllreduceException, MatchmakingException, TimeoutError, RuntimeError) as e:
                logger.debug(f"{self._tag()} averaging attempt {attempts} failed: {e!r}")
            except Exception as e:  # a network failure is a value: log it, never let it kill training
                logger.warning(f"{self._tag()} averaging attempt {attempts} failed unexpectedly: {e!r}")
            if self.swarm_outer_step() > self.outer_step:
                return _BEHIND, attempts
            if self.no_group_policy == "apply_local":
                break
            logger.warning(
                f"{self._tag()} no group formed (attempt {attempts}); waiting for peers (no_group_policy=wait)"
            )
        return None, attempts

    def _global_digest(self) -> str:
        """A digest of the exact bits of the global parameters: equal on every peer after every committed round."""
        digest = hashlib.blake2b(digest_size=16)
        for g in self.global_params:
            digest.update(g.detach().numpy())
        return digest.hexdigest()

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

    def swarm_outer_step(self) -> int:
        """The highest outer step among the run's other live peers (from their progress records), or -1."""
        me = self.dht.peer_id.to_base58()
        steps = [r.outer_step for r in fetch_progress(self.dht, self.run_id, timeout_s=5.0) if r.peer_id != me]
        return max(steps, default=-1)

    # ------------------------------------------------------------------------------------------ state transfer

    def _shareable_state(self) -> tuple:
        """What a newcomer downloads from this peer (called in this process by hivemind's state-serving thread):
        metadata (counters, which optimizer states follow) and tensors (global params, outer momentum, inner state).
        The copies are taken under the state lock, so the donor pauses for one memory copy, not for the transfer."""
        with self._state_lock:
            tensors = [g.detach().clone() for g in self.global_params]
            momentum = [self.outer_optimizer.state.get(g, {}).get("momentum_buffer") for g in self.global_params]
            has_momentum = all(m is not None for m in momentum)
            if has_momentum:
                tensors += [m.clone() for m in momentum]
            inner = []
            for p in self.params:
                state = self.inner_optimizer.state.get(p, {})
                names = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0)
                numbers = (int, float, torch.Tensor)
                scalars = {k: float(v) for k, v in state.items() if k not in names and isinstance(v, numbers)}
                tensors += [state[name].detach().to("cpu", copy=True) for name in names]
                inner.append({"tensors": names, "scalars": scalars})
            metadata = {
                "outer_step": self.outer_step,
                "local_step": self.local_step,
                "has_momentum": has_momentum,
                "inner": inner,
                "lrs": [group["lr"] for group in self.param_groups],
            }
        return metadata, tensors, None

    def load_state_from_peers(self, timeout_s: float = 120.0) -> bool:
        """Take the swarm's state from a live peer: global parameters, outer momentum, inner optimizer state, LR and
        step counters; the model's parameters become the global ones. Returns False (and logs why) if no peer gave
        a usable state; the peer then keeps its own."""
        started = time.perf_counter()
        try:
            downloaded = self.averager.load_state_from_peers(timeout=timeout_s)
        except Exception as e:
            downloaded = None
            logger.warning(f"{self._tag()} downloading the state from peers failed: {e!r}")
        if downloaded is None:
            logger.warning(f"{self._tag()} no live peer shared its state; keeping this peer's own")
            return False
        metadata, tensors = downloaded
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
                state = {name: rest[i].to(p.device) for i, name in enumerate(spec["tensors"])}
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
            self.samples_since_sync = 0
            self._digest = self._global_digest()
        logger.info(
            f"{self._tag()} took the swarm's state (outer step {self.outer_step}) in "
            f"{time.perf_counter() - started:.2f}s"
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
            if not all(torch.isfinite(t).all() for t in tensors):
                return "it contains NaN or infinite values"
            if int(metadata["outer_step"]) < 0 or int(metadata["local_step"]) < 0:
                return "negative step counters"
        except (KeyError, TypeError, ValueError) as e:
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
            self.progress.withdraw()
            if self.averager.is_alive():
                self.averager.shutdown()
        finally:
            if acquired:
                self._sync_lock.release()

    shutdown = close
