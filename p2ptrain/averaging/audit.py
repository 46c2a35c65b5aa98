"""Auditing reducers: a plausible but wrong average (a member left out, a part scaled by 1.5) is caught.

Three pieces (protocol 9), after BTARD (Gorbunov et al. 2021):

1. **Receipts.** A reducer's signed answer for a part (evidence.py) also signs a ``Receipt``: each sender's
   commitment (the BLAKE3 of the part it sent, every field: ``commitment``; empty if that part is not in the average), the weight it
   sent, the weight cap and the aggregation applied. Every sender checks its own entry in every answer
   (``check_receipt``): a reducer that leaves a member out, or swaps its part or its weight, is caught by that
   member at once, on every part, and its range is refused like any other bad average.
2. **Audits.** Before a round, each member picks ``audit_parts`` parts of other reducers' ranges with its own
   secret randomness (the reducer cannot know which). After the round it asks their reducers for the senders'
   inputs (``rpc_audit_input``), checks each against the signed commitment, recomputes the aggregate and compares
   it with the signed average (``verdict``). A mismatch is a proof: the reducer signed both the commitments and the
   average, and anyone can redo the arithmetic. The reducer keeps its inputs (one wire-format copy of the vector over
   its range x group size, that is one copy of the whole vector) for ``AUDIT_KEEP_S``.
3. **Evidence.** The proof goes into the auditor's evidence record (evidence.py), so the reducer is excluded
   swarm-wide: inside the record when it is small enough for the DHT (``MAX_PROOF_BYTES``), else the record says
   the auditor serves its inputs (``Evidence.proof_for``), and each reader fetches them once.

A reducer that cheats on a share q of its parts, in a group of n equal ranges where each of the n - 1 others audits
one part, is caught in a round with probability 1 - (1 - q / (n - 1)) ** (n - 1) (all its parts: 1 for n = 2, 0.75
for n = 3, 0.70 for n = 4, towards 1 - 1/e = 0.63). The audited round stays applied: the exclusion protects the next
ones. Limits: docs/security.md, "Verifying reducers".
"""

from __future__ import annotations

import asyncio
import ctypes
import math
import multiprocessing as mp
import os
import random
import struct
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import psutil
import torch
from blake3 import blake3
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_logger

from p2ptrain.averaging.compression import WireCodec
from p2ptrain.averaging.context import AveragerContext
from p2ptrain.averaging.kept_inputs import SpilledInputs, inputs_nbytes, spill
from p2ptrain.averaging.robust import AGGREGATIONS, checks_senders, robust_aggregate
from p2ptrain.finite import all_finite
from p2ptrain.proto import p2ptrain_pb2
from p2ptrain.sender_check import RangeSums, weighed_partial

logger = get_logger(__name__)

AUDIT_PARTS = 1
"""parts of other reducers' ranges each member audits per round (0: none)"""
AUDIT_TOLERANCE = 0.01
"""an audited average may differ from the recomputed one by this share of its norm: the reducer adds its senders'
parts in the order they arrive, the auditor in group order, and the float32 sums differ in their last bits, which
rounding to the wire format can turn into one fp16 step"""
SUMS_TOLERANCE = 1e-6
"""a signed sender sum (sender_check.py) may differ from the recomputed one by this share of its scale"""
ABSOLUTE_SLACK = 1e-6
"""... plus this much per value's square root (an all-zero average)"""
AUDIT_KEEP_S = 120.0
"""how long a reducer keeps a round's inputs for its auditors (dropped when a later round starts after that)"""
KEPT_ROUNDS = 4
"""rounds whose inputs a reducer keeps at most (the memory: that many copies of the vector in wire format, in a
swarm whose syncs are less than ``AUDIT_KEEP_S`` apart; one otherwise)"""
FRESH_S = 30.0
"""a reducer that does not show an input it signed for, asked within this long after the round, is excluded (by
the auditor alone: nothing proves it). Honest reducers keep their inputs ``AUDIT_KEEP_S``, for ``KEPT_ROUNDS``
rounds; later, the auditor lets it go"""
AUDIT_TIMEOUT_S = 30.0
"""how long an auditor waits for one input"""
MAX_PROOF_BYTES = 256 * 1024
"""an audit's proof (the inputs and the average) larger than this is not stored in the DHT: the auditor serves its
inputs to the peers that read its record (``Evidence.proof_for``)"""


