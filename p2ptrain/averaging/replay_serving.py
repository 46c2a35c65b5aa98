"""The averager's side of the replay check (``diloco/replay.py`` tells the whole check): claims kept and served,
claims and sent pseudo-gradients fetched for a verifier.

- **Claims.** At the start of each phase the host hands over its inner optimizer's state then, flat fp32, with its
  layout (``keep_claim``). The averager keeps the last ``CLAIMS_KEPT`` (the round they belong to is verified during
  the next phase, an accused one during the phase after) and serves them with the state transfer's own calls
  (``rpc_state_info`` and ``rpc_state_chunk`` with ``claim_step``, protocol 12): the same admission rule, the same
  1 MiB chunks. A verifier fetches one sender's claim (``fetch_claim``) and checks it against the digest the sender
  gathered in the round's join data.
- **What a sender sent.** After a round, the members' order, every part's place in the flat vector and every
  receipt's commitments are kept for ``ROUNDS_KEPT`` rounds (``record_round``). ``fetch_sent`` asks every reducer for
  the sender's input to each part of its range (``rpc_audit_input``, kept for the reducer audits), checks each
  against the commitment the reducer signed, and decodes them into one flat vector: exactly what went into the
  average, whoever serves it.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import numpy as np
import torch
from blake3 import blake3
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import MPFuture, get_logger

from p2ptrain.averaging.audit import commitment_of
from p2ptrain.averaging.compression import WireCodec
from p2ptrain.averaging.context import AveragerContext
from p2ptrain.averaging.state_transfer import CHUNK_VALUES, MAX_STATE_VALUES_PER_PARAMETER
from p2ptrain.hivemind_compat import send_to_averager_process
from p2ptrain.proto import p2ptrain_pb2

logger = get_logger(__name__)

CLAIMS_KEPT = 3
"""claims a sender serves: the current phase's, the last round's (verified during this phase) and the one before
(an accusation gathered in the last round is verified during this phase)"""
ROUNDS_KEPT = 4
"""rounds whose layout and commitments a member keeps (the reducers keep their inputs ``audit.KEPT_ROUNDS``)"""
FETCH_TIMEOUT_S = 30.0
"""how long a verifier waits for one chunk of a claim, or one input of a sender, before it gives up"""


def claim_digest(flat: torch.Tensor, metadata: bytes) -> str:
    """The digest a sender gathers of its claim (its metadata and flat state), and its verifier checks: BLAKE3."""
    digest = blake3(len(metadata).to_bytes(8, "big") + metadata)
    digest.update(flat.contiguous().numpy().tobytes())
    return digest.hexdigest()


@dataclass
class _Claim:
    digest: str
    metadata: bytes
    flat: torch.Tensor


@dataclass
class _Round:
    reducers: List[PeerID]  # the group's order
    senders: List[PeerID]  # the receipts' order (the reducers and the client-mode members, without aux peers)
    slices: List[List[Tuple[int, int]]]  # (offset, size) of each part of each reducer's range in the flat vector
    commitments: Dict[Tuple[int, int], List[bytes]]  # (reducer index, part index) -> every sender's commitment
    codec: WireCodec
    total: int


class ReplayServing:
    """The averager process's part of the replay check. ``input_for``: ``audit.Audits.input_for``, our kept inputs as
    a reducer (a sender's part of our own range comes from there)."""

    def __init__(self, context: AveragerContext, total_size: int, input_for) -> None:
        self._context, self._total_size, self._input_for = context, total_size, input_for
        self._claims: "OrderedDict[int, _Claim]" = OrderedDict()
        self._rounds: "OrderedDict[bytes, _Round]" = OrderedDict()

    async def run(self, call: str, **kwargs) -> None:
        """A host's request (``ask``), in the averager process."""
        if call in ("fetch_claim", "fetch_sent") and "peer" in kwargs:
            kwargs["peer"] = PeerID.from_base58(kwargs["peer"])
        done = getattr(self, call)(**kwargs)
        if asyncio.iscoroutine(done):
            await done

    def exclude(self, peer: str, reason: str, for_s: float) -> None:
        self._context.ban(PeerID.from_base58(peer), reason, for_s)

    # ------------------------------------------------------------------------------------------ a sender's claims

    def keep_claim(self, outer_step: int, flat: torch.Tensor, metadata: bytes, digest: str) -> None:
        self._claims[outer_step] = _Claim(digest, metadata, flat)
        self._claims.move_to_end(outer_step)
        while len(self._claims) > CLAIMS_KEPT:
            self._claims.popitem(last=False)

    def info(self, outer_step: int) -> p2ptrain_pb2.StateInfo:
        """``rpc_state_info`` with ``claim_step``: the claim of that outer step's round (the caller is admitted)."""
        claim = self._claims.get(outer_step)
        if claim is None:
            return p2ptrain_pb2.StateInfo(available=False)
        return p2ptrain_pb2.StateInfo(available=True, outer_step=outer_step, digest=claim.digest,
                                      num_values=claim.flat.numel(), chunk_values=CHUNK_VALUES,
                                      metadata=claim.metadata)

    def chunk(self, outer_step: int, digest: str, index: int) -> p2ptrain_pb2.StateChunk:
        claim = self._claims.get(outer_step)
        if claim is None or claim.digest != digest or index * CHUNK_VALUES >= claim.flat.numel():
            return p2ptrain_pb2.StateChunk(available=False)
        start = index * CHUNK_VALUES
        return p2ptrain_pb2.StateChunk(available=True, values=claim.flat[start:start + CHUNK_VALUES].numpy().tobytes())

    async def fetch_claim(self, peer: PeerID, outer_step: int, digest: str, future: MPFuture) -> None:
        """A sender's claim of ``outer_step``'s round into ``future``: (metadata bytes, flat) if it matches
        ``digest``; else why not, as a string, and whether the sender refused (True) or gave no answer (False)."""
        try:
            future.set_result(await self._fetch_claim(peer, outer_step, digest))
        except Exception as e:
            if not future.done():
                future.set_result((f"no claim from it: {e!r}", False))

    async def _fetch_claim(self, peer: PeerID, outer_step: int, digest: str):
        stub = self._context.stub(peer)
        admission = self._context.auth.token(self._context.peer_id)
        info = await asyncio.wait_for(stub.rpc_state_info(p2ptrain_pb2.StateInfoRequest(
            admission=admission, claim_step=outer_step + 1)), FETCH_TIMEOUT_S)
        if not info.available:
            return "it does not show the claim it gathered", True
        if info.digest != digest or info.chunk_values != CHUNK_VALUES:
            return f"it shows a claim of digest {info.digest[:12]!r}, not the {digest[:12]!r} it gathered", True
        if info.num_values > MAX_STATE_VALUES_PER_PARAMETER * self._total_size + 65536:
            return f"it shows a claim of {info.num_values} values for a model of {self._total_size}", True
        flat = torch.empty(info.num_values, dtype=torch.float32)
        for index in range(-(-info.num_values // CHUNK_VALUES)):
            chunk = await asyncio.wait_for(stub.rpc_state_chunk(p2ptrain_pb2.StateChunkRequest(
                outer_step=outer_step, digest=digest, index=index, admission=admission,
                claim_step=outer_step + 1)), FETCH_TIMEOUT_S)
            start = index * CHUNK_VALUES
            expected = min(CHUNK_VALUES, info.num_values - start)
            if not chunk.available or len(chunk.values) != expected * 4:
                return f"it stopped showing its claim at chunk {index}", True
            flat[start:start + expected].numpy()[:] = np.frombuffer(chunk.values, dtype=np.float32)
        if claim_digest(flat, info.metadata) != digest:
            return "the claim it showed does not hash to the digest it gathered", True
        return info.metadata, flat

    # ------------------------------------------------------------------------------------ what a sender sent

    def record_round(self, group_id: bytes, reducers: List[PeerID], senders: List[PeerID],
                     slices: List[List[Tuple[int, int]]], commitments: Dict[Tuple[int, int], List[bytes]],
                     codec: WireCodec, total: int) -> None:
        self._rounds[group_id] = _Round(list(reducers), list(senders), slices, commitments, codec, total)
        while len(self._rounds) > ROUNDS_KEPT:
            self._rounds.popitem(last=False)

    async def fetch_sent(self, group_id: bytes, peer: PeerID, future: MPFuture) -> None:
        """What ``peer`` sent in round ``group_id``, decoded into one flat fp32 vector, into ``future``; or why not
        (a string): not a member, a part left out of the average, a reducer that does not show it."""
        try:
            future.set_result(await self._fetch_sent(group_id, peer))
        except Exception as e:
            logger.debug("fetching a sender's parts failed", exc_info=True)
            if not future.done():
                future.set_result(f"its parts could not be fetched: {e!r}")

    async def _fetch_sent(self, group_id: bytes, peer: PeerID):
        record = self._rounds.get(group_id)
        if record is None or peer not in record.senders:
            return "the round is no longer kept, or it was not a sender"
        sender = record.senders.index(peer)
        flat = torch.empty(record.total, dtype=torch.float32)
        started = time.monotonic()

        async def from_reducer(reducer: int) -> str:
            for part, (offset, size) in enumerate(record.slices[reducer]):
                committed = record.commitments.get((reducer, part), [])
                if len(committed) <= sender or not committed[sender]:
                    return f"its part #{part} of reducer #{reducer} is not in the average (or has no receipt)"
                request = p2ptrain_pb2.AuditRequest(group_id=group_id, part_index=part, sender_index=sender)
                if record.reducers[reducer] == self._context.peer_id:
                    reply = self._input_for(request, self._context.peer_id)
                else:
                    reply = await asyncio.wait_for(
                        self._context.stub(record.reducers[reducer]).rpc_audit_input(request), FETCH_TIMEOUT_S)
                data = reply.tensor_part if reply.available else None
                if data is None or commitment_of(data) != committed[sender]:
                    return f"reducer #{reducer} does not show its part #{part} as it signed for it"
                part_values = record.codec.extract(runtime_pb2.Tensor.FromString(data))
                if part_values.numel() != size:
                    return f"its part #{part} of reducer #{reducer} holds {part_values.numel()} values, not {size}"
                flat[offset:offset + size] = part_values.reshape(-1)
            return ""

        problems = await asyncio.gather(*(from_reducer(r) for r in range(len(record.reducers))))
        problem = next((p for p in problems if p), "")
        logger.debug(f"fetched the parts of sender {peer} in {time.monotonic() - started:.2f}s"
                     + (f": {problem}" if problem else ""))
        return problem or flat


def ask(averager, method: str, timeout_s: Optional[float] = None, **kwargs):
    """Host side: have the averager process's ``ReplayServing`` run ``method(**kwargs)`` (peers as base58 ids);
    with ``timeout_s``, wait that long for what it gives its future (None if nothing came)."""
    future = MPFuture() if timeout_s is not None else None
    send_to_averager_process(averager, "_replay", call=method, **kwargs,
                             **({"future": future} if future is not None else {}))
    if future is None:
        return None
    try:
        return future.result(timeout=timeout_s)
    except Exception as e:  # the averager process is gone, or took too long: nothing to judge by
        logger.warning(f"the replay check's {method} got no answer from the averager process: {e!r}")
        return None
