"""Chunked state transfer from several donors at once, resumable when a donor fails part way.

hivemind's ``rpc_download_state`` streams the whole state from one donor: when many peers join at once that
donor is the choke point, and a donor that dies at 90% means starting over. Here the state is one flat float32
vector cut into fixed-size chunks:

* **donor** (averager process, ``state_donor.py``): ``rpc_state_info`` takes a snapshot of the host's state (one
  copy, made by the host's training thread) unless it has one of the current outer step younger than
  ``SNAPSHOT_REFRESH_S``, and describes it: outer step, digest of the global parameters, size, metadata.
  ``rpc_state_chunk`` answers chunk *i* of the current snapshot if it has the outer step and digest asked for. A
  snapshot stays while newcomers fetch it, even if the donor's training moves on to the next outer step meanwhile,
  until ``SNAPSHOT_IDLE_S`` pass without requests. When a newcomer asks for the newer state, the older snapshot is
  kept beside the new one for the newcomers still fetching it, until ``PREVIOUS_SNAPSHOT_IDLE_S`` without requests,
  where the host has room for that copy; up to ``OLDER_SNAPSHOTS_KEPT`` older steps are kept so, as a crowd's
  download may span two rounds.
* **newcomer** (averager process, ``StateDownload``): asks every declared donor for its ``StateInfo``, keeps the
  donors at the highest outer step whose digest is the most common there (asking again for up to ``QUORUM_WAIT_S``
  while only one of several holds that step: the rest are likely committing it), and runs one fetcher per donor over
  a shared queue of missing chunks. A chunk that fails goes back into the queue and its donor is dropped, so the
  transfer resumes with the others from where it was; if every donor failed, the donors are asked again (new ones
  may have come) until the deadline. Chunks already received are never fetched twice.

Global parameters and outer momentum are the same bits on every donor at one outer step (the digest makes sure).
The inner optimizer's moments are each donor's own; chunks of them may come from different donors, which gives
each parameter element the moments of one of the swarm's peers at the same outer step.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Awaitable, Callable, Dict, List, Optional

import numpy as np
import torch
from hivemind.p2p import PeerID
from hivemind.utils import MPFuture, get_logger
from hivemind.utils.timed_storage import ValueWithExpiration

from p2ptrain.averaging.context import AveragerContext
from p2ptrain.proto import p2ptrain_pb2

logger = get_logger(__name__)

CHUNK_VALUES = 256 * 1024
"""float32 values per chunk: 1 MiB, well inside libp2p's 2 MiB limit for one unary message"""
MAX_STATE_VALUES_PER_PARAMETER = 8
"""a state (global parameters, outer momentum, inner optimizer tensors) announced larger than this many values per
averaged parameter is refused before anything is allocated for it"""
SNAPSHOT_IDLE_S = 60.0
"""a donor drops its snapshot after this long without a request for it"""
PREVIOUS_SNAPSHOT_IDLE_S = 10.0
"""when a newcomer asks for a newer outer step, the snapshot of the older one stays (a second copy of the state)
while other newcomers fetch it, until this long without a request: before, their chunk requests failed and each
dropped this donor (in a 4-newcomer crowd next to 2-second rounds, one newcomer lost 3 of its 4 donors so)"""
OLDER_SNAPSHOTS_KEPT = 2
"""older steps kept so at most (memory permitting): with one, a newcomer whose download spanned two of the donors'
rounds (a 4-newcomer crowd on 2 cores next to 1.6 s rounds, CI) found both trainers had dropped its step, and took
every chunk from the one newcomer that still held it"""
SNAPSHOT_REFRESH_S = 5.0
"""a newcomer that asks for the state gets a snapshot at most this old: its local step (the phase of its next sync)
and inner state come from it. Chunks keep coming from the current snapshot of the same outer step and digest."""
INFO_TIMEOUT_S = 5.0
"""how long a donor may take to describe its state (it may first wait up to 1 s for its trainer to copy it); a dead
donor that is still declared in the DHT costs a newcomer at most this long"""
CHUNK_TIMEOUT_S = 10.0
"""how long one 1 MiB chunk may take (0.8 Mbit/s); a donor slower than that is dropped, the others go on"""
FETCHES_PER_DONOR = 2
"""chunk requests in flight per donor: enough to hide one round trip"""
QUORUM_WAIT_S = 2.0
"""a newcomer that finds the newest outer step held by one donor alone, while others answered at older steps, asks
again for up to this long before it starts: the others are most likely committing that round a moment later, and a
state served by one donor makes that donor the crowd's choke point (bench --crowd, 2 trainers: 2 of 4 newcomers took
every chunk from one peer; with this, none). Where two or more hold it, it starts at once: waiting for a majority
cost 16 newcomers next to 8 trainers about 2 s each, as the newcomers in their first phase hold the older step"""