def commitment(message: runtime_pb2.Tensor) -> bytes:
    """What a receipt holds for a sender's part, and what a reducer's signature covers of its average: the BLAKE3
    (256 bits) of every field of the ``runtime_pb2.Tensor``, the buffer hashed in place (no serialized copy on the
    round's path). BLAKE3: 3.4x sha256's speed on this machine's CPU, and as collision-resistant for this."""
    digest = blake3(b"p2ptrain-tensor")
    digest.update(struct.pack(">iii?I", message.compression, message.chunks, len(message.size), message.requires_grad,
                              len(message.dtype)))
    digest.update(struct.pack(f">{len(message.size)}I", *message.size))
    digest.update(message.dtype.encode())
    digest.update(message.buffer)
    return digest.digest()


def commitment_of(serialized: bytes) -> bytes:
    """``commitment`` of a serialized part (b"" if it does not parse)."""
    try:
        return commitment(runtime_pb2.Tensor.FromString(serialized))
    except Exception:
        return b""


def receipt_message(entries: Sequence[Optional[Tuple[bytes, float]]], weight_cap: float, aggregation: str,
               sums: Optional[RangeSums] = None) -> p2ptrain_pb2.Receipt:
    """The ``Receipt`` of one part: ``entries[i]`` is sender i's (commitment, weight), None if its part is not in the
    average; ``sums``: the senders' sums over it, under an aggregation that checks senders."""
    receipt = p2ptrain_pb2.Receipt(commitments=[e[0] if e else b"" for e in entries],
                                   weights=[e[1] if e else 0.0 for e in entries], weight_cap=weight_cap,
                                   aggregation=aggregation)
    if sums is not None:
        receipt.dots.extend(sums.dots)
        receipt.squares.extend(sums.squares)
        receipt.median_squares.extend(sums.median_squares)
    return receipt


def make_receipt(entries: Sequence[Optional[Tuple[bytes, float]]], weight_cap: float, aggregation: str,
                 sums: Optional[RangeSums] = None) -> bytes:
    """``receipt_message``, serialized."""
    return receipt_message(entries, weight_cap, aggregation, sums).SerializeToString()


def check_receipt(receipt: p2ptrain_pb2.Receipt, *, senders: int, me: int, sent: bytes, weight: float,
                  weight_cap: float, aggregation: str) -> str:
    """Why a sender refuses an answer whose receipt is ``receipt`` (empty if it does not): it must list the group's
    senders, this one's part (``sent``: its commitment) with the weight it sent, and the group's cap and
    aggregation. An honest reducer that left this sender out never answers it (its stream of averages ends)."""
    if len(receipt.commitments) != senders or len(receipt.weights) != senders:
        return f"a receipt for {len(receipt.commitments)} senders, not {senders}"
    if receipt.commitments[me] != sent:
        if not receipt.commitments[me]:
            return "an average that leaves this peer's part out"
        return "an average of a part that is not the one this peer sent"
    if receipt.weights[me] != weight:
        return f"an average that weighs this peer's part {receipt.weights[me]!r}, not {weight!r}"
    if receipt.weight_cap != weight_cap or receipt.aggregation != aggregation:
        return (f"an average with weight cap {receipt.weight_cap!r} and aggregation {receipt.aggregation!r}, not the "
                f"group's {weight_cap!r} and {aggregation!r}")
    if checks_senders(aggregation):
        sums = (receipt.dots, receipt.squares, receipt.median_squares)
        if any(len(values) != senders for values in sums):
            return f"a receipt without the {senders} senders' sums that aggregation {aggregation!r} needs"
        if not all(math.isfinite(v) for values in sums for v in values) or min(*sums[1], *sums[2]) < 0:
            return "a receipt whose senders' sums are not finite, or hold a negative square"
    return ""


