"""Butterfly all-reduce whose result is bit-identical on every peer of the group.

hivemind's ``AllReduceRunner`` splits the flat vector of averaged tensors into parts, one range of parts per
peer ("reducer"). Every peer sends its parts to their reducers; a reducer sums what it receives, and then sends
each sender the *difference* between the average and that sender's own part, compressed. The sender adds that
difference to its own unrounded values, and the reducer keeps its own part unrounded. With fp16 on the wire,
``own + fp16(avg - own)`` differs from peer to peer, so peers drift apart a little more every round.

``ExactAllReduceRunner`` changes one thing: a reducer rounds the average to the wire format *once* and sends that
same rounded average to every sender, and uses its decompressed value for its own part too. Every peer then holds
``decompress(compress(avg))`` for every part, the same bits everywhere. The cost is nothing: the message has the
size of the difference it replaces.

A reducer also rounds its *own* contribution through the codec before adding it, like every other sender's: the
average is then a function of what the senders put on the wire alone, whoever reduces a part, and what the wire
drops of a peer's pseudo-gradient is the same over its whole vector (which error feedback relies on).

Parts are encoded and decoded with the group's ``WireCodec`` (``averaging/compression.py``) in both directions, not
with hivemind's codec registry, which has no room for the bf16 and int8 formats. A message that does not decode
(``WireFormatError``) counts like any other bad part: its sender is excluded from the round, or its reducer failed.

It moves parts and averages as ``WireMessage``s on its own stream (``part_stream.py``, ``wire_part.py``), counting
their bytes both ways, and rejects a sender's part of the wrong shape, with a bad weight, or that fails the norm
check (norm_check.py), instead of letting one peer poison the average; a sender rejects a reducer's average on the
same grounds (that range counts as failed, the round is run again without it). Either way the peer goes to
``on_bad_peer`` (the averager bans it from its groups for a while).
"""

from __future__ import annotations

import asyncio
import math
from typing import AsyncIterator, Callable, Dict, List, Optional, Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger
from hivemind.utils.asyncio import aenumerate, amap_in_executor, as_aiter, attach_event_on_finished

from p2ptrain.averaging.audit import choose_audits, commitment
from p2ptrain.averaging.compression import WireCodec, WireFormatError
from p2ptrain.averaging.evidence import AverageSigner
from p2ptrain.averaging.flat_outputs import FlatOutputs
from p2ptrain.averaging.norm_check import NormCheck
from p2ptrain.averaging.receipts import Receipts
from p2ptrain.averaging.reducer import Reducer
from p2ptrain.averaging.round import NotInRoundError
from p2ptrain.averaging.part_stream import open_part_stream
from p2ptrain.averaging.runner_io import TimedCodec, aiter_with_timeouts
from p2ptrain.averaging.wire_part import WireMessage, WireTensor
from p2ptrain.clock import PhaseClock
from p2ptrain.faults import kill_this_peer
from p2ptrain.hivemind_compat import own_input_part, own_input_part_shapes, take_input_parts

logger = get_logger(__name__)

HANG_UP_TIMEOUT_S = 60.0
"""how long a reducer holds a sender's stream open after its last average when no ``reducer_timeout`` is set"""
START_TIMEOUT_S = 30.0
"""a member that has sent no part this long after the all-reduce began (or, as a reducer, answered none in twice
that) is left out at once, not after ``sender_timeout``/``reducer_timeout``, which are sized for slow parts of a
large model: it left the group as it formed (its matchmaking gave up while the leader counted it in) or died"""