@dataclass
class DownloadedState:
    """What a newcomer's averager hands its host: metadata, the flat vector, and how the transfer went."""

    metadata: dict
    flat: torch.Tensor
    outer_step: int
    digest: str
    chunks_by_donor: Dict[str, int]
    failed_donors: List[str]
    seconds: float

    @property
    def num_bytes(self) -> int:
        return self.flat.numel() * 4


def flatten_state(tensors: List[torch.Tensor], out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One float32 CPU vector holding every tensor's values, in order (written into ``out`` if given)."""
    if out is None:
        out = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32)
    if tensors:
        torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors], out=out)
    return out


def unflatten_state(flat: torch.Tensor, shapes: List[List[int]]) -> List[torch.Tensor]:
    """Cut the flat vector back into tensors of the given shapes (a donor's word: checked); raises ValueError if a
    shape is not a list of non-negative integers or the sizes disagree."""
    if not isinstance(shapes, list):
        raise ValueError(f"shapes must be a list, got {type(shapes).__name__}")
    for shape in shapes:
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"a shape must be a list of non-negative integers, got {shape!r}")
    sizes = [math.prod(shape) for shape in shapes]  # Python ints: a product cannot wrap around as np.prod's does
    if sum(sizes) != flat.numel():
        raise ValueError(f"the state has {flat.numel()} values but its shapes need {sum(sizes)}")
    return [part.view(shape) for part, shape in zip(torch.split(flat, sizes), shapes)]


