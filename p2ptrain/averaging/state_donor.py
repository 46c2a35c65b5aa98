"""The donor side of the chunked state transfer (state_transfer.py tells the whole protocol): snapshots of the host's
state, described (``rpc_state_info``) and served in chunks (``rpc_state_chunk``) from the averager process."""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, List, Optional, Set

import psutil
import torch
from hivemind.p2p import PeerID
from hivemind.utils import get_logger

from p2ptrain.averaging.context import AveragerContext
from p2ptrain.averaging.state_transfer import (CHUNK_VALUES, OLDER_SNAPSHOTS_KEPT, PREVIOUS_SNAPSHOT_IDLE_S,
                                               SNAPSHOT_IDLE_S, SNAPSHOT_REFRESH_S)
from p2ptrain.faults import kill_this_peer
from p2ptrain.proto import p2ptrain_pb2

logger = get_logger(__name__)


@dataclass(eq=False)  # compared by identity: a snapshot holds a tensor
class _Snapshot:
    outer_step: int
    digest: str
    metadata: bytes
    flat: torch.Tensor
    taken_at: float = field(default_factory=time.monotonic)
    used_at: float = field(default_factory=time.monotonic)


async def _idle_while(kept, snapshot: _Snapshot, idle_limit_s: float) -> bool:
    """Wait while ``kept()`` holds until ``snapshot`` has had no request for ``idle_limit_s``: True if it went idle
    (the caller drops it), False if it was dropped or replaced before."""
    while kept():
        idle_s = time.monotonic() - snapshot.used_at
        if idle_s >= idle_limit_s:
            return True
        await asyncio.sleep(idle_limit_s - idle_s)
    return False


