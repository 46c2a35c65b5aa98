"""``StateSharing``: the swarm's state between peers. A donor's snapshot for newcomers, and a newcomer's (or a peer
left behind) download and check of it; a group whose members started a round from different parameters repairs the
odd ones out with it. Joining the round the donors are in is ``catch_up.py``'s."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Tuple

import torch

from p2ptrain.averaging import RoundResult
from p2ptrain.averaging.state_transfer import flatten_state, unflatten_state
from p2ptrain.diloco.context import PeerState
from p2ptrain.diloco.records import _digest_of, is_digest
from p2ptrain.finite import all_finite

logger = logging.getLogger(__package__)  # one logger name for the whole optimizer, as users grep for it


@dataclass
class _SnapshotRequest:
    """A donor snapshot asked for by the state-serving thread, to be copied by whichever thread comes first."""

    staging: torch.Tensor
    done: threading.Event = field(default_factory=threading.Event)
    metadata: Optional[dict] = None


class StateSharing:
    """Shares ``state`` with newcomers (the donor's side: ``shareable_state`` is the averager's ``state_provider``)
    and takes the swarm's into it (``load_state_from_peers``). ``on_loaded`` runs under the state lock once a
    downloaded state is in (the streaming sync's counters start again)."""

    def __init__(self, state: PeerState, on_loaded: Callable[[], None], *, download_timeout_s: float):
        self.state, self.on_loaded, self.download_timeout_s = state, on_loaded, download_timeout_s
        self._staging: Optional[torch.Tensor] = None  # shared-memory buffer the state is copied into for donors
        self._snapshot_request: Optional[_SnapshotRequest] = None
        self.last_donor_pause_s: Optional[float] = None
        """how long serving the last snapshot to newcomers held up this peer's training (the state lock)"""
        self.last_download: Optional[dict] = None
        """how the last state download went: seconds, bytes, chunks per donor, donors that failed"""
        self.states_taken, self.state_bytes_taken = 0, 0
        """state downloads this peer completed, and their bytes (metrics)"""

    def repair_if_diverged(self, result: RoundResult) -> bool:
        """Compare the digests the group's members started the round from. If they differ (a peer missed part of an
        earlier round, applied a local step, or was corrupted), every member agrees on one reference digest (the most
        common; ties go to the smallest peer id) and the members that did not hold it take the state anew from a peer
        that did. Returns True if this peer repaired itself.

        Only members this peer has not excluded, with a digest of the right form, vote: two key holders whose parts
        this round refused, claiming a made-up digest, had tied the two honest members of a group of four, won the
        tie on their peer ids, and sent both honest peers to take the state anew after a round that was sound (CI:
        the honest peers then ended on other parameters than without the rogues)."""
        me, excluded = self.state.peer_id, set(self.state.averager.banned_peers)
        digests = {peer: info.get("digest") for peer, info in result.gathered.items()
                   if peer == me or (peer not in excluded and is_digest(info.get("digest")))}
        if len(set(digests.values())) <= 1:
            return False
        counts: dict = {}
        for digest in digests.values():
            counts[digest] = counts.get(digest, 0) + 1
        reference = min(digests.items(), key=lambda item: (-counts[item[1]], item[0]))[1]
        mine = digests.get(me)
        logger.error(
            f"{self.state.tag()} the group started this round from {len(counts)} different parameter versions "
            f"({', '.join(f'{d[:8]}x{n}' for d, n in counts.items())}); the reference is {reference[:8]}"
        )
        if mine == reference:
            return False
        # stop serving our state while it is the wrong one, so the download comes from a peer that has the reference
        self.state.averager.allow_state_sharing = False
        try:
            return self.load_state_from_peers(timeout_s=self.download_timeout_s)
        finally:
            if not self.state.averager.client_mode:
                self.state.averager.allow_state_sharing = True

    def shareable_state(self) -> tuple:
        """What a newcomer downloads from this peer (called in this process by hivemind's state-serving thread):
        metadata (counters, shapes, the inner optimizer's layout) and the state as one flat float32 vector (global
        params, outer momentum, inner state tensors) in a shared-memory staging buffer kept between snapshots.

        The copy into the buffer is made by the training thread itself at its next inner step (``step()`` calls
        ``serve_snapshot_request``), so training pauses for one warm memory copy on its own core, never waiting
        for a busier thread; if no step comes within a second (the trainer is in a sync, or idle), this thread
        copies under the state lock. The averager process copies the buffer before it asks for the next one."""
        for _ in range(3):  # the layout can change between the two looks (e.g. the inner optimizer's first step)
            with self.state.state_lock:
                size = sum(t.numel() for t in self.state_layout()[0])
            if self._staging is None or self._staging.numel() != size:
                # allocated and touched outside the lock: the page faults are not the trainer's problem
                self._staging = torch.zeros(size, dtype=torch.float32).share_memory_()
            request = _SnapshotRequest(self._staging)
            self._snapshot_request = request
            if not request.done.wait(timeout=1.0):
                self.serve_snapshot_request()
            self._snapshot_request = None
            if request.metadata is not None:
                return request.metadata, [self._staging], None
        raise RuntimeError("the optimizer's state kept changing shape while a snapshot was taken")

    def serve_snapshot_request(self) -> None:
        """Copy the state into the staging buffer if a donor snapshot was asked for (any thread)."""
        request = self._snapshot_request
        if request is None or request.done.is_set():
            return
        with self.state.state_lock:
            if request.done.is_set():
                return
            started = time.perf_counter()
            tensors, metadata = self.state_layout()
            if sum(t.numel() for t in tensors) == request.staging.numel():
                flatten_state(tensors, out=request.staging)
                request.metadata = metadata
            self.last_donor_pause_s = time.perf_counter() - started
            request.done.set()

    def state_layout(self) -> tuple:
        """The tensors a newcomer needs, in order, and the metadata that describes them. Call under the lock."""
        s = self.state
        tensors = list(s.global_params)
        momentum = [s.outer_optimizer.state.get(g, {}).get("momentum_buffer") for g in s.global_params]
        has_momentum = all(m is not None for m in momentum)
        if has_momentum:
            tensors += momentum
        inner_tensors, inner = inner_state_layout(s.params, s.inner_optimizer)
        tensors += inner_tensors
        metadata = {
            "outer_step": s.outer_step,
            "local_step": s.local_step,
            # at a sync point but not yet past it: this peer is in a round right now
            "in_round": s.local_step % s.local_steps == 0 and s.committed_local_step != s.local_step,
            # streaming sync: the fragment whose round is in flight, and the local step it was launched at; its
            # values here are still the version before that round (a newcomer joins it, with weight 0)
            "in_flight": [s.in_flight.fragment, s.in_flight.local_step] if s.in_flight else None,
            "digest": s.digest,
            "has_momentum": has_momentum,
            "inner": inner,
            "lrs": [group["lr"] for group in s.param_groups],
            "shapes": [list(t.shape) for t in tensors],
        }
        return tensors, metadata

    def load_state_from_peers(self, timeout_s: float = 120.0) -> bool:
        """Take the swarm's state from live peers: global parameters, outer momentum, inner optimizer state, LR and
        step counters; the model's parameters become the global ones. The state comes in chunks from every donor at
        the swarm's latest outer step (``averaging/state_transfer.py``). Returns False (and logs why) if no peer
        gave a usable state; the peer then keeps its own."""
        s = self.state
        started = time.perf_counter()
        try:
            downloaded = s.averager.download_state(timeout_s=timeout_s)
        except Exception as e:
            downloaded = None
            logger.warning(f"{s.tag()} downloading the state from peers failed: {e!r}")
        if downloaded is None:
            logger.warning(f"{s.tag()} no live peer shared its state; keeping this peer's own")
            return False
        metadata = downloaded.metadata
        try:
            tensors = unflatten_state(downloaded.flat, metadata["shapes"])
        except (KeyError, TypeError, ValueError) as e:
            logger.warning(f"{s.tag()} ignoring a downloaded state: malformed layout ({e!r})")
            return False
        problem = check_downloaded_state(self.state, metadata, tensors)
        if problem:
            logger.warning(f"{s.tag()} ignoring a downloaded state: {problem}")
            return False
        with torch.no_grad(), s.state_lock:
            n = len(s.global_params)
            for g, t in zip(s.global_params, tensors[:n]):
                g.copy_(t)
            rest = tensors[n:]
            if metadata["has_momentum"]:
                for g, m in zip(s.global_params, rest[:n]):
                    s.outer_optimizer.state[g]["momentum_buffer"] = m.clone()
                rest = rest[n:]
            load_inner_state(s.params, s.inner_optimizer, metadata["inner"], rest)
            for group, lr in zip(s.param_groups, metadata["lrs"]):
                group["lr"] = lr
            for p, g in zip(s.params, s.global_params):
                p.copy_(g)
            s.outer_step = int(metadata["outer_step"])
            # the donor's local step puts this peer's next sync in phase with the swarm's
            s.local_step = int(metadata["local_step"])
            s.donor_in_round = bool(metadata.get("in_round", False))
            s.donor_in_flight = metadata.get("in_flight")
            s.committed_local_step = -1 if s.donor_in_round else s.local_step
            s.samples_since_sync = 0
            s.steps_since_sync = 0
            self.on_loaded()
            s.digest = s.global_digest()
            s.reset_residuals()  # our rounding residual belongs to a trajectory this peer just left
        s.averager.set_host_outer_step(s.outer_step)
        self.states_taken += 1
        self.state_bytes_taken += downloaded.num_bytes
        self.last_download = {
            "seconds": time.perf_counter() - started,
            "bytes": downloaded.num_bytes,
            "chunks_by_donor": downloaded.chunks_by_donor,
            "failed_donors": downloaded.failed_donors,
        }
        logger.info(
            f"{s.tag()} took the swarm's state (outer step {s.outer_step}, {downloaded.num_bytes / 2**20:.1f} "
            f"MiB) in {self.last_download['seconds']:.2f}s from {len(downloaded.chunks_by_donor)} donor(s)"
            + (f"; resumed past {len(downloaded.failed_donors)} failed donor(s)" if downloaded.failed_donors else "")
        )
        # this peer's schedules at the counters it took (the donor's LRs came with them, but the schedules are
        # this peer's to apply)
        with s.state_lock:
            s.apply_lr_schedules()
        return True


def inner_state_layout(params: List[torch.Tensor], optimizer: torch.optim.Optimizer) -> Tuple[List[torch.Tensor],
                                                                                          List[dict]]:
    """An inner optimizer's state as tensors (each parameter's, by name) and their layout: per parameter, the names
    of its state tensors and its scalars (AdamW's step)."""
    tensors, layout = [], []
    for p in params:
        state = optimizer.state.get(p, {})
        names = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0)
        numbers = (int, float, torch.Tensor)
        scalars = {k: float(v) for k, v in state.items() if k not in names and isinstance(v, numbers)}
        tensors += [state[name] for name in names]
        layout.append({"tensors": names, "scalars": scalars})
    return tensors, layout