class StateDownload:
    """The newcomer side (averager process): find the declared donors (``group_key_prefix``: matchmaking's key, read
    in the averager process), none that ``read_evidence`` convicts, agree on a state with them and take it in chunks.
    ``total_size``: the averaged values, which bounds the state a donor may announce."""

    def __init__(self, context: AveragerContext, serializer, total_size: int, group_key_prefix: Callable[[], str],
                 read_evidence: Callable[[], Awaitable[None]]) -> None:
        self._context, self._serializer, self._total_size = context, serializer, total_size
        self._group_key_prefix, self._read_evidence = group_key_prefix, read_evidence

    async def run(self, timeout_s: float, future: MPFuture) -> None:
        """Take the state from live donors within ``timeout_s``: ``future`` gets it, or None."""
        try:
            future.set_result(await asyncio.wait_for(self._download(time.monotonic() + timeout_s), timeout_s))
        except Exception as e:
            logger.warning(f"state download failed: {e!r}")
            if not future.done():
                future.set_result(None)

    async def _declared_donors(self) -> List[PeerID]:
        await self._read_evidence()  # a reducer another peer caught is no donor either (evidence.py)
        key = f"{self._group_key_prefix()}.all_averagers"
        found = await self._context.dht.get(key, latest=True, return_future=True)
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        donors = []
        for subkey, entry in entries.items():
            if isinstance(entry, ValueWithExpiration) and isinstance(entry.value, (int, float)):
                try:
                    peer = PeerID(subkey)
                except Exception:
                    continue  # a malformed declaration is not a donor
                # an excluded peer's state is not taken
                if peer != self._context.peer_id and not self._context.is_banned(peer):
                    donors.append(peer)
        random.shuffle(donors)  # simultaneous newcomers start on different donors
        return donors

    async def _ask_info(self, peer: PeerID) -> Optional[p2ptrain_pb2.StateInfo]:
        try:
            stub = self._context.stub(peer)
            admission = self._context.auth.token(self._context.peer_id)
            request = p2ptrain_pb2.StateInfoRequest(admission=admission)
            info = await asyncio.wait_for(stub.rpc_state_info(request), timeout=INFO_TIMEOUT_S)
        except Exception as e:
            logger.debug(f"donor {peer} gave no state info: {e!r}")
            return None
        if not info.available or info.chunk_values != CHUNK_VALUES or info.num_values == 0:
            return None
        # global parameters, outer momentum and the inner optimizer's moments are a few times the parameters; a
        # donor announcing more would make us allocate what it says, so it is no donor
        if info.num_values > MAX_STATE_VALUES_PER_PARAMETER * self._total_size + 65536:
            logger.warning(f"state donor {peer} announced {info.num_values} values for a model of "
                           f"{self._total_size}; skipping it")
            return None
        return info

    async def _download(self, deadline: float) -> Optional[DownloadedState]:
        started = time.monotonic()
        target = None  # (outer_step, digest) being assembled
        flat: Optional[torch.Tensor] = None
        metadata: Optional[dict] = None
        missing: List[int] = []
        chunks_by_donor: Counter = Counter()
        failed: List[str] = []  # donors that failed a chunk of the current target: not asked again for it
        lone: Optional[tuple] = None  # (the newest step, when first seen held by one donor alone)
        while time.monotonic() < deadline:
            donors = await self._declared_donors()
            infos = await asyncio.gather(*(self._ask_info(peer) for peer in donors))
            answers = [(peer, info) for peer, info in zip(donors, infos) if info is not None]
            if not answers:
                if target is None and not donors:
                    return None  # nobody declares a state: there is nothing to wait for
                await asyncio.sleep(1.0)
                continue
            best_step = max(info.outer_step for _, info in answers)
            digests = Counter(info.digest for _, info in answers if info.outer_step == best_step)
            best = (best_step, digests.most_common(1)[0][0])
            chosen = [(peer, info) for peer, info in answers if (info.outer_step, info.digest) == best]
            if target is None and len(chosen) == 1 < len(answers):
                # the wait counts from when this step was first seen held by one donor, not from the download's
                # start: a crowd newcomer that had waited out the window on the step before found a fellow newcomer
                # alone at the next one (it had committed a moment before the trainers) and took every chunk from it
                if lone is None or lone[0] != best:
                    lone = (best, time.monotonic())
                if time.monotonic() - lone[1] < QUORUM_WAIT_S:
                    await asyncio.sleep(0.25)
                    continue
            if best != target:  # first round, or the swarm moved on: start over at the newer state
                target, info = best, chosen[0][1]
                failed.clear()
                metadata = self._serializer.loads(info.metadata)
                flat = torch.empty(info.num_values, dtype=torch.float32)
                missing = list(range(-(-info.num_values // CHUNK_VALUES)))
                chunks_by_donor.clear()
                logger.info(f"downloading the state of outer step {best_step} ({info.num_values * 4 / 2**20:.1f} MiB "
                            f"in {len(missing)} chunks) from {len(chosen)} donor(s)")
            chosen = [(peer, info) for peer, info in chosen if str(peer) not in failed]
            if not chosen:
                await asyncio.sleep(1.0)
                continue
            queue: asyncio.Queue = asyncio.Queue()
            for index in missing:
                queue.put_nowait(index)
            await asyncio.gather(*(
                self._fetch_chunks(peer, target, flat, queue, chunks_by_donor, failed, deadline)
                for peer, _ in chosen for _ in range(FETCHES_PER_DONOR)
            ))
            missing = sorted(queue.get_nowait() for _ in range(queue.qsize()))
            if not missing:
                return DownloadedState(
                    metadata=metadata, flat=flat, outer_step=target[0], digest=target[1],
                    chunks_by_donor={str(peer): n for peer, n in chunks_by_donor.items()},
                    failed_donors=failed, seconds=time.monotonic() - started,
                )
            logger.warning(f"{len(missing)} state chunks still missing after every donor failed; asking again")
        return None

    async def _fetch_chunks(self, peer: PeerID, target: tuple, flat: torch.Tensor, queue: asyncio.Queue,
                            chunks_by_donor: Counter, failed: List[str], deadline: float) -> None:
        """One fetcher: take missing chunk indices from the queue and fetch them from ``peer`` until the queue is
        empty or the donor fails (then the chunk goes back for the other donors' fetchers)."""
        stub = self._context.stub(peer)
        while not queue.empty() and str(peer) not in failed:
            index = queue.get_nowait()
            try:
                timeout_s = max(1.0, min(CHUNK_TIMEOUT_S, deadline - time.monotonic()))
                chunk = await asyncio.wait_for(
                    stub.rpc_state_chunk(p2ptrain_pb2.StateChunkRequest(
                        outer_step=target[0], digest=target[1], index=index,
                        admission=self._context.auth.token(self._context.peer_id))),
                    timeout=timeout_s,
                )
                start = index * CHUNK_VALUES
                expected = min(CHUNK_VALUES, flat.numel() - start)
                if not chunk.available or len(chunk.values) != expected * 4:
                    raise ValueError(f"chunk {index}: {'not available' if not chunk.available else 'wrong size'}")
                flat[start:start + expected].numpy()[:] = np.frombuffer(chunk.values, dtype=np.float32)
                chunks_by_donor[peer] += 1
            except Exception as e:
                queue.put_nowait(index)
                if str(peer) not in failed:
                    failed.append(str(peer))
                    logger.warning(f"state donor {peer} failed ({e!r}); going on with the other donors")
                return