class StateDonor:
    """The donor side (averager process). The host provides the state through hivemind's ``get_current_state``
    (``state_from_host``; metadata must carry ``outer_step``, ``digest`` and ``shapes``) while ``sharing_allowed``.
    Created in the host before the averager process forks (its shared counters with it)."""

    def __init__(self, context: AveragerContext, serializer, state_from_host: Callable[[], Awaitable[tuple]],
                 sharing_allowed: Callable[[], bool], fault=None, claims=None) -> None:
        self._context, self._serializer = context, serializer
        self._state_from_host, self._sharing_allowed = state_from_host, sharing_allowed
        self._fault = fault  # fault injection (p2ptrain.faults): die after serving that many chunks
        self._snapshot: Optional[_Snapshot] = None
        self._older_snapshots: List[_Snapshot] = []  # older steps that newcomers were fetching, newest last
        self._snapshot_lock: Optional[asyncio.Lock] = None
        self._host_outer_step = mp.Value(ctypes.c_int64, -1)
        self._chunks_served = 0
        # for metrics and the dashboard (host reads): state transfers answered (a newcomer asks each donor for the
        # snapshot's description once) and the bytes of state served
        self._states_served = mp.Value(ctypes.c_int64, 0)
        self._state_bytes_served = mp.Value(ctypes.c_int64, 0)
        self._state_refused: Set[PeerID] = set()
        self._claims = claims  # the replay check's claims (replay_serving.ReplayServing), served with these calls

    @property
    def states_served(self) -> int:
        """State transfers this donor answered (one per newcomer that asked it), and the bytes it served."""
        return int(self._states_served.value)

    @property
    def state_bytes_served(self) -> int:
        return int(self._state_bytes_served.value)

    def set_host_outer_step(self, outer_step: int) -> None:
        """Tell the averager process the host's current outer step: a snapshot of an older one gets replaced."""
        self._host_outer_step.value = outer_step

    def _refuses(self, request, peer: PeerID) -> bool:
        """True (and logged) if the caller may not have our state: no swarm key, or excluded for misbehaving."""
        admitted = self._context.auth.admits(peer, request.admission)
        if admitted and not self._context.is_banned(peer):
            return False
        if peer not in self._state_refused:  # once per peer: a refused peer may ask for every chunk
            self._state_refused.add(peer)
            why = "it is excluded for misbehaving" if admitted else "it does not hold the swarm key"
            logger.warning(f"refused peer {peer} our state: {why}")
        return True

    async def info(self, request: p2ptrain_pb2.StateInfoRequest, caller: PeerID) -> p2ptrain_pb2.StateInfo:
        """``rpc_state_info``: describe our current snapshot (taken now if we have none that is fresh); with
        ``claim_step``, the replay check's claim of that outer step's round instead (shown in client mode too)."""
        if request.claim_step and self._claims is not None and not self._refuses(request, caller):
            return self._claims.info(request.claim_step - 1)
        if request.claim_step or not self._sharing_allowed() or self._refuses(request, caller):
            return p2ptrain_pb2.StateInfo(available=False)
        snapshot = await self._current_snapshot()
        self._states_served.value += 1
        return p2ptrain_pb2.StateInfo(
            available=True,
            outer_step=snapshot.outer_step,
            digest=snapshot.digest,
            num_values=snapshot.flat.numel(),
            chunk_values=CHUNK_VALUES,
            metadata=snapshot.metadata,
        )

    def chunk(self, request: p2ptrain_pb2.StateChunkRequest, caller: PeerID) -> p2ptrain_pb2.StateChunk:
        """``rpc_state_chunk``: chunk ``request.index`` of the snapshot of the outer step and digest asked for."""
        if request.claim_step and self._claims is not None and not self._refuses(request, caller):
            return self._claims.chunk(request.claim_step - 1, request.digest, request.index)
        wanted = (request.outer_step, request.digest)
        snapshot = next((s for s in (self._snapshot, *self._older_snapshots)
                         if s is not None and (s.outer_step, s.digest) == wanted), None)
        if (
            request.claim_step
            or not self._sharing_allowed()
            or self._refuses(request, caller)
            or snapshot is None
            or request.index * CHUNK_VALUES >= snapshot.flat.numel()
        ):
            return p2ptrain_pb2.StateChunk(available=False)
        snapshot.used_at = time.monotonic()
        start = request.index * CHUNK_VALUES
        values = snapshot.flat[start:start + CHUNK_VALUES].numpy().tobytes()
        self._chunks_served += 1
        self._state_bytes_served.value += len(values)
        if self._fault and self._fault.kind == "state" and self._chunks_served > self._fault.count:
            logger.warning(f"fault injection: dying after serving {self._fault.count} state chunks")
            kill_this_peer()
        return p2ptrain_pb2.StateChunk(available=True, values=values)

    async def _current_snapshot(self) -> _Snapshot:
        if self._snapshot_lock is None:
            self._snapshot_lock = asyncio.Lock()
        async with self._snapshot_lock:
            snapshot = self._snapshot
            stale = snapshot is None or snapshot.outer_step != self._host_outer_step.value or \
                time.monotonic() - snapshot.taken_at > SNAPSHOT_REFRESH_S
            if stale:
                metadata, tensors, _ = await self._state_from_host()
                info = self._serializer.loads(metadata)
                # the host sends its state flat, in its staging buffer (diloco/state.py: StateSharing.shareable_state): copy it
                # before anything else, the host reuses that buffer for the next snapshot
                (staging,) = tensors
                flat = await asyncio.get_event_loop().run_in_executor(None, staging.clone)
                del staging, tensors
                snapshot = _Snapshot(int(info["outer_step"]), str(info["digest"]), metadata, flat)
                old = self._snapshot
                if old is not None and (old.outer_step, old.digest) != (snapshot.outer_step, snapshot.digest) \
                        and time.monotonic() - old.used_at < PREVIOUS_SNAPSHOT_IDLE_S \
                        and psutil.virtual_memory().available > 2 * old.flat.numel() * 4:
                    # newcomers are still fetching the older step: keep serving it until they are done, where
                    # the host has room for the copy (memory.py counts one)
                    self._older_snapshots = [*self._older_snapshots, old][-OLDER_SNAPSHOTS_KEPT:]
                    asyncio.create_task(self._drop_older_when_idle(old))
                self._snapshot = snapshot
                asyncio.create_task(self._drop_when_idle(snapshot))
            snapshot.used_at = time.monotonic()
            return snapshot

    async def _drop_when_idle(self, snapshot: _Snapshot) -> None:
        """Drop the current ``snapshot``, while it is still the current one, after ``SNAPSHOT_IDLE_S`` unasked."""
        if await _idle_while(lambda: self._snapshot is snapshot, snapshot, SNAPSHOT_IDLE_S):
            self._snapshot = None

    async def _drop_older_when_idle(self, snapshot: _Snapshot) -> None:
        """Drop an older ``snapshot``, while it is still kept, after ``PREVIOUS_SNAPSHOT_IDLE_S`` unasked."""
        kept = (lambda: any(s is snapshot for s in self._older_snapshots))
        if await _idle_while(kept, snapshot, PREVIOUS_SNAPSHOT_IDLE_S):
            self._older_snapshots = [s for s in self._older_snapshots if s is not snapshot]