class ExactAllReduceRunner(AllReduceRunner):
    """An ``AllReduceRunner`` whose outputs are the (rounded) averages themselves, identical on every peer.

    Iterating it yields averaged tensors, not deltas. Parts whose reducer failed come back as this peer's own
    values (``failed_size`` in ``tensor_part_container`` counts them).
    """

    def __init__(self, *, die_after_parts: Optional[int] = None, max_norm_ratio: Optional[float] = None,
                 on_bad_peer: Optional[Callable[[PeerID, str], None]] = None,
                 deviation_scale: Optional[Sequence[torch.Tensor]] = None, aggregation: str = "mean",
                 weight_cap: float = math.inf, signer: Optional[AverageSigner] = None,
                 on_bad_average: Optional[Callable[[PeerID, int, averaging_pb2.AveragingData, str], None]] = None,
                 require_receipts: bool = False, audit_parts: int = 0, output_buffer: Optional[torch.Tensor] = None,
                 **kwargs):
        super().__init__(**kwargs)
        # every average is decoded into its slice of one flat buffer, the caller's if it kept one (flat_outputs.py)
        self._outputs = FlatOutputs.adopt(self.tensor_part_container, output_buffer)
        Reducer.adopt(self.tensor_part_reducer, aggregation, weight_cap)  # reducer.py
        self._on_bad_peer = on_bad_peer or (lambda peer, reason: None)
        # evidence.py: our averages go out signed; a signed average we refuse goes to on_bad_average (evidence)
        self._on_bad_average = on_bad_average or (lambda reducer, part_index, message, reason: None)
        # audit.py: the receipts we sign as a reducer and check as a sender, the inputs we keep for our auditors
        self._receipts = Receipts(signer, require_receipts, weight_cap, aggregation, len(self.sender_peer_ids),
                                  self.ordered_peer_ids.index(self.peer_id))
        self.kept_inputs = self._receipts.kept_inputs  # (part index, sender index) -> the part as it came
        self.sender_sums = self._receipts.sums  # the senders' sums of every part, under the sender check
        self.audit_targets: List[tuple] = []  # (reducer, part index, its answer): the parts we audit after the round
        # parts and averages whose norm is far above ours are refused (norm_check.py)
        self._norms = NormCheck.of_round(self.tensor_part_container, max_norm_ratio, deviation_scale)
        self._own_rms = self._norms.own_rms
        self._codec = self.tensor_part_container.compression
        if not isinstance(self._codec, WireCodec):
            raise TypeError(f"ExactAllReduceRunner needs a p2ptrain WireCodec, got {self._codec!r}")
        self.clock = PhaseClock()
        """CPU seconds of each kind of work in this round (``RoundResult.phases``), summed over threads"""
        self._timed = TimedCodec(self._codec, self.clock)  # the parts and averages we encode and decode
        # shape of each part of each reducer's range: an average that comes back in another shape is a failure
        self._part_shapes_by_peer = own_input_part_shapes(self.tensor_part_container)
        # the parts of other reducers' ranges we audit after the round, drawn now with our own secret randomness
        self._audit_choice = choose_audits(self.tensor_part_container.num_parts_by_peer,
                                           self.ordered_peer_ids.index(self.peer_id), audit_parts)
        self._die_after_parts, self._parts_answered = die_after_parts, 0  # faults.py: SIGKILL after that many answers
        # outputs are averages, so a failed reducer's parts must fall back to the local values, not to zero deltas
        self.tensor_part_container.return_deltas = False
        self.bytes_sent, self.bytes_received = 0, 0
        self.failed_reducers: set = set()
        """reducers whose range did not come back (dead, timed out or refused): the host leaves them out of its
        retry's expected group, so the survivors regroup at once instead of waiting for them"""
        # part_index -> the average of that part, serialized once and shared by every sender and by ourselves
        self._serialized_averages: Dict[int, asyncio.Future] = {}
        # senders whose stream of averages we are still answering (see wait_until_senders_served)
        self._streams_open = 0
        self._senders_served = asyncio.Event()
        self._senders_served.set()

    def should_delay_results(self, peer_id: PeerID) -> bool:
        """Never: a client-mode sender (behind NAT, it reduces nothing) reads its averages while it still sends.
        hivemind holds a client's averages until it has sent everything, which turns its full-duplex link into two
        half-duplex phases: 2x its transfer time, and the reducer's uploads to clients wait for its downloads.
        Both ends of a stream ask this of their own runner, so every peer of a group must agree (protocol 4)."""
        return False

    async def rpc_aggregate_part(self, stream, context):
        """Reducer side of a sender's stream. Once every average of our range is out, the stream stays open until
        the sender hangs up (it does once it holds them all: ``_communicate_with_remote_reducer``), at most
        ``reducer_timeout``. A reducer that ended the stream itself raced its last average: on a slow link the
        sender sometimes never got it (most likely p2pd resets the libp2p stream once the handler's socket closes,
        dropping what is still queued), failed the round ("sent 13 parts, but we expected 14") and took the state,
        while the others committed it. Seen in CI and in 1 of every 8-50 fragment rounds of the WAN benchmark with
        streaming; none in 140 since."""
        self._streams_open += 1
        self._senders_served.clear()
        answered = 0
        try:
            async for message in super().rpc_aggregate_part(stream, context):
                answered += message.code == averaging_pb2.AVERAGED_PART
                yield message
            if answered == self.tensor_part_reducer.num_parts:
                # the sender's hang-up cancels this wait (serve_part_stream sees its stream end)
                await asyncio.sleep(self.reducer_timeout or HANG_UP_TIMEOUT_S)
                logger.warning(f"Sender {context.remote_id} did not hang up after taking every average of this "
                               "reducer's range; closing its stream")
        finally:
            self._streams_open -= 1
            if not self._streams_open:
                self._senders_served.set()

    async def wait_until_senders_served(self, timeout_s: float) -> bool:
        """Wait until every sender has been sent its last average. Our own result is complete as soon as every
        part is summed, but the averages still go out to the senders after that (to a client-mode sender only once
        it has sent everything): a reducer that left at once (its last round) would cut them off mid-stream."""
        try:
            await asyncio.wait_for(self._senders_served.wait(), timeout_s)
            return True
        except asyncio.TimeoutError:
            return False

    async def _serialize_average(self, part_index: int, averaged_part: torch.Tensor) -> WireTensor:
        """Compress the average of one part once (and sign it, with a signer); every caller for that part gets the
        same message."""
        if part_index not in self._serialized_averages:
            loop = asyncio.get_event_loop()
            self._serialized_averages[part_index] = loop.run_in_executor(None, self._encode_and_sign, part_index,
                                                                         averaged_part)
        return await self._serialized_averages[part_index]

    def _encode_and_sign(self, part_index: int, averaged_part: torch.Tensor) -> WireTensor:
        message = self._timed.encode(averaged_part)
        if self._receipts.signer is not None:
            with self.clock("sign"):
                # the receipt: what went into this average (every sender's commitment and weight), signed with it
                included = set(self.tensor_part_reducer.included_by_part.get(part_index, ()))
                self._receipts.sign(self.group_id, part_index, message, included, self.tensor_part_reducer.num_senders,
                                    self.tensor_part_reducer.sums_by_part.get(part_index))
        return message

    def _encode_own(self, tensor_part: torch.Tensor) -> tuple:
        """Our own part as a reducer that signs receipts: its message (kept for audits), commitment and decoded
        values (what any other reducer would have received of it)."""
        with self.clock("encode"):
            message = self._codec.encode(tensor_part)
            committed = commitment(message)
        return message, committed, self._timed.decode(message)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[WireMessage]:
        """hivemind's (and its ``iterate_input_parts_for``), its parts encoded as ``WireTensor``s, each one's
        commitment recorded for the reducer's receipt (audit.py): a hash in place, cheaper than an executor's hop."""
        parts = as_aiter(*take_input_parts(self.tensor_part_container, peer_index))  # (part, its CompressionInfo)
        part_index = 0
        async for tensor_part in amap_in_executor(lambda part: self._timed.encode(*part), parts,
                                                  max_prefetch=self.tensor_part_container.prefetch):
            with self.clock("checks"):
                self._receipts.sent[(peer_index, part_index)] = commitment(tensor_part)
            first = part_index == 0  # the first says what it is and of which group (hivemind's checks read it)
            yield WireMessage(code=averaging_pb2.PART_FOR_AVERAGING if first else 0,
                              group_id=self.group_id if first else b"", tensor_part=tensor_part, weight=self.weight)
            part_index += 1

    def _start_timeout(self) -> float:
        return min(self.sender_timeout or START_TIMEOUT_S, START_TIMEOUT_S)

    async def _handle_missing_senders(self):
        """hivemind's, with ``START_TIMEOUT_S`` instead of ``sender_timeout``: a member counted into the group that
        never runs the round (seen in the WAN benchmark: its matchmaking attempt ended as the leader formed the group)
        held the others for ``sender_timeout`` (300 s there), then again for ``reducer_timeout`` on its range."""
        try:
            await asyncio.wait_for(self.all_senders_started.wait(), self._start_timeout())
        except asyncio.TimeoutError:
            for peer_id in self.sender_peer_ids:
                if peer_id not in self.active_senders and peer_id not in self.banned_senders:
                    logger.warning(f"Group member {peer_id} sent nothing {self._start_timeout():.0f}s into the "
                                   "all-reduce: going on without it")
                    await self._ban_sender(peer_id)

    async def _communicate_with_peer(self, peer_id: PeerID):
        if peer_id != self.peer_id:
            return await self._communicate_with_remote_reducer(peer_id)

        loop = asyncio.get_event_loop()
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
            # our own contribution goes through the codec too, as it would to any other reducer
            if self._receipts.signer is not None:  # and into our receipts, like any other sender's (audit.py)
                kept, committed, rounded_part = await loop.run_in_executor(None, self._encode_own, tensor_part)
                self._receipts.keep(part_index, sender_index, kept, committed, self.weight)
            else:
                rounded_part = await loop.run_in_executor(None, self._timed.roundtrip, tensor_part)
            averaged_part = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, rounded_part, weight=self.weight
            )
            serialized = await self._serialize_average(part_index, averaged_part)
            # use exactly what the other senders receive: decompress(compress(average))
            average = self._timed.decode(serialized, self._outputs.part_slice(peer_index, part_index))
            self._outputs.register_processed_part(peer_index, part_index, average)

    async def _communicate_with_remote_reducer(self, peer_id: PeerID):
        """Sender side: stream our parts of that reducer's range to it, register the averages it answers.

        hivemind's ``AllReduceRunner._communicate_with_peer`` (1.1.12) with two changes: answers are decoded with
        the group's codec, and an answer of the wrong shape fails that reducer instead of the whole round."""
        peer_index = self.ordered_peer_ids.index(peer_id)
        try:
            done_sending = asyncio.Event()
            inputs_aiter = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await open_part_stream(self._p2p, peer_id, self._prefix, self.group_id, inputs_aiter, self)

            if self.should_delay_results(self.peer_id):
                await done_sending.wait()

            part_index = 0
            expected_shapes = self._part_shapes_by_peer[peer_index]
            expected = self.tensor_part_container.num_parts_by_peer[peer_index]

            def _try_deserialize(indexed):
                index, msg = indexed
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise (NotInRoundError if msg.code == averaging_pb2.BAD_GROUP_ID else AllreduceException)(
                        f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                if index >= expected:
                    return msg, None, f"part #{index}, beyond the {expected} of its range"
                try:  # into the part's slice of the outputs (a bad answer's range is overwritten with our values)
                    return msg, self._timed.decode(msg.tensor_part, self._outputs.part_slice(peer_index, index)), ""
                except WireFormatError as e:
                    return msg, None, str(e)

            # a reducer that runs the round answers its first part within the start timeout (it leaves out a sender
            # that sent nothing by then) plus one part's way: one that does not is not running it
            first_answer_s = 2 * self._start_timeout()
            if self.reducer_timeout is not None:
                first_answer_s = min(first_answer_s, self.reducer_timeout)
            answers = amap_in_executor(
                _try_deserialize, aenumerate(aiter_with_timeouts(stream, first_answer_s, self.reducer_timeout)),
                max_prefetch=self.tensor_part_container.prefetch,
            )
            try:
                async for msg, average, undecodable in answers:
                    if undecodable:
                        problem = f"an average for part #{part_index} that does not decode: {undecodable}"
                    elif average.shape != expected_shapes[part_index]:
                        problem = f"an average of shape {tuple(average.shape)} for part #{part_index}"
                    else:
                        own = own_input_part(self.tensor_part_container, peer_index, part_index)
                        with self.clock("checks"):
                            problem = self._norms.check(("sent", peer_index, part_index), average, own,
                                                        f"an average for part #{part_index}",
                                                        self._norms.scale_part(peer_index, part_index))
                    if problem:
                        self._on_bad_average(peer_id, part_index, msg, problem)  # evidence, if it is signed
                    else:
                        with self.clock("checks"):
                            problem = self._receipts.problem(peer_id, self.group_id, peer_index, part_index, msg,
                                                             len(self.sender_peer_ids),
                                                             self.sender_peer_ids.index(self.peer_id), self.weight)
                    if problem:
                        logger.warning(f"Reducer {peer_id} returned {problem}; not applying its range")
                        self._on_bad_peer(peer_id, f"as a reducer it returned {problem}")
                        raise AllreduceException(f"{peer_id} returned {problem}")
                    if (peer_index, part_index) in self._audit_choice:
                        self.audit_targets.append((peer_id, part_index, msg))
                    self._outputs.register_processed_part(peer_index, part_index, average)
                    part_index += 1
                    if part_index == expected:
                        break  # all of its range: hang up now, the reducer holds the stream open until we do
            finally:
                await answers.aclose()  # closes the stream under it: our hang-up

            if part_index != expected:
                raise AllreduceException(f"peer {peer_id} sent {part_index} parts, but we expected {expected}")
        except BaseException as e:
            if isinstance(e, NotInRoundError):  # alive, still looking for its group: the round fails, not it
                logger.warning(f"Member {peer_id} runs no round of this group (it left matchmaking as the group "
                               "formed): the round ends now, to be run again with it")
                if peer_id in self.sender_peer_ids:
                    await self._ban_sender(peer_id)  # it sends no part either: no START_TIMEOUT_S wait for them
            elif isinstance(e, Exception):
                # the range this reducer owes us keeps our own values: say why, so a one-sided round is explained
                logger.warning(f"Reducer {peer_id} failed mid-round ({e!r}); its range keeps this peer's values")
                logger.debug(f"Caught {e!r} when communicating to {peer_id}", exc_info=True)
            if not isinstance(e, (asyncio.CancelledError, NotInRoundError)):  # cancelled: ended for another reason
                self.failed_reducers.add(peer_id)
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Reducer side: add one sender's parts into the running sums, answer each with the rounded average."""
        sender = self.sender_peer_ids[sender_index]

        def _deserialize(msg: averaging_pb2.AveragingData):
            # what our receipt names, and what we show the group's auditors (audit.py): only if we sign receipts
            kept = (msg.tensor_part, commitment(msg.tensor_part)) if self._receipts.signer is not None else None
            try:
                return self._timed.decode(msg.tensor_part), msg.weight, "", kept
            except WireFormatError as e:  # a broken or hostile sender: reject it like any other bad part
                return None, msg.weight, str(e), kept

        part_index = 0
        try:
            async for tensor_part, weight, undecodable, kept in amap_in_executor(
                _deserialize, stream, max_prefetch=self.tensor_part_container.prefetch
            ):
                if undecodable:
                    problem = f"part #{part_index}, which does not decode: {undecodable}"
                else:
                    with self.clock("checks"):
                        problem = self._check_part(part_index, tensor_part, weight)
                if problem:
                    logger.warning(f"Rejected a tensor part from {sender}: {problem}; excluding it from this round")
                    self._on_bad_peer(sender, f"it sent a bad tensor part: {problem}")
                    raise AllreduceException(f"{sender} sent a bad tensor part: {problem}")
                if kept is not None:
                    self._receipts.keep(part_index, sender_index, *kept, weight)
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                except BannedException:
                    logger.debug(f"Sender {sender} is already banned")
                    break  # sender was banned, we no longer need to aggregate it
                serialized = await self._serialize_average(part_index, averaged_part)
                reply = WireMessage(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized,
                                    peer_id=self._receipts.signatures.get(part_index, b""))
                part_index += 1
                yield reply
                self._parts_answered += 1
                if self._die_after_parts is not None and self._parts_answered >= self._die_after_parts:
                    logger.warning(f"fault injection: dying mid-all-reduce after {self._parts_answered} part(s)")
                    kill_this_peer()
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(sender)

    def _check_part(self, part_index: int, tensor_part: torch.Tensor, weight: float) -> str:
        """Why a sender's part must not enter the average, or an empty string if it may."""
        return self.tensor_part_reducer.part_problem(part_index, tensor_part, weight) or self._norms.check(
            ("received", part_index), tensor_part, self.parts_for_local_averaging[part_index], f"part #{part_index}",
            self._norms.scale_part(self.ordered_peer_ids.index(self.peer_id), part_index))

    async def _ban_sender(self, peer_id: PeerID):
        """Leave a sender out of the rest of this round's sums (it failed, timed out or sent a bad part): say so, with
        how far it got. Its stream of averages then ends short, and its round fails while the others commit."""
        index = self.sender_peer_ids.index(peer_id)
        if peer_id not in self.banned_senders and not self.tensor_part_reducer.finished.is_set():
            logger.warning(f"Leaving sender {peer_id} out of the rest of this round after "
                           f"{self.tensor_part_reducer.num_parts_received[index]} of its "
                           f"{self.tensor_part_reducer.num_parts} parts")
        await super()._ban_sender(peer_id)

    def finalize(self, **kwargs):
        super().finalize(**kwargs)
        self._serialized_averages.clear()