def load_inner_state(params: List[torch.Tensor], optimizer: torch.optim.Optimizer, layout: List[dict],
                     tensors: List[torch.Tensor]) -> None:
    """Give ``optimizer`` the state ``inner_state_layout`` described (copies: the tensors may be a buffer's views)."""
    for p, spec in zip(params, layout):
        state = {name: tensors[i].to(p.device, p.dtype, copy=True) for i, name in enumerate(spec["tensors"])}
        tensors = tensors[len(spec["tensors"]):]
        state.update({k: torch.tensor(v, dtype=torch.float32) for k, v in spec["scalars"].items()})
        optimizer.state[p] = state


def check_downloaded_state(host: Any, metadata: Any, tensors: List[torch.Tensor]) -> str:
    """Why a peer's state must not be loaded into ``host`` (its ``global_params``, ``params`` and ``param_groups``:
    a ``PeerState``), or an empty string: it comes from another host, so check it."""
    try:
        n = len(host.global_params)
        inner_counts = [len(spec["tensors"]) for spec in metadata["inner"]]
        expected = n * (2 if metadata["has_momentum"] else 1) + sum(inner_counts)
        if len(metadata["inner"]) != len(host.params) or len(metadata["lrs"]) != len(host.param_groups):
            return "it describes a different set of parameters"
        if len(tensors) != expected:
            return f"{len(tensors)} tensors where {expected} were announced"
        shapes = [g.shape for g in host.global_params] * (2 if metadata["has_momentum"] else 1)
        shapes += [p.shape for p, count in zip(host.params, inner_counts) for _ in range(count)]
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
