"""The sparse round (``--compression sparse``): an all-gather of the members' 2-bit top-k messages, in the averager
process, in place of the butterfly all-reduce.

Each peer's top-k entries differ (4 peers' sets barely overlap: their union is 3.4x one set), so a reduce-scatter
over the dense range would not shrink what the reducers return; every member instead sends its message
(``sparse.py``, about 1.7% of fp16) to each other member, receives theirs, and decodes all of them itself. Per sync a
peer sends (n - 1) messages and receives as many: below the fp16 butterfly's 2 x (n - 1) / n x 2 bytes per
parameter up to 116 members (docs/bench/2026-11-26-sparse-entropy).

**Bit-identical.** Every member decodes the contributors' messages (members whose gathered weight is above 0) in
the group's order, adds them up in fp32 in that order and divides each entry by the number of messages that carry
it: the same bytes in the same order give the same bits everywhere (``average_messages``). A member with weight 0
(a newcomer joining the round in progress, a peer whose training diverged) sends nothing and receives everything.

**Streaming fragments.** A fragment's round is the same all-gather over the fragment's tensors: each fragment has
its own ``Layout`` (its tensors' chunks), and every piece names its fragment, which fixes the message's size before
this peer knows the group; a member whose pieces name another fragment than the round's has sent a bad message.

**Checked before use.** A piece is taken only from a member of a group this peer is in (or is forming: a faster
member may send before this one has its group), holding the swarm key and not excluded, with a piece count some
message of its fragment takes; a whole message must decode (``sparse.decode_entries``: a size within the layout's
bounds, one place per kept value, each inside its chunk, finite scales), once, and its norm must be at most
``max_norm_ratio`` x this peer's own message's. A member that sends a bad message is
excluded; one that sends nothing within ``START_TIMEOUT_S`` (or the round's timeout) has failed. Either way the round
is incomplete (``IncompleteRoundError``) on this member, which applies nothing and runs it again with the survivors,
exactly as after a failed reducer; a member that did get every message commits, and the others take its state.
"""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.p2p import PeerID
from hivemind.utils import get_logger

from p2ptrain.averaging.allreduce import START_TIMEOUT_S
from p2ptrain.averaging.compression import WireFormatError
from p2ptrain.averaging.context import AveragerContext
from p2ptrain.averaging.robust import weight_cap
from p2ptrain.averaging.round import IncompleteRoundError, RoundResult, claimed_weights
from p2ptrain.averaging.sparse import CHUNK, Layout, decode_entries, unchunk
from p2ptrain.faults import kill_this_peer
from p2ptrain.finite import all_finite
from p2ptrain.proto import p2ptrain_pb2

logger = get_logger(__name__)

PIECE_BYTES = 2 ** 20
"""one unary call carries at most this much of a message, well inside libp2p's 2 MiB limit"""
MAX_FORMING_GROUPS = 4
"""groups this peer is not (yet) a member of whose pieces it holds: a faster member may send before this one learned
its group; beyond this many, the oldest is dropped"""
MAX_FORMING_SENDERS = 64
"""senders whose pieces one such group may hold (its members are not known yet)"""
SEND_FAILED_GRACE_S = 1.0
"""once our message to a member could not be delivered, how long its own message still has to arrive"""
RECEIVE_POLL_S = 0.2
INBOX_TTL_S = 120.0
"""pieces of a group nobody asked for are dropped after this long"""


def average_messages(messages: Sequence[bytes], layout: Layout) -> List[torch.Tensor]:
    """Each entry's mean over the messages that carry it (zero where none does), summed in the given order: the
    same list of bytes gives the same bits on every peer. Raises ``WireFormatError`` for a message that does not
    decode (the round decodes each one alone first, to know whose it was, and averages those: ``average_entries``)."""
    return average_entries([decode_entries(message, layout) for message in messages], layout)


def average_entries(entries: Sequence[Tuple[torch.Tensor, torch.Tensor]], layout: Layout) -> List[torch.Tensor]:
    """``average_messages`` of messages already decoded (``decode_entries``: places and values)."""
    total = torch.zeros(layout.num_chunks * CHUNK)  # in chunk space: one scatter per message, one unchunk at the end
    count = torch.zeros(layout.num_chunks * CHUNK)
    for at, value in entries:  # each place once per message: the sums run in message order
        total.index_add_(0, at, value)
        count.index_add_(0, at, (value != 0).float())
    return unchunk(total.div_(count.clamp_(min=1.0)).view(-1, CHUNK), layout)


