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

It also counts the payload bytes it sends and receives, and rejects a sender's part that has the wrong shape, a
non-finite value, a bad weight or a norm above ``max_norm_ratio`` times the reducer's own part over the same range,
instead of letting one peer poison the average; a sender rejects a reducer's average on the same grounds (then that
range counts as failed and the round is run again without it). Either way the peer is reported to ``on_bad_peer``
(the averager bans it from its groups for a while).
"""

from __future__ import annotations

import asyncio
import math
from typing import AsyncIterator, Callable, Dict, List, Optional, Sequence

import torch
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartContainer
from hivemind.compression import CompressionInfo
from hivemind.p2p import PeerID, StubBase
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_logger
from hivemind.utils.asyncio import amap_in_executor, attach_event_on_finished

from p2ptrain.hivemind_compat import own_input_part, own_input_part_shapes
from p2ptrain.averaging.compression import WireCodec, WireFormatError
from p2ptrain.averaging.audit import check_receipt, choose_audits, commitment, make_receipt
from p2ptrain.averaging.evidence import AverageSigner, verified_receipt
from p2ptrain.averaging.reducer import Reducer
from p2ptrain.clock import PhaseClock
from p2ptrain.faults import kill_this_peer
from p2ptrain.finite import all_finite

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
                 weight_cap: float = math.inf,
                 signer: Optional[AverageSigner] = None,
                 on_bad_average: Optional[Callable[[PeerID, int, averaging_pb2.AveragingData, str], None]] = None,
                 require_receipts: bool = False, audit_parts: int = 0,
                 **kwargs):
        super().__init__(**kwargs)
        self.tensor_part_reducer.__class__ = Reducer  # same state, its methods changed (reducer.py)
        self.tensor_part_reducer.aggregation = aggregation
        self.tensor_part_reducer.weight_cap = weight_cap  # robust.weight_cap of the group's gathered weights
        self.tensor_part_reducer.contributions = {}
        self.tensor_part_reducer.current_included = []
        self.tensor_part_reducer.included_by_part = {}
        self._aggregation, self._weight_cap = aggregation, weight_cap
        # a part (or an average) whose L2 norm exceeds max_norm_ratio x our own values' norm over the same range is
        # refused: we are honest, and honest peers' pseudo-gradients over one range are alike in size
        self._max_norm_ratio = max_norm_ratio
        self._on_bad_peer = on_bad_peer or (lambda peer, reason: None)
        # evidence.py: our averages go out signed; a signed average we refuse goes to on_bad_average (evidence)
        self._signer = signer
        self._on_bad_average = on_bad_average or (lambda reducer, part_index, message, reason: None)
        self._signatures: Dict[int, bytes] = {}
        # audit.py. As a reducer (with a signer): each input's commitment and weight, and the input itself, kept for
        # the group's auditors; as a sender: the commitment of each part we sent, to find in every answer's receipt
        # (required with ``require_receipts``), and the answers of the parts we audit after the round
        self._require_receipts = require_receipts
        self._commitments: Dict[tuple, tuple] = {}  # (part index, sender index) -> (commitment, weight)
        self.kept_inputs: Dict[tuple, runtime_pb2.Tensor] = {}  # (part index, sender index) -> the part as it came
        self._reducer_keys: dict = {}  # the reducers' public keys checked so far (evidence._verify)
        self._sent: Dict[tuple, bytes] = {}  # (reducer index, part index) -> our part's commitment
        self.audit_targets: List[tuple] = []  # (reducer, part index, its answer)
        self._own_norms: Dict[tuple, float] = {}
        # ... or, for a range where our own values happen to be small (a bias of 2 values whose steps cancelled out),
        # than the ratio times what our whole vector holds per value over that many values: over a few values, two
        # honest peers' norms can differ by any factor, and refusing one split a group (seen in CI)
        local = list(self.tensor_part_container.local_tensors)
        values = sum(t.numel() for t in local)
        squares = sum(float(torch.linalg.vector_norm(t.float())) ** 2 for t in local)
        self._own_rms = math.sqrt(squares / values) if values else 0.0
        self._codec = self.tensor_part_container.compression
        # mixing groups average stepped states (parameters, momenta), not pseudo-gradients: honest members' values
        # are alike in size there, but a peer must not move them by more than a pseudo-gradient round could. So a
        # value's distance from our own is held to max_norm_ratio x ``deviation_scale`` (our pseudo-gradient, of
        # the same shapes) over the same range: one member shifts a group of n by at most ratio x that / n, the
        # bound of a pseudo-gradient round
        self._scale_parts: Optional[List[List[torch.Tensor]]] = None
        if deviation_scale is not None:
            scale = TensorPartContainer(deviation_scale, self.tensor_part_container.peer_fractions, self._codec,
                                        part_size_bytes=self.tensor_part_container.part_size_bytes)
            self._scale_parts = [[own_input_part(scale, peer, part) for part in range(len(shapes))]
                                 for peer, shapes in enumerate(own_input_part_shapes(scale))]
            squares = sum(float(torch.linalg.vector_norm(t.float())) ** 2 for t in deviation_scale)
            self._own_rms = math.sqrt(squares / values) if values else 0.0
        if not isinstance(self._codec, WireCodec):
            raise TypeError(f"ExactAllReduceRunner needs a p2ptrain WireCodec, got {self._codec!r}")
        self.clock = PhaseClock()
        """CPU seconds of each kind of work in this round (``RoundResult.phases``), summed over threads"""
        self.tensor_part_container.compression = _TimedEncoder(self._codec, self)  # our parts, as hivemind cuts them
        # shape of each part of each reducer's range: an average that comes back in another shape is a failure
        self._part_shapes_by_peer = own_input_part_shapes(self.tensor_part_container)
        # the parts of other reducers' ranges we audit after the round, drawn now with our own secret randomness
        self._audit_choice = choose_audits(self.tensor_part_container.num_parts_by_peer,
                                           self.ordered_peer_ids.index(self.peer_id), audit_parts)
        # fault injection (p2ptrain.faults): SIGKILL this peer after answering that many averaged parts
        self._die_after_parts = die_after_parts
        self._parts_answered = 0
        # outputs are averages, so a failed reducer's parts must fall back to the local values, not to zero deltas
        self.tensor_part_container.return_deltas = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self.failed_reducers: set = set()
        """reducers whose range did not come back (dead, timed out or refused): the host leaves them out of its
        retry's expected group, so the survivors regroup at once instead of waiting for them"""
        # part_index -> the average of that part, serialized once and shared by every sender and by ourselves
        self._serialized_averages: Dict[int, asyncio.Future] = {}
        # senders whose stream of averages we are still answering (see wait_until_senders_served)
        self._streams_open = 0
        self._senders_served = asyncio.Event()
        self._senders_served.set()

    def _encode(self, tensor: torch.Tensor) -> runtime_pb2.Tensor:
        with self.clock("encode"):
            return self._codec.compress(tensor, CompressionInfo.from_tensor(tensor))

    def _decode(self, message: runtime_pb2.Tensor) -> torch.Tensor:
        with self.clock("decode"):
            return self._codec.extract(message)

    def _roundtrip(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a reducer receives of our own ``tensor`` (the codec's direct path: int8 builds no message)."""
        with self.clock("encode"):
            return self._codec.roundtrip(tensor)

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
                # the sender's hang-up cancels this wait (hivemind's stream handler sees the end of its input)
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

    async def _serialize_average(self, part_index: int, averaged_part: torch.Tensor) -> runtime_pb2.Tensor:
        """Compress the average of one part once (and sign it, with a signer); every caller for that part gets the
        same message."""
        if part_index not in self._serialized_averages:
            loop = asyncio.get_event_loop()
            self._serialized_averages[part_index] = loop.run_in_executor(None, self._encode_and_sign, part_index,
                                                                         averaged_part)
        return await self._serialized_averages[part_index]

    def _encode_and_sign(self, part_index: int, averaged_part: torch.Tensor) -> runtime_pb2.Tensor:
        message = self._encode(averaged_part)
        if self._signer is not None:
            with self.clock("sign"):
                # the receipt: what went into this average (every sender's commitment and weight), signed with it
                included = set(self.tensor_part_reducer.included_by_part.get(part_index, ()))
                entries = [self._commitments.get((part_index, i)) if i in included else None
                           for i in range(self.tensor_part_reducer.num_senders)]
                receipt = make_receipt(entries, self._weight_cap, self._aggregation)
                self._signatures[part_index] = self._signer.sign(self.group_id, part_index, receipt, message)
        return message

    def _encode_own(self, tensor_part: torch.Tensor) -> tuple:
        """Our own part as a reducer that signs receipts: its message (kept for audits), commitment and decoded
        values (what any other reducer would have received of it)."""
        with self.clock("encode"):
            message = self._codec.compress(tensor_part, CompressionInfo.from_tensor(tensor_part))
            committed = commitment(message)
        return message, committed, self._decode(message)

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        """hivemind's, recording each part's commitment: the reducer's receipt must name it (audit.py). A hash of
        the buffer in place: 0.3 ms per 512 KiB part, not worth a trip through the executor's queue."""
        part_index = 0
        async for message in super()._generate_input_for_peer(peer_index):
            with self.clock("checks"):
                self._sent[(peer_index, part_index)] = commitment(message.tensor_part)
            part_index += 1
            yield message

    def _receipt_problem(self, reducer: PeerID, peer_index: int, part_index: int,
                         message: averaging_pb2.AveragingData) -> str:
        """Why an answer's signature or receipt is refused (empty if it is not, or if it has none and none is
        required): the reducer must have signed it, and its receipt must hold our part as we sent it."""
        if not message.peer_id:
            return "an unsigned average (this swarm's reducers sign theirs)" if self._require_receipts else ""
        receipt = verified_receipt(reducer, self.group_id, part_index, message.peer_id, message.tensor_part,
                                   self._reducer_keys)
        if receipt is None:
            return "an average that it did not sign"
        return check_receipt(receipt, senders=len(self.sender_peer_ids), me=self.sender_peer_ids.index(self.peer_id),
                             sent=self._sent.get((peer_index, part_index), b""), weight=self.weight,
                             weight_cap=self._weight_cap, aggregation=self._aggregation)

    def _get_peer_stub(self, peer: PeerID) -> StubBase:
        return _CountingStub(super()._get_peer_stub(peer), self)

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
            if self._signer is not None:  # and into our receipts, like any other sender's (audit.py)
                kept, committed, rounded_part = await loop.run_in_executor(None, self._encode_own, tensor_part)
                self._commitments[(part_index, sender_index)] = (committed, self.weight)
                self.kept_inputs[(part_index, sender_index)] = kept
            else:
                rounded_part = await loop.run_in_executor(None, self._roundtrip, tensor_part)
            averaged_part = await self.tensor_part_reducer.accumulate_part(
                sender_index, part_index, rounded_part, weight=self.weight
            )
            serialized = await self._serialize_average(part_index, averaged_part)
            # use exactly what the other senders receive: decompress(compress(average))
            self.tensor_part_container.register_processed_part(peer_index, part_index, self._decode(serialized))

    async def _communicate_with_remote_reducer(self, peer_id: PeerID):
        """Sender side: stream our parts of that reducer's range to it, register the averages it answers.

        hivemind's ``AllReduceRunner._communicate_with_peer`` (1.1.12) with two changes: answers are decoded with
        the group's codec, and an answer of the wrong shape fails that reducer instead of the whole round."""
        peer_index = self.ordered_peer_ids.index(peer_id)
        try:
            done_sending = asyncio.Event()
            inputs_aiter = attach_event_on_finished(self._generate_input_for_peer(peer_index), done_sending)
            stream = await self._get_peer_stub(peer_id).rpc_aggregate_part(inputs_aiter)

            if self.should_delay_results(self.peer_id):
                await done_sending.wait()

            part_index = 0
            expected_shapes = self._part_shapes_by_peer[peer_index]
            expected = self.tensor_part_container.num_parts_by_peer[peer_index]

            def _try_deserialize(msg):
                if msg.code != averaging_pb2.AVERAGED_PART:
                    raise AllreduceException(f"{peer_id} sent {averaging_pb2.MessageCode.Name(msg.code)}")
                try:
                    return msg, self._decode(msg.tensor_part), ""
                except WireFormatError as e:
                    return msg, None, str(e)

            # a reducer that runs the round answers its first part within the start timeout (it leaves out a sender
            # that sent nothing by then) plus one part's way: one that does not is not running it
            first_answer_s = 2 * self._start_timeout()
            if self.reducer_timeout is not None:
                first_answer_s = min(first_answer_s, self.reducer_timeout)
            answers = amap_in_executor(
                _try_deserialize,
                _aiter_with_timeouts(stream, first_answer_s, self.reducer_timeout),
                max_prefetch=self.tensor_part_container.prefetch,
            )
            try:
                async for msg, average, undecodable in answers:
                    if undecodable:
                        problem = f"an average for part #{part_index} that does not decode: {undecodable}"
                    elif part_index >= len(expected_shapes) or average.shape != expected_shapes[part_index]:
                        problem = f"an average of shape {tuple(average.shape)} for part #{part_index}"
                    else:
                        own = own_input_part(self.tensor_part_container, peer_index, part_index)
                        with self.clock("checks"):
                            problem = self._check_values(("sent", peer_index, part_index), average, own,
                                                         f"an average for part #{part_index}",
                                                         self._scale_part(peer_index, part_index))
                    if problem:
                        self._on_bad_average(peer_id, part_index, msg, problem)  # evidence, if it is signed
                    else:
                        with self.clock("checks"):
                            problem = self._receipt_problem(peer_id, peer_index, part_index, msg)
                    if problem:
                        logger.warning(f"Reducer {peer_id} returned {problem}; not applying its range")
                        self._on_bad_peer(peer_id, f"as a reducer it returned {problem}")
                        raise AllreduceException(f"{peer_id} returned {problem}")
                    if (peer_index, part_index) in self._audit_choice:
                        self.audit_targets.append((peer_id, part_index, msg))
                    self.tensor_part_container.register_processed_part(peer_index, part_index, average)
                    part_index += 1
                    if part_index == expected:
                        break  # all of its range: hang up now, the reducer holds the stream open until we do
            finally:
                await answers.aclose()  # closes the stream under it: our hang-up

            if part_index != expected:
                raise AllreduceException(f"peer {peer_id} sent {part_index} parts, but we expected {expected}")
        except BaseException as e:
            if isinstance(e, Exception):
                # the range this reducer owes us keeps our own values: say why, so a one-sided round is explained
                logger.warning(f"Reducer {peer_id} failed mid-round ({e!r}); its range keeps this peer's values")
                logger.debug(f"Caught {e!r} when communicating to {peer_id}", exc_info=True)
            if not isinstance(e, asyncio.CancelledError):  # cancelled: the round ended for another reason
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
            kept = (msg.tensor_part, commitment(msg.tensor_part)) if self._signer is not None else None
            try:
                return self._decode(msg.tensor_part), msg.weight, msg.ByteSize(), "", kept
            except WireFormatError as e:  # a broken or hostile sender: reject it like any other bad part
                return None, msg.weight, msg.ByteSize(), str(e), kept

        part_index = 0
        try:
            async for tensor_part, weight, num_bytes, undecodable, kept in amap_in_executor(
                _deserialize, stream, max_prefetch=self.tensor_part_container.prefetch
            ):
                self.bytes_received += num_bytes  # counted here, in the event loop, not in the executor thread
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
                    self.kept_inputs[(part_index, sender_index)], committed = kept
                    self._commitments[(part_index, sender_index)] = (committed, weight)
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                except BannedException:
                    logger.debug(f"Sender {sender} is already banned")
                    break  # sender was banned, we no longer need to aggregate it
                serialized = await self._serialize_average(part_index, averaged_part)
                reply = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized,
                                                    peer_id=self._signatures.get(part_index, b""))
                part_index += 1
                self.bytes_sent += reply.ByteSize()
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
        if part_index >= self.tensor_part_reducer.num_parts:
            return f"part #{part_index}, beyond the {self.tensor_part_reducer.num_parts} parts of this reducer"
        expected_shape = self.tensor_part_reducer.part_shapes[part_index]
        if tensor_part.shape != expected_shape:
            return f"part #{part_index} of shape {tuple(tensor_part.shape)}, expected {tuple(expected_shape)}"
        if not (math.isfinite(weight) and weight >= 0):
            return f"a weight of {weight}, not a finite non-negative number"
        own = self.parts_for_local_averaging[part_index]
        return self._check_values(("received", part_index), tensor_part, own, f"part #{part_index}",
                                  self._scale_part(self.ordered_peer_ids.index(self.peer_id), part_index))

    def _scale_part(self, peer_index: int, part_index: int) -> Optional[torch.Tensor]:
        """``deviation_scale`` over part ``part_index`` of the range reduced by ``peer_index`` (None without one)."""
        return None if self._scale_parts is None else self._scale_parts[peer_index][part_index]

    def _check_values(self, key: tuple, values: torch.Tensor, own: torch.Tensor, what: str,
                      scale: Optional[torch.Tensor] = None) -> str:
        """Why ``values`` (a peer's part, or an average a reducer sent) must not be used: non-finite, or larger
        than ``max_norm_ratio`` times our own values over the same range (or, if larger, times our whole vector's
        RMS over as many values). With ``scale`` (mixing groups): their distance from our own values, against
        ``scale``'s norm instead. Empty if they may.

        One read of ``values`` in the usual case: their L2 norm is finite only if every value is (a NaN or an
        infinity makes it NaN or infinite); only a non-finite norm (poison, or finite values so large that their
        squares overflow) takes a second read to tell which."""
        norm = float(torch.linalg.vector_norm(values.float()))
        if not math.isfinite(norm) and not all_finite(values):
            return f"{what} with NaN or infinite values"
        if self._max_norm_ratio is None:
            return ""
        if scale is not None:
            norm = float(torch.linalg.vector_norm(values.float() - own.float()))
        if key not in self._own_norms:
            self._own_norms[key] = float(torch.linalg.vector_norm((own if scale is None else scale).float()))
        own_norm = max(self._own_norms[key], self._own_rms * math.sqrt(values.numel()))
        if own_norm > 0 and norm > self._max_norm_ratio * own_norm:
            if scale is not None:
                return (f"{what} at a distance {norm:.4g} from our own values, more than {self._max_norm_ratio:g}x "
                        f"our pseudo-gradient's norm {own_norm:.4g} over the same range")
            return (f"{what} with norm {norm:.4g}, more than {self._max_norm_ratio:g}x our own {own_norm:.4g} over "
                    "the same range")
        return ""

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


async def _aiter_with_timeouts(iterable, first_s: Optional[float], next_s: Optional[float]):
    """hivemind's ``aiter_with_timeout``, with a timeout of its own for the first item."""
    iterator = iterable.__aiter__()
    timeout = first_s
    while True:
        try:
            item = await asyncio.wait_for(iterator.__anext__(), timeout=timeout)
        except StopAsyncIteration:
            break
        yield item
        timeout = next_s


class _CountingStub:
    """Wraps a peer stub so that the bytes of ``rpc_aggregate_part`` in both directions are counted."""

    def __init__(self, stub: StubBase, runner: ExactAllReduceRunner):
        self._stub, self._runner = stub, runner

    async def rpc_aggregate_part(self, requests: AsyncIterator[averaging_pb2.AveragingData], *args, **kwargs):
        stream = await self._stub.rpc_aggregate_part(self._count_sent(requests), *args, **kwargs)
        return self._count_received(stream)

    async def _count_sent(self, requests):
        async for msg in requests:
            self._runner.bytes_sent += msg.ByteSize()
            yield msg

    async def _count_received(self, stream):
        async for msg in stream:
            self._runner.bytes_received += msg.ByteSize()
            yield msg


class _TimedEncoder:
    """The runner's codec as ``TensorPartContainer`` sees it: ``compress`` counted in the runner's ``encode``."""

    def __init__(self, codec: WireCodec, runner: ExactAllReduceRunner):
        self._codec, self._runner = codec, runner

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False):
        with self._runner.clock("encode"):
            return self._codec.compress(tensor, info, allow_inplace)

    def __getattr__(self, name):
        return getattr(self._codec, name)