def verdict(receipt: p2ptrain_pb2.Receipt, inputs: Sequence[bytes], average: bytes, codec: WireCodec) -> str:
    """Why a signed average convicts its reducer, given the inputs its receipt commits to (empty if it does not, or
    if the inputs are not those of the receipt: then the accuser's proof is broken, not the reducer)."""
    n = len(receipt.commitments)
    if len(receipt.weights) != n or len(inputs) != n or n == 0 or receipt.aggregation not in AGGREGATIONS:
        return ""
    for committed, given in zip(receipt.commitments, inputs):
        if (committed or given) and commitment_of(given) != committed:
            return ""
    try:
        averaged = codec.extract(runtime_pb2.Tensor.FromString(average))
    except Exception:  # any failure to parse a signed answer is the reducer's
        return "it signed an average that does not decode"
    parts, weights = [], []
    for given, weight in zip(inputs, receipt.weights):
        if not given:
            continue
        try:
            part = codec.extract(runtime_pb2.Tensor.FromString(given))
        except Exception:
            return "it signed for an input that does not decode (an honest reducer refuses it)"
        if part.shape != averaged.shape or not all_finite(part):
            return "it signed for an input of another shape or with NaN/inf values (an honest reducer refuses it)"
        if not (math.isfinite(weight) and weight >= 0):
            return f"it signed for an input of weight {weight!r} (an honest reducer refuses it)"
        parts.append(part)
        weights.append(min(weight, receipt.weight_cap))
    if not parts:
        expected = torch.zeros_like(averaged)  # every sender left: nothing to average (the reducer sends none)
    else:
        expected = codec.roundtrip(robust_aggregate(parts, weights, receipt.aggregation))
    distance = float(torch.linalg.vector_norm(averaged.float() - expected.float()))
    norm = float(torch.linalg.vector_norm(expected.float()))
    if not math.isfinite(distance) or distance > AUDIT_TOLERANCE * norm + ABSOLUTE_SLACK * math.sqrt(expected.numel()):
        return (f"it signed an average at distance {distance:.4g} from the {receipt.aggregation} of the "
                f"{len(parts)} inputs it signed for (norm {norm:.4g})")
    return sums_verdict(receipt, inputs, codec) if checks_senders(receipt.aggregation) else ""


def sums_verdict(receipt: p2ptrain_pb2.Receipt, inputs: Sequence[bytes], codec: WireCodec) -> str:
    """Why the senders' sums a reducer signed convict it, given the inputs (empty if they do not): recomputed over
    the senders that weigh more than 0, as the reducer must, each may differ by ``SUMS_TOLERANCE`` of its scale (the
    products are summed in float64 in another order)."""
    if not len(receipt.dots) == len(receipt.squares) == len(receipt.median_squares) == len(inputs):
        return ""  # honest members refuse such a receipt (check_receipt): it is no proof of false sums
    expected = weighed_partial([codec.extract(runtime_pb2.Tensor.FromString(given)) if given else None
                                for given in inputs], receipt.weights)
    for i in range(len(inputs)):
        scale = math.sqrt(expected.squares[i] * expected.median_squares[i]) + expected.squares[i] + \
            expected.median_squares[i] + 1e-30
        signed = (receipt.dots[i], receipt.squares[i], receipt.median_squares[i])
        wanted = (expected.dots[i], expected.squares[i], expected.median_squares[i])
        if any(abs(a - b) > SUMS_TOLERANCE * scale for a, b in zip(signed, wanted)):
            return (f"it signed sums {signed} for sender {i} where its inputs give {wanted}: the sender check's "
                    "scores would be false")
    return ""


def choose_audits(parts_by_reducer: Sequence[int], me: int, audit_parts: int) -> set:
    """(reducer index, part index) pairs to audit: ``audit_parts`` of the other reducers' parts, at random, with
    randomness no other peer can predict."""
    candidates = [(peer, part) for peer, count in enumerate(parts_by_reducer) if peer != me for part in range(count)]
    return set(random.SystemRandom().sample(candidates, min(audit_parts, len(candidates))))


AUDIT_MEMORY_SHARE = 0.05
"""kept inputs a reducer holds in memory, as a share of the host's RAM (``P2PTRAIN_AUDIT_MEMORY_MB`` overrides it);
over it, the oldest rounds' move to a file. Writing them out costs CPU and memory bandwidth beside the next sync's
work (it doubled the outer step of 2 peers of the 124m model on 2 cores): a model whose rounds fit keeps them in
memory (4 rounds of the 124m model in fp16, 1 GB, on a host of 20 GB or more); a 1B model's 2 GB a round go out"""


