"""Evidence against a reducer, so that one peer's catch excludes it swarm-wide.

A reducer signs every average it answers with its libp2p identity key (``security.PeerSignatureValidator``'s RSA
key: its peer id is the hash of the public key). A sender that refuses a signed average (``ExactAllReduceRunner``'s
checks) stores it, with the signature and the public key, in a DHT record of its own under the run's evidence key
(``proto/p2ptrain.proto``, ``Evidence``). Every averager reads those records now and then (``EVIDENCE_POLL_S``) and
before it takes state, checks each item and excludes the reducer if it is guilty (``judge``).

What is proven, and what is judged:

- **Proven** (anyone can check, nobody can forge): that the reducer sent exactly these bytes as its average of
  that part of that group (the signature), and, from the bytes alone, that they do not decode with the run's codec
  or hold NaN/Inf. An honest reducer never sends either.
- **Judged**: "too large" is not provable. The sender refused the average against its own values over the same
  range, which a third party does not have. A verifier excludes the reducer only if the average's RMS is over
  ``JUDGE_FACTOR`` x ``max_norm_ratio`` x the RMS of the verifier's own last contribution: 10x further than the
  sender's own check, so that an honest reducer of a group whose pseudo-gradients were larger than the verifier's
  is not excluded on its word. A verifier with no contribution yet (a newcomer) judges nothing but the proven kinds.
- **Proven by an audit** (audit.py): the signature also covers the reducer's receipt (the commitments to its
  inputs); an item that carries those inputs, or whose accuser serves them (``rpc_audit_proof``: too large for the
  DHT), convicts the reducer if the aggregate recomputed from them is not the average it signed (a member dropped,
  a part scaled by 1.5).

An accuser cannot frame an honest reducer (it cannot forge the signature, inputs that do not hash to the receipt's
commitments prove nothing, and an honest average passes the judgement), but it can replay a real signed average of
an earlier round, which passes too.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import struct
from contextlib import suppress
from typing import Dict, List, Optional, Sequence

import torch
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time, get_logger

from p2ptrain.averaging.audit import commitment, verdict
from p2ptrain.averaging.compression import WireCodec, WireFormatError, get_compression
from p2ptrain.averaging.context import AveragerContext
from p2ptrain.finite import all_finite
from p2ptrain.proto import p2ptrain_pb2
from p2ptrain.security import _RSA_PADDING, peer_id_of
from p2ptrain.swarm.pipe import RECORD_MAX_BYTES

DOMAIN = b"p2ptrain-average-9"
EVIDENCE_POLL_S = 5.0
"""how often an averager reads the evidence records (and always before it takes state)"""
MAX_ITEMS = 4
"""signed averages an accuser keeps in its record (its most recent)"""
MAX_AVERAGE_BYTES = 1 << 20
"""a signed average (with an audit's inputs) larger than this is not kept as evidence; parts are 512 KiB"""
JUDGE_FACTOR = 10.0
BAN_S = 600.0
PROOF_TIMEOUT_S = 30.0
"""how long a verifier waits for one input of an audit proof that its accuser serves"""
PROOF_TRIES = 3
"""reads of the evidence after which a served proof whose inputs never came is judged without them"""
MAX_SENDERS = 1024
"""the most inputs a verifier fetches for one served proof (a group's senders)"""
"""how long an evidence record lives (the averager's exclusions last as long)"""

logger = get_logger(__name__)


def evidence_key(prefix: str) -> str:
    return f"{prefix}_evidence"


def _signed_bytes(group_id: bytes, part_index: int, receipt: bytes, average: runtime_pb2.Tensor) -> bytes:
    return hashlib.sha256(DOMAIN + group_id + struct.pack(">I", part_index) + hashlib.sha256(receipt).digest()
                          + commitment(average)).digest()


class AverageSigner:
    """Signs a reducer's averages with its identity key (a ``PeerSignatureValidator``'s)."""

    def __init__(self, identity) -> None:
        self._key: rsa.RSAPrivateKey = identity._key
        self.public_der: bytes = identity._public_der

    def sign(self, group_id: bytes, part_index: int, receipt: bytes, average: runtime_pb2.Tensor) -> bytes:
        """What an answer's ``peer_id`` field carries: a serialized ``AnswerSignature`` (the signature, the public
        key, the receipt: about 560 bytes with a 2048-bit key, plus 49 per sender)."""
        signature = self._key.sign(_signed_bytes(group_id, part_index, receipt, average), _RSA_PADDING,
                                   hashes.SHA256())
        return p2ptrain_pb2.AnswerSignature(signature=signature, public_key=self.public_der,
                                            receipt=receipt).SerializeToString()


def verified_receipt(reducer: PeerID, group_id: bytes, part_index: int, field: bytes, average: runtime_pb2.Tensor,
                     keys: Optional[dict] = None) -> Optional[p2ptrain_pb2.Receipt]:
    """The receipt of an answer (its ``peer_id`` field and its average) if ``reducer`` signed both; None if it did
    not, or the answer carries no signature. ``keys``: reducers' public keys checked so far (a cache)."""
    try:
        signed = p2ptrain_pb2.AnswerSignature.FromString(field)
        if not _verify(reducer.to_bytes(), signed.public_key, signed.signature,
                       _signed_bytes(group_id, part_index, signed.receipt, average), keys):
            return None
        return p2ptrain_pb2.Receipt.FromString(signed.receipt)
    except Exception:  # not an AnswerSignature, or a receipt that does not parse: unsigned
        return None


def signed_average(reducer: PeerID, group_id: bytes, part_index: int, message, reason: str,
                   inputs: Sequence[bytes] = (), served: bool = False) -> Optional[bytes]:
    """The serialized ``SignedAverage`` of a reducer's answer (a hivemind ``AveragingData`` whose ``peer_id`` field
    carries ``AverageSigner.sign``'s bytes), with an audit's ``inputs`` (or, ``served``, a note that the accuser
    serves them); None if it carries no signature, or is too large to keep."""
    average = message.tensor_part.SerializeToString()
    if len(average) + sum(map(len, inputs)) > MAX_AVERAGE_BYTES:
        return None
    try:
        signed = p2ptrain_pb2.AnswerSignature.FromString(message.peer_id)
    except Exception:
        return None
    if not signed.signature:
        return None
    return p2ptrain_pb2.SignedAverage(reducer=reducer.to_bytes(), group_id=group_id, part_index=part_index,
                                      average=average, signature=signed.signature, public_key=signed.public_key,
                                      reason=reason[:200], receipt=signed.receipt, inputs=list(inputs),
                                      inputs_served=served).SerializeToString()


def _verify(reducer: bytes, public_key: bytes, signature: bytes, signed: bytes, keys: Optional[dict] = None) -> bool:
    """Whether ``signature`` over ``signed`` is that of ``public_key``, and the key is the reducer's (it hashes to
    its peer id). ``keys``: (reducer, public key) -> the loaded key, for the keys checked already."""
    try:
        key = (keys or {}).get((reducer, public_key))
        if key is None:
            if peer_id_of(public_key).to_bytes() != reducer:
                return False
            key = serialization.load_der_public_key(public_key)
            if not isinstance(key, rsa.RSAPublicKey) or key.key_size > 8192:
                return False
            if keys is not None:
                keys[(reducer, public_key)] = key
        key.verify(signature, signed, _RSA_PADDING, hashes.SHA256())
        return True
    except (InvalidSignature, ValueError, TypeError, UnsupportedAlgorithm):
        return False


def summary(item: bytes) -> p2ptrain_pb2.SignedAverage:
    """What of a whole item (a serialized ``SignedAverage``) goes in the DHT when it is too large: who and what it
    accuses, and its digest; the accuser serves the item itself."""
    whole = p2ptrain_pb2.SignedAverage.FromString(item)
    return p2ptrain_pb2.SignedAverage(reducer=whole.reducer, group_id=whole.group_id, part_index=whole.part_index,
                                      reason=whole.reason, item_digest=hashlib.sha256(item).digest())


def evidence_record(items: Sequence[bytes], max_bytes: int = RECORD_MAX_BYTES) -> bytes:
    """An accuser's serialized ``Evidence`` record of ``items`` (whole ones, oldest first), under ``max_bytes``
    (swarm/pipe.py: why): every item as a summary, then as many whole as fit, the most recent first. The accuser
    serves the items that went in as summaries (``rpc_audit_proof``): a real model's 512 KiB average never goes
    through the DHT."""
    wholes = [p2ptrain_pb2.SignedAverage.FromString(item) for item in items]
    chosen = [summary(item) for item in items]
    used = sum(c.ByteSize() + 8 for c in chosen)  # 8: an item's tag and length, with room to spare
    for index in reversed(range(len(items))):
        extra = wholes[index].ByteSize() - chosen[index].ByteSize()
        if used + extra <= max_bytes:
            chosen[index], used = wholes[index], used + extra
    return p2ptrain_pb2.Evidence(items=chosen).SerializeToString()


def signed_by_reducer(item: p2ptrain_pb2.SignedAverage) -> bool:
    """Whether the reducer the item names signed its average and receipt (its public key hashes to its peer id)."""
    try:
        average = runtime_pb2.Tensor.FromString(item.average)
    except Exception:
        return False  # not the answer it was: answers parse (the sender read it as one)
    return _verify(item.reducer, item.public_key, item.signature,
                   _signed_bytes(item.group_id, item.part_index, item.receipt, average))


def judge(item: p2ptrain_pb2.SignedAverage, codec: WireCodec, max_norm_ratio: Optional[float],
          own_rms: Optional[float]) -> str:
    """Why the signed average convicts its reducer ("" if it does not): it must be the reducer's own, and then
    undecodable, non-finite, or (judged, with ``own_rms``) far too large."""
    if not signed_by_reducer(item):
        return ""
    codec = _codec_of(item.average, codec)
    if item.inputs:
        try:
            receipt = p2ptrain_pb2.Receipt.FromString(item.receipt)
        except Exception:
            return ""  # it signed bytes that are no receipt: nothing to recompute against
        reason = verdict(receipt, list(item.inputs), item.average, codec)
        if reason:
            return reason
    try:
        values = codec.extract(runtime_pb2.Tensor.FromString(item.average))
    except (WireFormatError, Exception):  # any failure to parse a signed answer is the reducer's
        return "it signed an average that does not decode"
    if not all_finite(values):
        return "it signed an average with NaN or infinite values"
    if max_norm_ratio is None or not own_rms or values.numel() == 0:
        return ""
    rms = float(torch.linalg.vector_norm(values.float())) / math.sqrt(values.numel())
    if rms > JUDGE_FACTOR * max_norm_ratio * own_rms:
        return (f"it signed an average of RMS {rms:.4g}, over {JUDGE_FACTOR * max_norm_ratio:g}x this peer's own "
                f"{own_rms:.4g}")
    return ""


def _codec_of(average: bytes, codec: WireCodec) -> WireCodec:
    """The codec to judge a signed average with: the run's, or fp32's for a mixing group's average (mixed rounds
    send their stepped states uncompressed: an fp32 average there does not convict its reducer of not decoding)."""
    exact = get_compression("none")
    try:
        message = runtime_pb2.Tensor.FromString(average)
        if (message.compression, message.dtype) == (exact.compression_type, exact.dtype_tag):
            return exact
    except Exception:
        pass
    return codec


class Evidence:
    """The averager's evidence (averager process): store what we caught, read and judge what others caught. Judged
    with the run's ``codec`` and ``max_norm_ratio``, against ``own_rms_last`` (the averager sets it each round)."""

    def __init__(self, context: AveragerContext, identity, codec: WireCodec, max_norm_ratio: Optional[float]) -> None:
        self._context = context
        self._codec, self._max_norm_ratio = codec, max_norm_ratio
        self.signer = AverageSigner(identity) if identity is not None else None
        self._items: List[bytes] = []  # our most recent signed averages refused (averager process)
        self._seen: set = set()  # digests of the items judged already
        self._task = None
        self.own_rms_last: Optional[float] = None  # RMS of our last contribution to a round: the judge's scale
        self._proofs: Dict[bytes, List[bytes]] = {}  # digest of one of our items -> the audit inputs we serve for it
        self._whole_items: Dict[bytes, bytes] = {}  # digest of one of our items -> the item, served to its readers
        self._proof_tries: Dict[bytes, int] = {}  # digest of another's item -> times its served inputs did not come

    def report_bad_average(self, group_id: bytes, reducer: PeerID, part_index: int, message, reason: str,
                           inputs: Sequence[bytes] = (), serve: Sequence[bytes] = ()) -> None:
        """Store a signed average we refused as evidence: with an audit's ``inputs`` inside, or with ``serve``, the
        inputs we serve to whoever reads it (``rpc_audit_proof``: they are too large for the DHT)."""
        item = signed_average(reducer, group_id, part_index, message, reason, inputs, served=bool(serve))
        if item is None:
            return  # unsigned: nothing another peer could check
        self._items = [*self._items, item][-MAX_ITEMS:]
        if serve:
            self._proofs[hashlib.sha256(item).digest()] = list(serve)
        self._whole_items = {hashlib.sha256(i).digest(): i for i in self._items}
        self._proofs = {digest: proof for digest, proof in self._proofs.items() if digest in self._whole_items}
        asyncio.create_task(self._store())

    async def _store(self) -> None:
        try:
            value = evidence_record(self._items)
            await self._context.dht.store(evidence_key(self._context.prefix), value, get_dht_time() + BAN_S,
                                          subkey=self._context.peer_id.to_bytes(), return_future=True)
        except Exception as e:  # the DHT is shutting down, or unreachable: our own exclusion still stands
            logger.warning(f"could not store the evidence against a reducer: {e!r}")

    def watch(self) -> None:
        """Start reading the evidence records every ``EVIDENCE_POLL_S`` (averager process; once)."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        while True:
            await self.read()
            await asyncio.sleep(EVIDENCE_POLL_S)

    async def read(self) -> None:
        """Judge every signed average stored against a reducer that we have not judged yet; exclude the guilty."""
        try:
            found = await self._context.dht.get(evidence_key(self._context.prefix), latest=True, return_future=True)
        except Exception as e:
            logger.debug(f"could not read the evidence records: {e!r}")
            return
        entries = found.value if found is not None and isinstance(found.value, dict) else {}
        for subkey, entry in entries.items():
            try:
                accuser = PeerID(subkey)
                items = p2ptrain_pb2.Evidence.FromString(entry.value).items[:MAX_ITEMS]
            except Exception:
                continue  # a malformed record convicts nobody
            for item in items:
                digest = item.item_digest or hashlib.sha256(item.SerializeToString()).digest()
                if accuser == self._context.peer_id or digest in self._seen:
                    continue
                try:
                    reducer = PeerID(item.reducer)
                except Exception:
                    self._seen.add(digest)
                    continue
                if reducer == self._context.peer_id or self._context.is_banned(reducer):
                    self._seen.add(digest)
                    continue
                if item.item_digest:  # a summary: the accuser serves the item
                    item = await self._fetch_whole_item(accuser, digest, reducer)
                    if item is None:
                        continue  # asked again at the next read, a few times
                if item.inputs_served and not item.inputs and signed_by_reducer(item):
                    inputs = await self._fetch_proof(accuser, digest, item)
                    if inputs is None:
                        continue  # the accuser did not answer: asked again at the next read, a few times
                    item.inputs.extend(inputs)
                self._seen.add(digest)
                reason = judge(item, self._codec, self._max_norm_ratio, self.own_rms_last)
                if reason:
                    self._context.ban(reducer, f"peer {accuser} holds its signed average of part "
                                               f"#{item.part_index} of a group: {reason}")

    async def _fetch_whole_item(self, accuser: PeerID, digest: bytes,
                                reducer: PeerID) -> Optional[p2ptrain_pb2.SignedAverage]:
        """The whole item an accuser's summary names; None if it did not come (after ``PROOF_TRIES`` reads that
        failed so, or at once if what came is not that item, the summary is set aside: it convicts nobody)."""
        try:
            served = await self._served_by(accuser, p2ptrain_pb2.ProofRequest(item=digest, whole_item=True))
        except Exception as e:
            tries = self._proof_tries[digest] = self._proof_tries.get(digest, 0) + 1
            logger.debug(f"could not fetch peer {accuser}'s evidence item ({tries}): {e!r}")
            if tries >= PROOF_TRIES:
                self._seen.add(digest)
            return None
        item = None
        if hashlib.sha256(served).digest() == digest:
            with suppress(Exception):
                item = p2ptrain_pb2.SignedAverage.FromString(served)
        if item is None or item.reducer != reducer.to_bytes() or item.item_digest:
            logger.debug(f"peer {accuser} served another item than its evidence record names")
            self._seen.add(digest)
            return None
        return item

    async def _fetch_proof(self, accuser: PeerID, digest: bytes,
                           item: p2ptrain_pb2.SignedAverage) -> Optional[List[bytes]]:
        """The audit inputs an accuser serves for its item, one sender's per call; None if they did not all come
        (after ``PROOF_TRIES`` reads that failed so, [] : the item is judged without them and convicts nobody)."""
        try:
            receipt = p2ptrain_pb2.Receipt.FromString(item.receipt)
            inputs = []
            for index, committed in enumerate(receipt.commitments[:MAX_SENDERS]):
                request = p2ptrain_pb2.ProofRequest(item=digest, sender_index=index)
                inputs.append(await self._served_by(accuser, request) if committed else b"")
            return inputs
        except Exception as e:
            tries = self._proof_tries[digest] = self._proof_tries.get(digest, 0) + 1
            logger.debug(f"could not fetch the inputs of peer {accuser}'s audit proof ({tries}): {e!r}")
            return [] if tries >= PROOF_TRIES else None

    async def _served_by(self, accuser: PeerID, request: p2ptrain_pb2.ProofRequest) -> bytes:
        """What ``accuser`` serves for ``request`` (``rpc_audit_proof``, with our admission token); LookupError if it
        no longer serves it, a timeout or a network error if it does not answer."""
        request.admission = self._context.auth.token(self._context.peer_id)
        stub = self._context.stub(accuser)
        reply = await asyncio.wait_for(stub.rpc_audit_proof(request), PROOF_TIMEOUT_S)
        if not reply.available:
            raise LookupError("the accuser no longer serves it")
        return reply.tensor_part

    def proof_for(self, request: p2ptrain_pb2.ProofRequest, caller: PeerID) -> p2ptrain_pb2.AuditInput:
        """``rpc_audit_proof``: one input of an audit proof of ours (``report_bad_average`` with ``serve``), or with
        ``whole_item`` one of our evidence items whole, to a peer of the swarm."""
        if request.whole_item:
            item = self._whole_items.get(request.item)
            if item is None or not self._context.auth.admits(caller, request.admission):
                return p2ptrain_pb2.AuditInput(available=False)
            return p2ptrain_pb2.AuditInput(available=True, tensor_part=item)
        proof = self._proofs.get(request.item)
        if proof is None or request.sender_index >= len(proof) or \
                not self._context.auth.admits(caller, request.admission):
            return p2ptrain_pb2.AuditInput(available=False)
        return p2ptrain_pb2.AuditInput(available=True, tensor_part=proof[request.sender_index])
