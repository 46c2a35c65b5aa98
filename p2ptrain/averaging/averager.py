"""One averaging round over the swarm: hivemind's matchmaking, p2ptrain's exact all-reduce."""

from __future__ import annotations

import asyncio
import ctypes
import multiprocessing as mp
import signal
import time
from functools import partial
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Dict, Iterable, List, Optional, Sequence

import torch
from hivemind import DHT
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.averager import compute_schema_hash
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.dht import DHTID
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger
from hivemind.utils.asyncio import as_aiter, azip, enter_asynchronously

from p2ptrain.averaging.allreduce import ExactAllReduceRunner
from p2ptrain.averaging.audit import AUDIT_PARTS, AuditMixin
from p2ptrain.averaging.compression import SPARSE, WireCodec, get_compression
from p2ptrain.averaging.evidence import BAN_S, EvidenceMixin
from p2ptrain.averaging.robust import check_aggregation, weight_cap
from p2ptrain.hivemind_compat import (SteeredMatchmaking, check_hivemind, matchmaking_of, p2p_of,
                                                 register_runner)
from p2ptrain.averaging.sparse import Layout
from p2ptrain.averaging.sparse_round import SparseGatherMixin
from p2ptrain.averaging.state_transfer import StateTransferMixin
from p2ptrain.finite import all_finite
from p2ptrain.lifeline import exit_on_sigterm, follow_parent, leave_process_group, on_forced_exit
from p2ptrain.hivemind_compat import p2p_socket_paths
from p2ptrain.lifeline import remove_files
from p2ptrain.swarm.pipe import WholeMessageReader
from p2ptrain.security import SwarmAuth

logger = get_logger(__name__)


@dataclass
class RoundResult:
    """What one all-reduce round did, as seen by one peer. Returned to the host process from the averager."""

    group_size: int
    """peers in the group, this one included"""
    bytes_sent: int = 0
    """payload bytes this peer sent: its parts to other reducers, averages back to other senders"""
    bytes_received: int = 0
    """payload bytes this peer received"""
    failed_fraction: float = 0.0
    """fraction of the vector whose reducer failed; those values stayed this peer's own"""
    gathered: Dict[str, Any] = field(default_factory=dict)
    """peer id (base58) -> the metadata that peer attached to this round (its samples, its outer step)"""
    allreduce_s: float = 0.0
    """seconds from the group's forming to the end of the all-reduce (the rest of a sync is matchmaking)"""
    phases: Dict[str, float] = field(default_factory=dict)
    """CPU seconds inside the all-reduce by kind of work (``ExactAllReduceRunner.clock``): encode, decode, checks,
    and ``write`` (the result copied into the shared buffers). The first three run on several threads while the
    wire carries other parts, so they overlap each other and the all-reduce's wall time"""
    mixed: bool = False
    """the group's members started from different global parameters (they averaged in different groups last round),
    so it averaged their stepped states (``outer.stepped_state_``: global parameters and outer momenta, in fp32)
    instead of their pseudo-gradients; the state buffers hold the group's mean"""

    def to_dict(self) -> dict:
        return asdict(self)


class IncompleteRoundError(AllreduceException):
    """A group formed but the round did not finish on every part (a member died or timed out mid-round)."""


PROTOCOL_VERSION = 9
"""What peers must agree on beyond the codec to average together; bumped when a round's meaning changes.
2: digests of the global parameters are sha256 (they were blake2b). 3: join requests carry an admission token,
records about a peer are signed, parts are checked against the reducer's own norm. 4: reducers stream averages to
client-mode senders at once (no delayed results), and join requests carry the weight. 5: digests are xxh3-128
(records._digest_of). 6: a sender hangs up on a reducer once it holds every average of that reducer's range, and
the reducer holds the stream open until then (``ExactAllReduceRunner.rpc_aggregate_part``): with 5's peers each
side would wait for the other until a timeout. 7: mixing groups (p2ptrain/mixing.py): the matchmaking key carries
the round's cell, the gathered data ``mixing``, a group of different digests averages stepped states, and a peer
that leaves stores a leaving record (``PeerProgress.leaving``): with 6's peers the cells and the rounds differ.
8: sparse messages Rice-code their places (``sparse.py``): 7's 12-bit places do not decode as 8's. 9: a reducer's
signed answer carries its receipt (``audit.py``), which senders check and auditors recompute: 8's bare signature
does not parse as 9's."""