def audit_memory_budget() -> int:
    """``AUDIT_MEMORY_SHARE`` of this host's RAM, or ``P2PTRAIN_AUDIT_MEMORY_MB`` (0: every round goes out)."""
    given = os.environ.get("P2PTRAIN_AUDIT_MEMORY_MB")
    if given is not None:
        try:
            return max(0, int(float(given) * 1e6))
        except ValueError:
            logger.warning(f"ignoring P2PTRAIN_AUDIT_MEMORY_MB={given!r}: not a number of megabytes")
    return int(AUDIT_MEMORY_SHARE * psutil.virtual_memory().total)


@dataclass
class _Kept:
    members: frozenset
    inputs: Dict[Tuple[int, int], runtime_pb2.Tensor]  # (part index, sender index) -> the part as it came
    until: float
    spilled: Optional[SpilledInputs] = None  # those written out after the round (kept_inputs.py), gone from inputs
    spilling: bool = False

    def serialized(self, key: Tuple[int, int]) -> Optional[bytes]:
        """One input as its sender sent it, from the file or from memory; None if not kept."""
        if self.spilled is not None and key in self.spilled:
            return self.spilled.get(key)
        part = self.inputs.get(key)
        return None if part is None else part.SerializeToString()

    def drop(self) -> None:
        if self.spilled is not None:
            self.spilled.close()


