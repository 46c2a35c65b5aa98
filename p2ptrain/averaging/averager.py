"""One averaging round over the swarm: hivemind's matchmaking, p2ptrain's exact all-reduce.

The averager holds its parts (audits, evidence, state donor and download, sparse gather), each built with one
``AveragerContext`` (context.py). hivemind registers the ``rpc_*`` methods of the averager's class as the peer's
handlers (``ServicerBase``), so those stay here, each handing the request to its part."""

from __future__ import annotations

import asyncio
import time
from functools import partial
from typing import Any, AsyncIterator, Dict, Iterable, List, Optional, Sequence

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, get_logger
from hivemind.utils.asyncio import enter_asynchronously

from p2ptrain.averaging.allreduce import ExactAllReduceRunner
from p2ptrain.averaging.admission import Admission
from p2ptrain.averaging.audit import AUDIT_PARTS, Audits
from p2ptrain.averaging.bans import Bans
from p2ptrain.averaging.butterfly import run_butterfly
from p2ptrain.averaging.compression import SPARSE, WireCodec, get_compression
from p2ptrain.averaging.context import AveragerContext
from p2ptrain.averaging.evidence import BAN_S, Evidence
from p2ptrain.averaging.flat_outputs import OutputBufferSlot
from p2ptrain.averaging.matchmaking import SteeredMatchmaking
from p2ptrain.averaging.part_size import RATE_KEY, round_part_size
from p2ptrain.averaging.part_stream import handler_name, linger_after_refusal, serve_part_stream
from p2ptrain.averaging.plan import RoundReport, SharedRoundPlan, act_as
from p2ptrain.averaging.process import enter_averager_process, leave_averager_process
from p2ptrain.averaging.replay_serving import ReplayServing
from p2ptrain.averaging.robust import check_aggregation, weight_cap
from p2ptrain.averaging.round import (IncompleteRoundError, RoundResult, claimed_weights, mixes_states,
                                      own_norm_scale, read_gathered, schema_hash)
from p2ptrain.averaging.sender_scores import SenderChecks
from p2ptrain.averaging.sparse import Layout
from p2ptrain.averaging.sparse_round import SparseGather
from p2ptrain.averaging.state_donor import StateDonor
from p2ptrain.averaging.state_transfer import DownloadedState, StateDownload
from p2ptrain.faults import fault_from_env
from p2ptrain.hivemind_compat import (check_hivemind, current_state_from_host, group_key_prefix,
                                      matchmaking_of, p2p_of, register_runner, send_to_averager_process)
from p2ptrain.proto import p2ptrain_pb2
from p2ptrain.security import SwarmAuth

logger = get_logger(__name__)