class _Inbox:
    """The pieces received for one group: sender -> pieces so far, and a future per sender set once its whole
    message is in."""

    def __init__(self) -> None:
        self.pieces: Dict[PeerID, Dict[int, bytes]] = {}
        self.done: Dict[PeerID, asyncio.Future] = {}
        self.members: Optional[Tuple[PeerID, ...]] = None  # set once this peer runs the group's round
        self.fragment: Optional[int] = None  # the round's fragment, set with ``members``
        self.fragment_of: Dict[PeerID, int] = {}  # the fragment each sender's pieces named
        self.count_of: Dict[PeerID, int] = {}  # the piece count each sender's pieces named
        self.created = time.monotonic()

    def future(self, peer: PeerID) -> asyncio.Future:
        if peer not in self.done:
            self.done[peer] = asyncio.get_event_loop().create_future()
        return self.done[peer]


class SparseGather:
    """The averager's side of sparse rounds: ``take_piece`` (``rpc_sparse_piece``) takes other members' pieces,
    ``run`` sends ours and averages everyone's. ``layout`` covers all parameters (None: not the sparse codec),
    ``layouts`` has one per fragment."""

    def __init__(self, context: AveragerContext, layout: Optional[Layout], fragments: Sequence[Sequence[int]],
                 max_norm_ratio: Optional[float]) -> None:
        # created in the host before the averager process is forked: the host writes each round's message into the
        # outbox (shared memory), the averager process reads it when the round's group has formed
        self._context = context
        self.max_norm_ratio = max_norm_ratio
        self.layout = layout
        self.layouts = [] if layout is None else [
            Layout(tuple(layout.shapes[i] for i in fragment), layout.k) for fragment in fragments]
        size = max((f.max_message_bytes for f in self.layouts), default=0)
        self.outbox = torch.zeros(size, dtype=torch.uint8).share_memory_()
        self._outbox_bytes = mp.Value(ctypes.c_int64, 0)  # the length of the message in it
        self._inboxes: Dict[bytes, _Inbox] = {}
        self._finished: Dict[bytes, float] = {}  # group id -> when its round ended here

    def write_message(self, message: bytes) -> None:
        """The host's message for the next round (of the fragment it is for: its size says which)."""
        self.outbox[:len(message)].copy_(torch.frombuffer(bytearray(message), dtype=torch.uint8))
        self._outbox_bytes.value = len(message)

    def take_piece(self, request: p2ptrain_pb2.SparsePiece, peer: PeerID) -> p2ptrain_pb2.SparseAck:
        """``rpc_sparse_piece``: a piece of ``peer``'s message for a group, taken if it may be."""
        refused = p2ptrain_pb2.SparseAck(accepted=False)
        if self.layout is None or self._context.is_banned(peer) or \
                not self._context.auth.admits(peer, request.admission):
            return refused
        if request.fragment >= len(self.layouts):
            self._context.ban(peer, f"it sent a sparse piece of fragment {request.fragment}, of {len(self.layouts)}")
            return refused
        layout = self.layouts[request.fragment]
        count = request.pieces  # every piece but the last is PIECE_BYTES long; the message's own size is decode's
        if not _pieces(layout.min_message_bytes) <= count <= _pieces(layout.max_message_bytes) or \
                request.index >= count or not 0 < len(request.data) <= PIECE_BYTES or \
                request.index < count - 1 and len(request.data) != PIECE_BYTES:
            self._context.ban(peer, f"it sent a sparse piece that does not fit the message ({request.index} of "
                                    f"{request.pieces}, {len(request.data)} bytes, fragment {request.fragment})")
            return refused
        self._drop_stale()
        if request.group_id in self._finished:  # a late piece of a round that is over
            return refused
        inbox = self._inboxes.get(request.group_id)
        if inbox is None:
            forming = [g for g, box in self._inboxes.items() if box.members is None]
            if len(forming) >= MAX_FORMING_GROUPS:
                del self._inboxes[min(forming, key=lambda g: self._inboxes[g].created)]
            inbox = self._inboxes[request.group_id] = _Inbox()
        if inbox.members is not None and peer not in inbox.members or \
                inbox.members is None and peer not in inbox.pieces and len(inbox.pieces) >= MAX_FORMING_SENDERS:
            return refused
        if inbox.fragment_of.setdefault(peer, request.fragment) != request.fragment or \
                inbox.fragment is not None and request.fragment != inbox.fragment:
            self._refuse_fragment(inbox, peer, request.fragment)
            return refused
        if inbox.count_of.setdefault(peer, count) != count:
            self._context.ban(peer, f"it sent pieces of one message counting {inbox.count_of[peer]} and {count} "
                                    "pieces")
            return refused
        pieces = inbox.pieces.setdefault(peer, {})
        pieces[request.index] = request.data
        if len(pieces) == count and not inbox.future(peer).done():
            inbox.future(peer).set_result(b"".join(pieces[i] for i in range(count)))
        return p2ptrain_pb2.SparseAck(accepted=True)

    def _refuse_fragment(self, inbox: _Inbox, peer: PeerID, fragment: int) -> None:
        """``peer``'s pieces for this group name another fragment than its round's (or than its own earlier
        pieces): its message is refused, and the round fails on it at once rather than after a timeout."""
        first = inbox.fragment_of.get(peer)
        if first != -1:  # -1: refused (and excluded) already, before this peer knew the group
            self._context.ban(peer, f"it sent pieces of fragment {fragment} in a round of fragment {inbox.fragment}"
                              if inbox.fragment is not None else
                              f"it sent pieces of fragment {fragment} after pieces of fragment {first} for one group")
        inbox.pieces.pop(peer, None)
        inbox.fragment_of[peer] = -1  # no fragment: refused again when the round starts, if it has not yet
        if inbox.members is not None and not inbox.future(peer).done():
            inbox.future(peer).set_exception(WireFormatError(f"pieces of the wrong fragment ({fragment})"))

    async def _receive(self, inbox: _Inbox, senders: Sequence[PeerID], sends: Dict[PeerID, asyncio.Task],
                              timeout_s: float, failed: List[str]) -> Dict[PeerID, bytes]:
        """Every sender's whole message, as it comes. A sender has failed (added to ``failed``) when its message is
        not whole by ``timeout_s``, when nothing of it came in ``START_TIMEOUT_S``, or ``SEND_FAILED_GRACE_S`` after
        our own message to it could not be delivered (its peer is gone: a killed member cost the survivors the
        whole round timeout before)."""
        started = time.monotonic()
        pending = {peer: inbox.future(peer) for peer in senders}
        received: Dict[PeerID, bytes] = {}
        send_failed_at: Dict[PeerID, float] = {}
        while pending:
            now = time.monotonic()
            for peer, future in list(pending.items()):
                if future.done():
                    if future.exception() is None:
                        received[peer] = future.result()
                    else:  # refused as it came (_refuse_fragment)
                        failed.append(peer.to_base58())
                    del pending[peer]
                    continue
                if _send_failed(sends.get(peer)):
                    send_failed_at.setdefault(peer, now)
                if now - started >= timeout_s or peer not in inbox.pieces and now - started >= START_TIMEOUT_S or \
                        now - send_failed_at.get(peer, now) >= SEND_FAILED_GRACE_S:
                    failed.append(peer.to_base58())
                    del pending[peer]
            await _wait_any(list(pending.values()), RECEIVE_POLL_S)
        return received

    def _drop_stale(self) -> None:
        now = time.monotonic()
        for group_id, inbox in list(self._inboxes.items()):
            if inbox.members is None and now - inbox.created > INBOX_TTL_S:
                del self._inboxes[group_id]
        for group_id, ended in list(self._finished.items()):
            if now - ended > INBOX_TTL_S:
                del self._finished[group_id]

    async def _send(self, peer: PeerID, group_id: bytes, message: bytes, fragment: int = 0) -> bool:
        stub = self._context.stub(peer)
        admission = self._context.auth.token(self._context.peer_id)
        count = _pieces(len(message))
        for index in range(count):
            ack = await stub.rpc_sparse_piece(p2ptrain_pb2.SparsePiece(
                group_id=group_id, index=index, pieces=count, admission=admission, fragment=fragment,
                data=message[index * PIECE_BYTES:(index + 1) * PIECE_BYTES]))
            if not ack.accepted:
                return False
        return True

    async def run(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo,
                                weights: Sequence[float], timeout_s: float, fragment: int = 0,
                                die_after_sends: Optional[int] = None) -> Tuple[int, int, List[str]]:
        """Send our message to every other member, take theirs, and write the average into ``tensors`` (the tensors
        of ``fragment``; only if every contributor's message came and decoded). Returns (bytes sent, bytes received,
        the members that failed: empty when the round completed). ``die_after_sends`` (fault injection, ``faults.py``): deliver our
        message to that many members, in the group's order, then die: they hold it, the others never will."""
        members = tuple(group_info.peer_ids)
        me = members.index(self._context.peer_id)
        inbox = self._inboxes.setdefault(group_info.group_id, _Inbox())
        inbox.members, inbox.fragment = members, fragment
        # pieces sent before we knew the group: from a non-member they are dropped now, of another fragment refused
        for peer in [p for p in inbox.pieces if p not in members]:
            del inbox.pieces[peer]
        for peer in [p for p, f in inbox.fragment_of.items() if f != fragment and p in members]:
            self._refuse_fragment(inbox, peer, inbox.fragment_of[peer])
        layout = self.layouts[fragment]
        contributors = [i for i, w in enumerate(weights) if w > 0]
        message = bytes(self.outbox[:self._outbox_bytes.value].numpy()) if weights[me] > 0 else b""
        others = [peer for i, peer in enumerate(members) if i != me]
        failed: List[str] = []
        if die_after_sends is not None and message:
            for peer in others[:die_after_sends]:
                await self._send(peer, group_info.group_id, message, fragment)
            logger.warning(f"fault injection: dying mid-all-reduce after sending its sparse message to "
                           f"{min(die_after_sends, len(others))} member(s)")
            kill_this_peer()
        try:
            sends = {peer: asyncio.create_task(asyncio.wait_for(
                self._send(peer, group_info.group_id, message, fragment), timeout_s))
                for peer in others} if message else {}
            received = await self._receive(inbox, [members[i] for i in contributors if i != me], sends,
                                                  timeout_s, failed)
            received = {i: received[members[i]] for i in contributors if members[i] in received}
            sent_ok = await asyncio.gather(*sends.values(), return_exceptions=True)
            for peer, ok in zip(sends, sent_ok):
                if ok is not True and peer.to_base58() not in failed:
                    logger.debug(f"sparse message to {peer} not delivered: {ok!r}")
            if failed:
                return len(message) * len(sends), sum(map(len, received.values())), failed
            ordered = [message if i == me else received[i] for i in contributors]
            own_norm = _norm(decode_entries(message, layout)[1]) if message else None
            entries = []  # each message decoded once: checked here, averaged below
            for i, data in zip(contributors, ordered):
                try:
                    entries.append(decode_entries(data, layout))
                except WireFormatError as e:
                    self._context.ban(members[i], f"its sparse message does not decode ({e})")
                    failed.append(members[i].to_base58())
                    continue
                norm = _norm(entries[-1][1])  # each place once in a message: its values' norm is the tensors'
                bound = None if own_norm is None or self.max_norm_ratio is None else self.max_norm_ratio * own_norm
                if bound is not None and i != me and own_norm > 0 and norm > bound:
                    self._context.ban(members[i], f"its sparse message's norm {norm:.3g} is above "
                                                  f"{self.max_norm_ratio:g}x ours ({own_norm:.3g})")
                    failed.append(members[i].to_base58())
            if failed:
                return len(message) * len(sends), sum(map(len, received.values())), failed
            averaged = await asyncio.get_event_loop().run_in_executor(
                None, average_entries, entries, layout)
            if not all(all_finite(t) for t in averaged):
                raise WireFormatError("the sparse average has NaN/inf values")  # unreachable with checked scales
            for tensor, value in zip(tensors, averaged):
                tensor.copy_(value)
            return len(message) * len(sends), sum(map(len, received.values())), []
        finally:
            self._inboxes.pop(group_info.group_id, None)
            self._finished[group_info.group_id] = time.monotonic()


    async def run_group(self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, gathered: Dict[str, Any],
                        timeout_s: float, fragment: int, die_after_sends: Optional[int],
                        record_failed: Callable[[List[str]], None]) -> RoundResult:
        """A formed group's sparse round (``run``, each member weighing its claim, capped): ``tensors`` (the
        fragment's) get the group's average, or nothing if a member's message did not come or was refused; then
        ``IncompleteRoundError``, like a failed reducer, after handing the failed members to ``record_failed`` (the
        host runs the round again with the survivors)."""
        weights = claimed_weights(group_info, gathered)  # every member reads the same: the same contributors
        cap = weight_cap(weights)  # a weight is the member's own claim (robust.py)
        weights = [min(weight, cap) for weight in weights]
        sent, received, failed = await self.run(tensors, group_info, weights, timeout_s, fragment, die_after_sends)
        if failed:
            record_failed(failed)
            raise IncompleteRoundError(f"the sparse messages of {len(failed)} member(s) did not come or were refused "
                                       "(a group member failed mid-round); nothing applied")
        return RoundResult(group_size=len(group_info.peer_ids), bytes_sent=sent, bytes_received=received)


def _pieces(message_bytes: int) -> int:
    """Unary calls a message of this many bytes takes."""
    return max(1, -(-message_bytes // PIECE_BYTES))


async def _wait_any(futures, timeout_s: float) -> None:
    if futures:
        await asyncio.wait([asyncio.shield(f) for f in futures], timeout=timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)


def _send_failed(send: Optional[asyncio.Task]) -> bool:
    """Our message could not be delivered to that member (its peer is gone), as opposed to refused or pending."""
    return send is not None and send.done() and not send.cancelled() and send.exception() is not None


def _norm(values: torch.Tensor) -> float:
    return float(values.double().pow(2).sum().sqrt())