class Audits:
    """The averager's audits (averager process): keep our inputs as a reducer, serve them to the group's auditors, and
    audit other reducers after our rounds. A catch is banned through the context and its proof goes to ``report``
    (``Evidence.report_bad_average``)."""

    max_proof_bytes = MAX_PROOF_BYTES  # a class attribute: a test sets it before the averager process forks

    def __init__(self, context: AveragerContext, audit_parts: int, report: Callable[..., None]) -> None:
        if audit_parts < 0:
            raise ValueError(f"audit_parts must be 0 or more, got {audit_parts}")
        self._context = context
        self.parts = audit_parts
        self._report = report
        self._kept: "OrderedDict[bytes, _Kept]" = OrderedDict()
        self.memory_budget = audit_memory_budget()
        """bytes of kept inputs held in memory; over it, the oldest rounds' go to a file (kept_inputs.py)"""
        self._tasks: set = set()
        self.keep_last = 0  # the replay check fetches a sender's parts up to two rounds later, phases apart
        # parts audited, bytes fetched for them and reducers caught so far, and bytes of our kept inputs written out
        # of memory (the host reads: metrics, benchmarks)
        self._counts = mp.Array(ctypes.c_int64, 4)

    @property
    def counts(self) -> Dict[str, int]:
        """Parts this averager audited so far, the bytes it fetched for them, the reducers it caught, and the bytes
        of its kept inputs it wrote out of memory (``spilled``)."""
        parts, fetched, caught, spilled = self._counts[:]
        return {"parts": parts, "bytes": fetched, "caught": caught, "spilled": spilled}

    def keep(self, group_id: bytes, members: Sequence[PeerID], inputs: Dict[Tuple[int, int], runtime_pb2.Tensor]):
        """Keep a round's inputs (filled while it runs) for ``AUDIT_KEEP_S`` (the last ``keep_last`` whatever their
        age), the last ``KEPT_ROUNDS`` rounds."""
        self._kept[group_id] = _Kept(frozenset(members), inputs, time.monotonic() + AUDIT_KEEP_S)
        for old in [g for g in self._kept if not self._shown(g)]:
            self._kept.pop(old).drop()
        while len(self._kept) > KEPT_ROUNDS:
            self._kept.popitem(last=False)[1].drop()

    def set_aside(self, group_id: bytes) -> None:
        """After our round (``group_id``'s): if the rounds' inputs in memory are over ``memory_budget``, write the
        oldest rounds' out (kept_inputs.py), in the background, until the rest fits. Inputs that come later (a slow
        sender's, after we went on) stay in memory."""
        if group_id not in self._kept:
            return
        held = [(g, kept, inputs_nbytes(kept.inputs)) for g, kept in self._kept.items()
                if kept.inputs and not kept.spilling]
        total = sum(nbytes for _, _, nbytes in held)
        for g, kept, nbytes in held:  # oldest first
            if total <= self.memory_budget:
                break
            total -= nbytes
            kept.spilling = True
            task = asyncio.create_task(self._spill(g, kept))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _spill(self, group_id: bytes, kept: _Kept) -> None:
        inputs = dict(kept.inputs)
        try:
            spilled = await asyncio.get_event_loop().run_in_executor(None, spill, inputs)
        except OSError as e:
            logger.warning(f"could not write a round's audit inputs to a temporary file ({e!r}); they stay in "
                           "memory. Point TMPDIR at a directory with room (one copy of the model in wire format)")
            return
        if self._kept.get(group_id) is not kept:  # dropped meanwhile
            spilled.close()
            return
        kept.spilled = spilled
        for key in inputs:
            kept.inputs.pop(key, None)
        with self._counts.get_lock():
            self._counts[3] += spilled.size

    def input_for(self, request: p2ptrain_pb2.AuditRequest, caller: PeerID) -> p2ptrain_pb2.AuditInput:
        """``rpc_audit_input``: one kept input, to a member of its group."""
        kept = self._kept.get(request.group_id)
        if kept is None or not self._shown(request.group_id) or caller not in kept.members:
            return p2ptrain_pb2.AuditInput(available=False)
        try:
            data = kept.serialized((request.part_index, request.sender_index))
        except OSError as e:
            logger.warning(f"could not read a kept audit input back: {e!r}")
            data = None
        return p2ptrain_pb2.AuditInput(available=data is not None, tensor_part=data or b"")

    def _shown(self, group_id: bytes) -> bool:
        """Whether a kept round's inputs are shown: younger than ``AUDIT_KEEP_S``, or of the last ``keep_last``."""
        recent = self.keep_last and group_id in list(self._kept)[-self.keep_last:]
        return recent or self._kept[group_id].until >= time.monotonic()

    def start(self, group_id: bytes, targets: List[Tuple[PeerID, int, averaging_pb2.AveragingData]],
              codec: WireCodec) -> None:
        ended = time.monotonic()
        for reducer, part_index, answer in targets:
            task = asyncio.create_task(self._audit(group_id, reducer, part_index, answer, codec, ended))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _audit(self, group_id: bytes, reducer: PeerID, part_index: int, answer: averaging_pb2.AveragingData,
                     codec: WireCodec, ended: float) -> None:
        """Fetch the inputs of one part from its reducer, recompute, and exclude the reducer if they disagree."""
        try:
            receipt = p2ptrain_pb2.Receipt.FromString(
                p2ptrain_pb2.AnswerSignature.FromString(answer.peer_id).receipt)
        except Exception:
            return  # checked when it came (check_receipt): an unsigned answer of a run without a key
        inputs, fetched = [], 0
        stub = self._context.stub(reducer)
        for sender_index, committed in enumerate(receipt.commitments):
            if not committed:
                inputs.append(b"")
                continue
            request = p2ptrain_pb2.AuditRequest(group_id=group_id, part_index=part_index, sender_index=sender_index)
            try:
                reply = await asyncio.wait_for(stub.rpc_audit_input(request), AUDIT_TIMEOUT_S)
            except Exception as e:  # gone, or refusing: nothing to prove, and nothing to hold against it either
                logger.info(f"could not audit part #{part_index} of reducer {reducer}: {e!r}")
                return
            fetched += len(reply.tensor_part)
            if not reply.available and time.monotonic() - ended > FRESH_S:
                logger.info(f"reducer {reducer} no longer keeps the inputs of part #{part_index}: not audited")
                return
            if not reply.available or commitment_of(reply.tensor_part) != committed:
                self._context.ban(reducer, f"it did not show the input of sender #{sender_index} to part "
                                           f"#{part_index} it signed for when audited")
                return
            inputs.append(reply.tensor_part)
        loop = asyncio.get_event_loop()
        reason = await loop.run_in_executor(None, verdict, receipt, inputs, answer.tensor_part.SerializeToString(),
                                            codec)
        with self._counts.get_lock():
            self._counts[0] += 1
            self._counts[1] += fetched
            self._counts[2] += bool(reason)
        logger.debug(f"audited part #{part_index} of reducer {reducer}: {fetched} bytes, "
                     f"{'caught: ' + reason if reason else 'as signed'}")
        if reason:
            self._context.ban(reducer, f"audited, part #{part_index} of a group: {reason}")
            # the proof: inside the DHT record if it is small, else served by us to whoever reads the record
            small = fetched + answer.tensor_part.ByteSize() <= self.max_proof_bytes
            self._report(group_id, reducer, part_index, answer, f"audit: {reason}",
                         inputs=inputs if small else (), serve=() if small else inputs)