SERVE_SENDERS_TIMEOUT_S = 15.0
"""how long a reducer that has its own result waits for the other senders to take their last averages"""

MAX_PEER_LIST_BYTES = 4096
"""room for the ids of the members that failed a round (about 80 of them; 60 excluded peers with their ends)"""



class PseudoGradientAverager(SparseGatherMixin, StateTransferMixin, EvidenceMixin, AuditMixin, DecentralizedAverager):
    """Averages a fixed set of CPU tensors with the peers that are ready at the same time.

    Unlike its hivemind parent, the result is identical on every peer of a group (see ``ExactAllReduceRunner``),
    the tensors are only overwritten when the round succeeded end to end (a failed round leaves them untouched,
    so a retry never averages a half-averaged vector), and ``step`` returns a ``RoundResult``.
    Peers that use a different compression or protocol version never end up in one group: both are part of
    the schema hash that matchmaking compares. Newcomers take the state in chunks from several donors
    (``StateTransferMixin``).
    """

    def __init__(self, averaged_tensors: Sequence[torch.Tensor], dht: DHT, *, compression: str,
                 max_norm_ratio: Optional[float] = 10.0, fragments: Optional[Sequence[Sequence[int]]] = None,
                 state_tensors: Sequence[torch.Tensor] = (), sparse_k: int = 128, aggregation: str = "mean",
                 audit_parts: int = AUDIT_PARTS, **kwargs):
        check_hivemind()  # the internals below are hivemind 1.1.12's: refuse another hivemind in one line
        self.compression_name = compression
        # how a reducer combines its members' parts (robust.py): part of the schema, so a group agrees on it
        self.aggregation = check_aggregation(aggregation)
        if aggregation != "mean" and compression == SPARSE:
            raise ValueError(f"aggregation {aggregation!r} needs a butterfly round: the sparse codec's all-gather "
                             "averages every member's message on every member; use aggregation 'mean' with it")
        # who may take part: the swarm key's rule (security.SwarmAuth) that start_dht attached to the DHT
        self.auth: SwarmAuth = getattr(dht, "auth", SwarmAuth())
        self.max_norm_ratio = max_norm_ratio
        # streaming sync: a round averages one fragment (a run of the tensors), which the host names per round
        self.fragments = [list(f) for f in fragments] if fragments else [list(range(len(averaged_tensors)))]
        # --compression sparse: the round is an all-gather of 2-bit top-k messages (sparse_round.py), not the butterfly
        self._init_sparse(Layout(tuple(tuple(t.shape) for t in averaged_tensors), k=sparse_k)
                          if compression == SPARSE else None, self.fragments)
        self._banned: Dict[PeerID, tuple] = {}  # averager process: peer -> (monotonic end of its ban, why)
        super().__init__([*averaged_tensors, *state_tensors], dht,
                         compression=get_compression("none" if compression == SPARSE else compression),
                         start=False, **kwargs)
        # the pseudo-gradients' shapes alone: a peer that also keeps state buffers (mixing groups) still groups with
        # one that does not (a round between them averages pseudo-gradients, or repairs, as before)
        schema = [compute_schema_hash(averaged_tensors).hex(), f"compression={compression}",
                  f"protocol={PROTOCOL_VERSION}", *([f"sparse_k={sparse_k}"] if compression == SPARSE else []),
                  *([f"aggregation={aggregation}"] if aggregation != "mean" else [])]
        self.schema_hash = DHTID.generate(source=schema).to_bytes()
        # rounds in which a group formed but the all-reduce did not complete: the host retries those with the
        # survivors instead of applying its own pseudo-gradient, so no survivor applies a half-averaged result
        self._incomplete_rounds = mp.Value(ctypes.c_int64, 0)
        # the host sets these before each step (set_round_plan); the averager process reads them when the step starts
        self._round_target = mp.Value(ctypes.c_int64, 0)  # 0: no target, wait out the window
        self._round_window_s = mp.Value(ctypes.c_double, self.matchmaking_kwargs["min_matchmaking_time"])
        # base58 ids of the peers the target counts, comma-separated, and the most a group may hold (0: no cap)
        self._round_expected = mp.Array(ctypes.c_char, MAX_PEER_LIST_BYTES)
        self._round_cap = mp.Value(ctypes.c_int64, 0)
        self._steered: Optional[SteeredMatchmaking] = None  # averager process: its matchmaking, steered per round
        self._running_step = None  # averager process: the StepControl of the step in progress
        # base58 ids of the members that failed the last incomplete round, comma-separated (host reads them)
        self._failed_members = mp.Array(ctypes.c_char, MAX_PEER_LIST_BYTES)
        # mixing groups: the stepped global parameters, then the stepped outer momenta (``outer.stepped_state_``),
        # averaged instead of the pseudo-gradients in a round whose members start from different parameters
        self.state_fragment = list(range(len(averaged_tensors), len(averaged_tensors) + len(state_tensors)))
        self._round_fragment = mp.Value(ctypes.c_int64, 0)
        self._group_lookups = mp.Value(ctypes.c_int64, 0)  # DHT lookups of the group key matchmaking made
        # for metrics and the dashboard (host reads): exclusions made so far, and the ids excluded now
        self._bans_total = mp.Value(ctypes.c_int64, 0)
        self._banned_ids = mp.Array(ctypes.c_char, MAX_PEER_LIST_BYTES)
        self._init_state_transfer()
        # our averages go out signed with the DHT's identity key (start_dht attaches it); evidence.py
        self._init_evidence(getattr(dht, "identity", None))
        self._init_audit(audit_parts)  # parts of other reducers we recompute after each round (audit.py)

    @property
    def codec(self) -> WireCodec:
        """The wire format of this averager's all-reduce parts."""
        return self.allreduce_kwargs["compression"]

    @property
    def part_size_bytes(self) -> int:
        """The all-reduce cuts each tensor into parts of this many bytes after compression (``wire_parts``)."""
        return self.allreduce_kwargs["part_size_bytes"]

    @property
    def incomplete_rounds(self) -> int:
        return int(self._incomplete_rounds.value)

    @property
    def group_lookups(self) -> int:
        """DHT lookups of the declared potential leaders that this averager's matchmaking made so far."""
        return int(self._group_lookups.value)

    @property
    def bans_total(self) -> int:
        """Peers this averager excluded for misbehaving so far (an exclusion extended counts once)."""
        return int(self._bans_total.value)

    @property
    def banned_peers(self) -> List[str]:
        """Base58 ids of the peers excluded now (host side: read from the averager process's list, each entry with
        the wall-clock time its exclusion ends)."""
        now, live = time.time(), []
        for entry in _split_ids(self._banned_ids.value):
            peer, _, until = entry.partition("@")
            try:
                if float(until) > now:
                    live.append(peer)
            except ValueError:
                continue
        return live

    @property
    def last_failed_members(self) -> set:
        """Peer ids (base58) of the members whose range failed in the last incomplete round."""
        return set(_split_ids(self._failed_members.value))

    def set_round_plan(self, target_group_size: Optional[int], window_s: float, expected: Iterable[str] = (),
                       max_group_size: Optional[int] = None, fragment: int = 0) -> None:
        """For the next ``step``: start the group as soon as it has ``target_group_size`` members (None: only when
        the window ends), and look for peers for ``window_s`` seconds. hivemind fixes both when the averager is
        built; p2ptrain sets them per round from the swarm's progress records (DiLoCoOptimizer._plan_round).

        ``expected`` names the peers (base58) that the target counts. A peer that joins our group without being one
        of them (its record was not stored yet when we read the records) raises the target by one, up to
        ``max_group_size``: otherwise it would take the place of an expected peer, and the group would start
        without that one."""
        self._round_target.value = target_group_size or 0
        self._round_window_s.value = window_s
        self._round_expected.value = _joined_ids(expected, MAX_PEER_LIST_BYTES - 1)
        self._round_cap.value = max_group_size or 0
        self._round_fragment.value = fragment

    state_provider = None
    """A callable returning (metadata, tensors, infos) that newcomers download; set by DiLoCoOptimizer."""

    runner_type = ExactAllReduceRunner
    """the all-reduce of a group (the tests' rogue peers subclass it)"""

    def get_current_state(self):
        # runs in the host process, in hivemind's state-serving thread, when a peer asks for our state
        if self.state_provider is None:
            return super().get_current_state()
        return self.state_provider()

    def run(self):
        # Runs in the child process. The parent owns SIGINT (first = graceful, second = force) and shuts us down;
        # ignoring it here is what hivemind's run_in_background does too, but without touching the parent's handler.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        leave_process_group()  # signals meant for the host's group are not ours: the host shuts us down
        follow_parent()  # a SIGKILLed host must not leave this process behind
        # its control pipe is read as the DHT's is (swarm/pipe.py: hivemind's reading breaks on a large message)
        self._inner_pipe = WholeMessageReader(self._inner_pipe)
        # the replica of the DHT's P2P made in this process leaves its client socket in /tmp (hivemind removes it in
        # P2P.shutdown only, which a child process never reaches); p2ptrain's DHT removes it, a plain one does not
        on_forced_exit(self._remove_replica_socket)
        exit_on_sigterm()
        try:
            super().run()
        finally:
            self._remove_replica_socket()

    def _remove_replica_socket(self) -> None:
        p2p = getattr(self, "_p2p", None)
        if p2p is not None:
            remove_files(p2p_socket_paths(p2p))

    async def remove_p2p_handlers(self, p2p, *args, **kwargs) -> None:
        # at shutdown: a p2pd that died with the DHT process (DHTWatch: the peer is leaving for that) holds no
        # handler of ours any more, and hivemind would end the averager's thread with a traceback
        try:
            await super().remove_p2p_handlers(p2p, *args, **kwargs)
        except (ConnectionError, OSError) as e:
            logger.debug(f"could not remove the averager's handlers, p2pd is gone: {e!r}")

    def step(self, gather: Optional[Dict[str, Any]] = None, weight: Optional[float] = None, **kwargs):
        if weight is None:
            weight = float(self.mode != AveragingMode.AUX)  # hivemind's default
        # every join request and every group's gathered data carry our admission token (empty in an open swarm)
        # and our weight (a group whose members all weigh 0 has nothing to average: see _check_contributors)
        gather = dict(gather or {}, admission=self.auth.token(self.peer_id), weight=weight)
        return super().step(gather=gather, weight=weight, **kwargs)

    # ------------------------------------------------------------------------------------- admission and bans

    def ban(self, peer: PeerID, reason: str) -> None:
        """Keep ``peer`` out of our groups for ``BAN_S`` (averager process): we neither accept its join request,
        nor ask it to lead us, nor stay in a group that holds it."""
        if self.is_banned(peer):
            reason = self._banned[peer][1]  # already excluded: extend, keep the first reason
        else:
            logger.warning(f"excluding peer {peer} from this run for {BAN_S:.0f}s: {reason}")
            self._bans_total.value += 1
        self._banned[peer] = (time.monotonic() + BAN_S, reason)
        live = [p for p in list(self._banned) if self.is_banned(p)]
        ends = time.time() - time.monotonic()  # the host compares wall-clock ends: its monotonic clock is its own
        self._banned_ids.value = _joined_ids([f"{p.to_base58()}@{self._banned[p][0] + ends:.0f}" for p in live],
                                             MAX_PEER_LIST_BYTES - 1)

    def is_banned(self, peer: PeerID) -> bool:
        until, _ = self._banned.get(peer, (None, ""))
        if until is not None and until < time.monotonic():
            del self._banned[peer]
            return False
        return until is not None

    def _refusal(self, peer: PeerID, gathered: bytes) -> str:
        """Why ``peer``, which sent ``gathered`` (its join request's or its group entry's), may not average with us;
        an empty string if it may."""
        if self.is_banned(peer):
            return f"it is excluded ({self._banned[peer][1]})"
        if not self.auth.admits(peer, self._user_gathered(gathered).get("admission")):
            return "it does not hold this swarm's key (--swarm-key)"
        return ""

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        refusal = self._refusal(context.remote_id, request.gather)
        if refusal:
            logger.warning(f"refused peer {context.remote_id}'s request to join our group: {refusal}")
            self.ban(context.remote_id, refusal)
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for response in super().rpc_join_group(request, context):
            yield response

    def _user_gathered(self, gathered: bytes) -> dict:
        """What a member put in ``step(gather=...)``, from its serialized entry ({} if that is not a dict)."""
        try:
            user_gathered = self.serializer.loads(self.serializer.loads(gathered)[2])
        except Exception:
            return {}
        return user_gathered if isinstance(user_gathered, dict) else {}

    def _check_members(self, group_info: GroupInfo) -> None:
        """A leader we do not know may have put anyone in the group: every member must be admitted by us too."""
        for peer_id, gathered in zip(group_info.peer_ids, group_info.gathered):
            refusal = self._refusal(peer_id, gathered) if peer_id != self.peer_id else ""
            if refusal:
                logger.warning(f"left a group with peer {peer_id} in it: {refusal}")
                self.ban(peer_id, refusal)
                raise MatchmakingException(f"the group holds peer {peer_id}, which we refuse: {refusal}")

    def _check_contributors(self, group_info: GroupInfo) -> None:
        """A group whose members all weigh 0 (newcomers joining a round in progress, peers whose training diverged)
        has no pseudo-gradient to average: running it would commit an outer step the swarm never took. Every member
        sees the same gathered weights, so all of them leave it alike. A member that sent no weight counts."""
        weights = [self._user_gathered(gathered).get("weight", 1.0) for gathered in group_info.gathered]
        if all(isinstance(w, (int, float)) and w == 0 for w in weights):
            logger.info(f"left a group of {len(weights)} in which nobody has a pseudo-gradient to add (all weigh 0)")
            raise MatchmakingException("every member of the group has weight 0: nothing to average")

    def _mixes_states(self, gathered: Dict[str, Any]) -> bool:
        """Whether this group averages its members' stepped states rather than their pseudo-gradients: when they
        started from different global parameters (their digests differ) and every one of them keeps the state
        buffers (says ``mixing`` in its join data). Every member decides alike from the same gathered data."""
        entries = list(gathered.values())
        if not self.state_fragment or not all(isinstance(e, dict) and e.get("mixing") is True for e in entries):
            return False
        return len({e.get("digest") for e in entries}) > 1

    async def _step(self, **kwargs):
        # this round's plan (set_round_plan), read once per step, before matchmaking
        if self._steered is None:
            self._steered = SteeredMatchmaking(matchmaking_of(self), refuses_leader=self.is_banned,
                                               lookups=self._group_lookups)
        expected = _split_ids(self._round_expected.value)
        self._steered.plan(self._round_target.value or None, self._round_window_s.value, expected,
                           self._round_cap.value)
        self._running_step = kwargs.get("step")
        self._watch_evidence()  # from the first round on: other peers' catches exclude reducers here too
        try:
            return await super()._step(**kwargs)
        finally:
            self._running_step = None

    def start_in_background(self, timeout_s: float) -> None:
        """Start the averager process and wait until it serves requests. Safe to call from any thread."""
        self.start()
        self.wait_until_ready(timeout_s)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs) -> RoundResult:
        self._check_members(group_info)  # before the round counts as started: a refused group is no round
        self._check_contributors(group_info)
        started = time.perf_counter()
        try:
            bandwidths, mode_ids, user_gathered_bytes = zip(*map(self.serializer.loads, group_info.gathered))
            gathered = {
                peer_id.to_base58(): _without_admission(self.serializer.loads(data))
                for peer_id, data in zip(group_info.peer_ids, user_gathered_bytes)
            }
            modes = tuple(map(AveragingMode, mode_ids))
            mine = gathered.get(self.peer_id.to_base58(), {})
            if self._fault and self._fault.kind == "allreduce" and self._fault.outer_step in (-1, mine.get("outer_step")):
                kwargs["die_after_parts"] = self._fault.count
            download_bandwidths = [
                bandwidth if mode != AveragingMode.CLIENT else 0.0 for bandwidth, mode in zip(bandwidths, modes)
            ]
            # the fragment this round averages (every member set the same: it is part of the group key)
            fragment = self.fragments[self._round_fragment.value]
            mixed = self._mixes_states(gathered)
            if mixed:
                # exact: the mean of the stepped states must be the step of the mean state (outer.stepped_state_),
                # and fp16 would round parameters far more coarsely than their updates
                fragment = self.state_fragment
                kwargs["compression"] = get_compression("none")
            if self.sparse_layout is not None and not mixed:
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
                scale = mine.get("norm_scale", 1.0) if isinstance(mine, dict) else 1.0
                scale = float(scale) if isinstance(scale, (int, float)) and 1.0 <= scale < float("inf") else 1.0
                cap = weight_cap(_claimed_weights(group_info, gathered))  # a weight is the member's claim (robust.py)
                result = await self._run_allreduce_inplace_(
                    local_tensors, group_info, peer_fractions=peer_fractions, norm_scale=scale, weight_cap=cap,
                    **kwargs
                )
            result.gathered, result.mixed = gathered, mixed
            result.allreduce_s = time.perf_counter() - started
            return result
        except BaseException as e:
            with self._incomplete_rounds.get_lock():
                self._incomplete_rounds.value += 1
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
        """The sparse codec's round (``SparseGatherMixin._run_sparse_round``): the pseudo-gradient buffers get the
        group's average, or nothing if a member's message did not come or was refused (``IncompleteRoundError``,
        like a failed reducer: the host runs the round again with the survivors)."""
        weights = _claimed_weights(group_info, gathered)  # every member reads the same: the same contributors
        cap = weight_cap(weights)  # a weight is the member's own claim (robust.py)
        weights = [min(weight, cap) for weight in weights]
        # no butterfly runner serves this group: marks it as running, so hivemind does not report it unfinished
        register_runner(self, group_info.group_id, None)
        fragment = self._round_fragment.value  # every member's is the same: it is part of the group key
        async with enter_asynchronously(self.get_tensors()) as all_tensors:
            tensors = [all_tensors[i] for i in self.fragments[fragment]]
            sent, received, failed = await self._run_sparse_round(tensors, group_info, weights,
                                                                   self._allreduce_timeout or 60.0, fragment,
                                                                   die_after_sends)
        if failed:
            self._failed_members.value = _joined_ids(failed, MAX_PEER_LIST_BYTES - 1)
            raise IncompleteRoundError(f"the sparse messages of {len(failed)} member(s) did not come or were refused "
                                       "(a group member failed mid-round); nothing applied")
        self.last_updated = time.time()
        return RoundResult(group_size=len(group_info.peer_ids), bytes_sent=sent, bytes_received=received)

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: Optional[bytes] = None,
        norm_scale: float = 1.0, **kwargs
    ) -> RoundResult:
        group_id = group_info.group_id if group_id is None else group_id
        runner = self.runner_type(
            p2p=p2p_of(self),
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            max_norm_ratio=None if self.max_norm_ratio is None else self.max_norm_ratio * norm_scale,
            on_bad_peer=self.ban,
            aggregation=self.aggregation,
            signer=self.signer,
            on_bad_average=partial(self._report_bad_average, group_id),
            # a private swarm's reducers all sign receipts (start_dht gives each an identity): one that does not
            # could not be audited. Mixing groups (deviation_scale) average states in fp32: not audited
            require_receipts=self.signer is not None and self.auth.private,
            audit_parts=0 if self.signer is None or "deviation_scale" in kwargs else self.audit_parts,
            **kwargs,
        )
        register_runner(self, group_id, runner)
        if self.signer is not None:
            self._keep_for_audit(group_id, group_info.peer_ids, runner.kept_inputs)
        self._own_rms_last = runner._own_rms or self._own_rms_last  # the scale evidence is judged against

        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
        else:
            # collect first, write after: a round that fails half-way must leave the local tensors as they were
            averaged = [averaged_tensor async for _, averaged_tensor in azip(as_aiter(*tensors), runner)]
            failed_size = runner.tensor_part_container.failed_size
            if failed_size:
                # a reducer died or timed out: its range holds our own values, which differ from peer to peer.
                # Applying that would split the survivors; fail the round so that they run it again together.
                failed = [peer.to_base58() for peer in runner.failed_reducers]
                self._failed_members.value = _joined_ids(failed, MAX_PEER_LIST_BYTES - 1)
                raise IncompleteRoundError(
                    f"{failed_size} of {runner.tensor_part_container.total_size} values were not averaged "
                    "(a group member failed mid-round); nothing applied"
                )
            if not all(all_finite(averaged_tensor) for averaged_tensor in averaged):
                # a reducer averaged a non-finite part of its own in; keep ours rather than take the poison
                raise AllreduceException("the averaged result has NaN/inf values; keeping the local tensors")
            if not await runner.wait_until_senders_served(SERVE_SENDERS_TIMEOUT_S):
                logger.warning(f"a sender had not taken all of its averages {SERVE_SENDERS_TIMEOUT_S:.0f}s after "
                               "this peer had its own; going on without waiting for it")
            with runner.clock("write"):
                for tensor, averaged_tensor in zip(tensors, averaged):
                    tensor.copy_(averaged_tensor)
            self.last_updated = time.time()
            self._start_audits(group_id, runner.audit_targets, runner._codec)

        container = runner.tensor_part_container
        return RoundResult(
            group_size=len(group_info.peer_ids),
            bytes_sent=runner.bytes_sent,
            bytes_received=runner.bytes_received,
            failed_fraction=container.failed_size / max(container.total_size, 1),
            phases=dict(runner.clock.seconds),
        )