class PseudoGradientAverager(DecentralizedAverager):
    """Averages a fixed set of CPU tensors with the peers that are ready at the same time.

    Unlike its hivemind parent, the result is identical on every peer of a group (see ``ExactAllReduceRunner``),
    the tensors are only overwritten when the round succeeded end to end (a failed round leaves them untouched,
    so a retry never averages a half-averaged vector), and ``step`` returns a ``RoundResult``.
    Peers that use a different compression or protocol version never end up in one group: both are part of
    the schema hash that matchmaking compares. Newcomers take the state in chunks from several donors
    (``StateDownload``).
    """

    def __init__(self, averaged_tensors: Sequence[torch.Tensor], dht: DHT, *, compression: str,
                 max_norm_ratio: Optional[float] = 10.0, fragments: Optional[Sequence[Sequence[int]]] = None,
                 state_tensors: Sequence[torch.Tensor] = (), sparse_k: int = 128, aggregation: str = "mean",
                 audit_parts: int = AUDIT_PARTS, replay: bool = False, **kwargs):
        check_hivemind()  # the internals below are hivemind 1.1.12's: refuse another hivemind in one line
        self.compression_name = compression
        # how a reducer combines its members' parts (robust.py): part of the schema, so a group agrees on it
        self.aggregation = check_aggregation(aggregation, sparse=compression == SPARSE,
                                             signed=getattr(dht, "identity", None) is not None)
        # who may take part: the swarm key's rule (security.SwarmAuth) that start_dht attached to the DHT
        self.auth: SwarmAuth = getattr(dht, "auth", SwarmAuth())
        self.max_norm_ratio = max_norm_ratio
        # streaming sync: a round averages one fragment (a run of the tensors), which the host names per round
        self.fragments = [list(f) for f in fragments] if fragments else [list(range(len(averaged_tensors)))]
        # --compression sparse: the round is an all-gather of 2-bit top-k messages (sparse_round.py), not the butterfly
        sparse_layout = Layout(tuple(tuple(t.shape) for t in averaged_tensors), k=sparse_k) \
            if compression == SPARSE else None
        self.bans = Bans()  # who we exclude for misbehaving (averager process), listed for the host
        self.admission = Admission(self.auth, self.bans, self.serializer, self.ban)
        self.sender_checks = SenderChecks(aggregation, self.ban)  # convicts poisoning senders (sender_scores.py)
        super().__init__([*averaged_tensors, *state_tensors], dht,
                         compression=get_compression("none" if compression == SPARSE else compression),
                         start=False, **kwargs)
        self.schema_hash = schema_hash(averaged_tensors, compression, sparse_k, aggregation, replay)
        # the host sets the plan before each step (set_round_plan); the averager process reads it when the step starts
        self.plan = SharedRoundPlan(self.matchmaking_kwargs["min_matchmaking_time"])
        self.report = RoundReport()  # incomplete rounds, their failed members, group lookups: the host reads them
        self.steered: Optional[SteeredMatchmaking] = None  # averager process: its matchmaking, steered per round
        self._running_step = None  # averager process: the StepControl of the step in progress
        self.output_buffer = OutputBufferSlot()  # averager process: a round decodes its averages there (flat_outputs)
        # mixing groups: the stepped global parameters, then the stepped outer momenta (``outer.stepped_state_``),
        # averaged instead of the pseudo-gradients in a round whose members start from different parameters
        self.state_fragment = list(range(len(averaged_tensors), len(averaged_tensors) + len(state_tensors)))
        self._fault = fault_from_env()  # fault injection (p2ptrain.faults)
        # the parts, built here in the host before the averager process forks (their shared memory with them)
        context = AveragerContext(prefix=self.prefix, auth=self.auth, dht=self.dht, own_id=lambda: self.peer_id,
                                  stub=lambda peer: self.get_stub(p2p_of(self), peer, namespace=self.prefix),
                                  ban=self.ban, is_banned=self.is_banned)
        self.sparse = SparseGather(context, sparse_layout, self.fragments, max_norm_ratio)
        self.auditor = Audits(context, audit_parts, lambda *args, **kwargs: self.evidence.report_bad_average(
            *args, **kwargs))  # audit.py
        # the replay check (diloco/replay.py): our claims served, others' claims and parts fetched for the host
        self.replay = ReplayServing(context, self.total_size, self.auditor.input_for) if replay else None
        self.auditor.keep_last = 2 if replay else 0  # a round's parts are replayed up to two rounds later
        self.state_donor = StateDonor(context, self.serializer, partial(current_state_from_host, self),
                                      lambda: self.allow_state_sharing, self._fault, self.replay)
        # our averages go out signed with the DHT's identity key (start_dht attaches it); evidence.py
        self.evidence = Evidence(context, getattr(dht, "identity", None), self.codec, max_norm_ratio)
        self.state_download = StateDownload(context, self.serializer, self.total_size,
                                            partial(group_key_prefix, self), self.evidence.read)

    # ------------------------------------------------------------------------------ what the host reads and sets

    @property
    def codec(self) -> WireCodec:
        """The wire format of this averager's all-reduce parts."""
        return self.allreduce_kwargs["compression"]

    @property
    def part_size_bytes(self) -> int:
        """hivemind's part size (bytes after compression): a round's until its members measured their links, and the
        cut of error feedback (``wire_parts``), which rounds alike whatever size a round chose (part_size.py)."""
        return self.allreduce_kwargs["part_size_bytes"]

    @property
    def incomplete_rounds(self) -> int:
        return self.report.incomplete_rounds

    @property
    def group_lookups(self) -> int:
        """DHT lookups of the declared potential leaders that this averager's matchmaking made so far."""
        return int(self.report.group_lookups.value)

    @property
    def bans_total(self) -> int:
        """Peers this averager excluded for misbehaving so far (an exclusion extended counts once)."""
        return self.bans.total

    @property
    def banned_peers(self) -> List[str]:
        """Base58 ids of the peers excluded now (host side: read from the averager process's list of exclusions)."""
        return self.bans.live_ids()

    @property
    def last_failed_members(self) -> set:
        """Peer ids (base58) of the members whose range failed in the last incomplete round."""
        return self.report.failed_members

    @property
    def audits(self) -> Dict[str, int]:
        """Parts this averager audited so far, the bytes it fetched for them, and the reducers it caught."""
        return self.auditor.counts

    @property
    def states_served(self) -> int:
        """State transfers this donor answered (one per newcomer that asked it), and the bytes it served."""
        return self.state_donor.states_served

    @property
    def state_bytes_served(self) -> int:
        return self.state_donor.state_bytes_served

    @property
    def sparse_layout(self) -> Optional[Layout]:
        """The sparse codec's layout of all parameters (None with another codec)."""
        return self.sparse.layout

    @property
    def sparse_layouts(self) -> List[Layout]:
        """The sparse codec's layout of each fragment."""
        return self.sparse.layouts

    def write_sparse_message(self, message: bytes) -> None:
        """The host's sparse message for the next round (of the fragment it is for: its size says which)."""
        self.sparse.write_message(message)

    def set_host_outer_step(self, outer_step: int) -> None:
        """Tell the averager process the host's current outer step: a snapshot of an older one gets replaced."""
        self.state_donor.set_host_outer_step(outer_step)

    def set_round_plan(self, target_group_size: Optional[int], window_s: float, expected: Iterable[str] = (),
                       max_group_size: Optional[int] = None, fragment: int = 0, follows_only: bool = False) -> None:
        """The next ``step``'s plan (``SharedRoundPlan.set``); ``follows_only``: a round as a client (``act_as``)."""
        self.plan.set(target_group_size, window_s, expected, max_group_size, fragment, follows_only or self.client_mode)
        act_as(self, follows_only)

    def download_state(self, timeout_s: float) -> Optional[DownloadedState]:
        """Take the state from live donors (host side; blocks). None if no donor could give a complete state."""
        future = MPFuture()
        send_to_averager_process(self, "_download_state", timeout_s=timeout_s, future=future)
        return future.result(timeout=timeout_s + 5.0)

    async def _download_state(self, timeout_s: float, future: MPFuture) -> None:
        await self.state_download.run(timeout_s, future)  # in the averager process (download_state sent it)

    async def _replay(self, call: str, **kwargs) -> None:
        await self.replay.run(call, **kwargs)  # in the averager process (replay_serving.ask sent it)

    state_provider = None
    """A callable returning (metadata, tensors, infos) that newcomers download; set by DiLoCoOptimizer."""

    runner_type = ExactAllReduceRunner
    """the all-reduce of a group (the tests' rogue peers subclass it)"""

    def get_current_state(self):
        # runs in the host process, in hivemind's state-serving thread, when a peer asks for our state
        if self.state_provider is None:
            return super().get_current_state()
        return self.state_provider()

    # ---------------------------------------------------------------------------------------- the averager process

    def run(self):
        enter_averager_process(self)  # in the child process: signals, the parent's lifeline, the control pipe
        try:
            super().run()
        finally:
            leave_averager_process(self)

    async def add_p2p_handlers(self, p2p, *args, **kwargs) -> None:
        await super().add_p2p_handlers(p2p, *args, **kwargs)  # the rpc_* below; the all-reduce's parts on a stream
        await p2p.add_binary_stream_handler(handler_name(self.prefix), partial(serve_part_stream, self))  # of theirs

    async def remove_p2p_handlers(self, p2p, *args, **kwargs) -> None:
        # at shutdown: a p2pd that died with the DHT process (DHTWatch: the peer is leaving for that) holds no
        # handler of ours any more, and hivemind would end the averager's thread with a traceback
        try:
            await p2p.remove_binary_stream_handler(handler_name(self.prefix))
            await super().remove_p2p_handlers(p2p, *args, **kwargs)
        except (ConnectionError, OSError) as e:
            logger.debug(f"could not remove the averager's handlers, p2pd is gone: {e!r}")

    def step(self, gather: Optional[Dict[str, Any]] = None, weight: Optional[float] = None, **kwargs):
        if weight is None:
            weight = float(self.mode != AveragingMode.AUX)  # hivemind's default
        # every join request and every group's gathered data carry our admission token (empty in an open swarm)
        # and our weight (a group whose members all weigh 0 has nothing to average: Admission.check_contributors)
        # and how fast our last round moved bytes, of which the group's slowest sets its part size (part_size.py)
        gather = dict(gather or {}, admission=self.auth.token(self.peer_id), weight=weight,
                      **{RATE_KEY: round(self.report.link_bytes_s)})
        return super().step(gather=gather, weight=weight, **kwargs)

    # ------------------------------------------------------------------------------------- admission and bans

    def ban(self, peer: PeerID, reason: str, for_s: float = BAN_S) -> None:
        """Keep ``peer`` out of our groups for ``for_s`` (averager process): we neither accept its join request,
        nor ask it to lead us, nor stay in a group that holds it (nor take its state or its sparse pieces)."""
        if self.bans.add(peer, reason, for_s):  # said once: an exclusion extended keeps its first reason, unsaid
            logger.warning(f"excluding peer {peer} from this run for {for_s:.0f}s: {reason}")

    def is_banned(self, peer: PeerID) -> bool:
        return self.bans.is_banned(peer)

    # ------------------------------------------- the RPCs hivemind registers (rpc_* of this class), each to its part

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        refusal = self.admission.refusal(context.remote_id, request.gather)
        if refusal:
            logger.warning(f"refused peer {context.remote_id}'s request to join our group: {refusal}")
            self.ban(context.remote_id, refusal)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            await linger_after_refusal()
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    async def rpc_aggregate_part(self, _stream: AsyncIterator[averaging_pb2.AveragingData],
                                 _context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        """Parts over hivemind's protobuf stream (protocol 9 and older): refused; since 10 they have their own."""
        yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
        await linger_after_refusal()

    async def rpc_audit_input(self, request: p2ptrain_pb2.AuditRequest,
                              context: P2PContext) -> p2ptrain_pb2.AuditInput:
        return self.auditor.input_for(request, context.remote_id)

    async def rpc_audit_proof(self, request: p2ptrain_pb2.ProofRequest,
                              context: P2PContext) -> p2ptrain_pb2.AuditInput:
        return self.evidence.proof_for(request, context.remote_id)

    async def rpc_state_info(self, request: p2ptrain_pb2.StateInfoRequest,
                             context: P2PContext) -> p2ptrain_pb2.StateInfo:
        return await self.state_donor.info(request, context.remote_id)

    async def rpc_state_chunk(self, request: p2ptrain_pb2.StateChunkRequest,
                              context: P2PContext) -> p2ptrain_pb2.StateChunk:
        return self.state_donor.chunk(request, context.remote_id)

    async def rpc_sparse_piece(self, request: p2ptrain_pb2.SparsePiece,
                               context: P2PContext) -> p2ptrain_pb2.SparseAck:
        return self.sparse.take_piece(request, context.remote_id)

    async def rpc_download_state(self, _request: averaging_pb2.DownloadRequest,
                                 _context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        """hivemind's one-donor, whole-state stream: not served; p2ptrain peers use the chunked calls above."""
        return
        yield  # an async generator that yields nothing: the caller sees an empty stream and moves on

    # ------------------------------------------------------------------------------------------------- a round

    async def _step(self, **kwargs):
        # this round's plan (set_round_plan), read once per step, before matchmaking
        if self.steered is None:
            self.steered = SteeredMatchmaking(matchmaking_of(self), self.is_banned, self.report.group_lookups)
        self.plan.steer(self.steered)
        self._running_step = kwargs.get("step")
        self.evidence.watch()  # from the first round on: other peers' catches exclude reducers here too
        try:
            return await super()._step(**kwargs)
        finally:
            self._running_step = None

    def start_in_background(self, timeout_s: float) -> None:
        """Start the averager process and wait until it serves requests. Safe to call from any thread."""
        self.start()
        self.wait_until_ready(timeout_s)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs) -> RoundResult:
        self.admission.check_members(group_info, self.peer_id, self._running_step)  # before the round counts as
        self.admission.check_contributors(group_info)  # started: a refused group is no round
        started = time.perf_counter()
        try:
            gathered, download_bandwidths = read_gathered(self.serializer, group_info)
            mine = gathered.get(self.peer_id.to_base58(), {})
            fault = self._fault  # fault injection: die mid-round, in a round from that outer step on (-1: any)
            if fault and fault.kind == "allreduce" and mine.get("outer_step", -1) >= fault.outer_step:
                kwargs["die_after_parts"] = fault.count
            # the fragment this round averages (every member set the same: it is part of the group key)
            fragment = self.fragments[self.plan.fragment]
            kwargs["part_size_bytes"] = round_part_size(gathered.values(), self.part_size_bytes)  # every member's
            mixed = mixes_states(gathered, bool(self.state_fragment))
            if mixed:
                # exact: the mean of the stepped states must be the step of the mean state (outer.stepped_state_),
                # and fp16 would round parameters far more coarsely than their updates
                fragment = self.state_fragment
                kwargs["compression"] = get_compression("none")
            if self.sparse.layout is not None and not mixed:
                result = await self._sparse_round(group_info, gathered, kwargs.get("die_after_parts"))
                result.gathered, result.allreduce_s = gathered, time.perf_counter() - started
                return result
            async with enter_asynchronously(self.get_tensors()) as all_tensors:
                local_tensors = [all_tensors[i] for i in fragment]
                if mixed:  # parameters, then momenta: each held to our pseudo-gradient of its shape
                    kwargs["deviation_scale"] = [all_tensors[i] for i in self.fragments[0]] * 2
                peer_fractions = await asyncio.get_event_loop().run_in_executor(
                    None, load_balance_peers, sum(t.numel() for t in local_tensors), download_bandwidths,
                    min_vector_size
                )
                scale = own_norm_scale(mine)
                cap = weight_cap(claimed_weights(group_info, gathered))  # a weight is the member's claim (robust.py)
                result = await self._run_allreduce_inplace_(
                    local_tensors, group_info, peer_fractions=peer_fractions, norm_scale=scale, weight_cap=cap,
                    **kwargs
                )
            result.gathered, result.mixed = gathered, mixed
            result.allreduce_s = time.perf_counter() - started
            return result
        except BaseException as e:
            self.report.count_incomplete()
            if isinstance(e, Exception):
                logger.debug(f"All-reduce failed: {e!r}", exc_info=True)
            if isinstance(e, IncompleteRoundError):
                # the step ends here: hivemind would look for a new group until the step's deadline (seconds), while
                # the members that got every part commit and move on, or leave; the host decides at once instead
                # (the survivors re-run the round, or this peer takes the committed state while its donors are there)
                step = self._running_step
                if step is not None and not step.done():
                    step.set_exception(e)
                raise
            raise MatchmakingException(f"Unable to run All-Reduce: {e}") from e

    async def _sparse_round(self, group_info: GroupInfo, gathered: Dict[str, Any],
                            die_after_sends: Optional[int] = None) -> RoundResult:
        """The sparse codec's round (``SparseGather.run_group``) over this round's fragment of the tensors."""
        # no butterfly runner serves this group: marks it as running, so hivemind does not report it unfinished
        register_runner(self, group_info.group_id, None)
        fragment = self.plan.fragment  # every member's is the same: it is part of the group key
        async with enter_asynchronously(self.get_tensors()) as all_tensors:
            tensors = [all_tensors[i] for i in self.fragments[fragment]]
            result = await self.sparse.run_group(tensors, group_info, gathered, self._allreduce_timeout or 60.0,
                                                 fragment, die_after_sends, self.report.record_failed)
        self.last_updated = time.time()
        return result

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: Optional[bytes] = None,
        norm_scale: float = 1.0, **kwargs
    ) -> RoundResult:
        return await run_butterfly(self, tensors, group_info, group_id, norm_scale, **kwargs)  # butterfly.py