def _claimed_weights(group_info: GroupInfo, gathered: Dict[str, Any]) -> List[float]:
    """Each member's gathered weight (its samples), in the group's order: 0 where it sent none that is a number at
    least 0, 1 where it sent no metadata."""
    weights = []
    for peer in group_info.peer_ids:
        weight = gathered.get(peer.to_base58(), {})
        weight = weight.get("weight", 1.0) if isinstance(weight, dict) else 1.0
        weights.append(float(weight) if isinstance(weight, (int, float)) and weight >= 0 else 0.0)
    return weights


def _joined_ids(peer_ids: Iterable[str], max_bytes: int) -> bytes:
    """Comma-separated ids that fit in ``max_bytes`` (the ones that do not are left out whole)."""
    joined = b""
    for peer in peer_ids:
        item = (b"," if joined else b"") + peer.encode("ascii")
        if len(joined) + len(item) > max_bytes:
            break
        joined += item
    return joined


def _split_ids(joined: bytes) -> list:
    """The ids ``_joined_ids`` joined."""
    return [peer for peer in joined.decode("ascii", "replace").split(",") if peer]


def _without_admission(gathered: Any) -> Any:
    """A member's gathered metadata as the host sees it: the admission token has done its job."""
    if isinstance(gathered, dict):
        gathered.pop("admission", None)
    return gathered
