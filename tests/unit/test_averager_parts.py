"""The averager's parts, each built alone with an ``AveragerContext`` of fakes (no DHT, no p2pd, no averager process):
bans and admission, the round's plan and report, audits, evidence, the state donor and download, the sparse gather,
and the pure functions of a formed group (round.py)."""

from __future__ import annotations

import asyncio
import hashlib
import math
from types import SimpleNamespace
from typing import Dict, List

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.compression import CompressionInfo
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import ValueWithExpiration

from p2ptrain.averaging import bans as bans_module
from p2ptrain.averaging.admission import Admission
from p2ptrain.averaging.audit import Audits, commitment, make_receipt
from p2ptrain.averaging.bans import Bans
from p2ptrain.averaging.compression import get_compression
from p2ptrain.averaging.context import AveragerContext
from p2ptrain.averaging.evidence import AverageSigner, Evidence, evidence_key
from p2ptrain.averaging.plan import RoundReport, SharedRoundPlan
from p2ptrain.averaging.round import (PROTOCOL_VERSION, IncompleteRoundError, claimed_weights, joined_ids,
                                      mixes_states, nobody_contributes, own_norm_scale, read_gathered, schema_hash,
                                      split_ids)
from p2ptrain.averaging.sparse import Layout, accumulate_, send_
from p2ptrain.averaging.sparse_round import SparseGather, average_messages
from p2ptrain.averaging.state_donor import StateDonor
from p2ptrain.averaging.state_transfer import CHUNK_VALUES, StateDownload, flatten_state
from p2ptrain.proto import p2ptrain_pb2
from p2ptrain.security import PeerSignatureValidator, SwarmAuth, peer_id_of

SERIALIZER = MSGPackSerializer
CODEC = get_compression("fp16")
PRIVATE = SwarmAuth.from_key(b"k" * 32)


def peer(n: int) -> PeerID:
    return PeerID(bytes([0, 34, 8, 1, 18, 30]) + bytes([n]) * 30)


class FakeHost:
    """What a part may use of the averager, as plain records: the bans it made, the stubs it asked for."""

    def __init__(self, me: PeerID, auth: SwarmAuth = SwarmAuth(), dht=None, stubs: Dict[PeerID, object] = None):
        self.me, self.auth, self.dht, self.stubs = me, auth, dht, stubs or {}
        self.bans: List[tuple] = []

    def context(self) -> AveragerContext:
        return AveragerContext(prefix="run", auth=self.auth, dht=self.dht, own_id=lambda: self.me,
                               stub=self.stubs.__getitem__, ban=lambda p, why: self.bans.append((p, why)),
                               is_banned=lambda p: any(b == p for b, _ in self.bans))


def join_entry(gathered: dict, bandwidth: float = 1.0, mode: int = 0) -> bytes:
    """A member's entry of a group's gathered data, as hivemind's step serializes it."""
    return SERIALIZER.dumps([bandwidth, mode, SERIALIZER.dumps(gathered)])


# ---------------------------------------------------------------------------------------------- bans, admission

def test_an_exclusion_counts_once_keeps_its_first_reason_and_ends(monkeypatch):
    bans = Bans()
    assert bans.add(peer(1), "first") and not bans.add(peer(1), "second")
    assert bans.is_banned(peer(1)) and bans.reason(peer(1)) == "first" and bans.total == 1
    assert bans.live_ids() == [peer(1).to_base58()]
    monkeypatch.setattr(bans_module, "BAN_S", -1.0)  # an exclusion that has ended
    assert bans.add(peer(2), "x") and not bans.is_banned(peer(2)) and bans.total == 2
    assert peer(2).to_base58() not in bans.live_ids()


def test_admission_refuses_the_excluded_and_those_without_the_key_and_groups_with_nothing_to_add():
    bans, banned = Bans(), []
    admission = Admission(PRIVATE, bans, SERIALIZER, lambda p, why: (banned.append(p), bans.add(p, why)))
    keyed = join_entry({"admission": PRIVATE.token(peer(2))})
    assert admission.refusal(peer(2), keyed) == ""
    assert "does not hold this swarm's key" in admission.refusal(peer(3), join_entry({}))
    assert "does not hold this swarm's key" in admission.refusal(peer(3), b"not msgpack")
    bans.add(peer(2), "it lied")
    assert admission.refusal(peer(2), keyed) == "it is excluded (it lied)"

    group = GroupInfo(b"g", (peer(1), peer(4)), (join_entry({}), join_entry({"admission": b"forged"})))
    with pytest.raises(MatchmakingException, match="which we refuse"):
        admission.check_members(group, me=peer(1))  # our own entry is never checked: peer 4 is refused
    assert banned == [peer(4)]
    idle = GroupInfo(b"g", (peer(1), peer(2)), (join_entry({"weight": 0}), join_entry({"weight": 0.0})))
    with pytest.raises(MatchmakingException, match="weight 0"):
        admission.check_contributors(idle)
    admission.check_contributors(GroupInfo(b"g", (peer(1), peer(2)), (join_entry({"weight": 0}), join_entry({}))))


def test_a_member_leaves_a_group_whose_leader_changed_what_it_sent():
    """The leader relays each member's join data; the sender check scales a member's norm by the steps it claims
    there, so a leader that raised them could frame it. Our entry must come back as we sent it."""
    bans, banned = Bans(), []
    admission = Admission(PRIVATE, bans, SERIALIZER, lambda p, why: banned.append(p))
    token = {"admission": PRIVATE.token(peer(1)), "weight": 8.0}
    sent = join_entry({**token, "norm_scale": 1.0})
    step = SimpleNamespace(data_for_gather=sent)  # the StepControl's field that check_members reads
    others = join_entry({"admission": PRIVATE.token(peer(2))})
    admission.check_members(GroupInfo(b"g", (peer(2), peer(1)), (others, sent)), me=peer(1), step=step)
    changed = GroupInfo(b"g", (peer(2), peer(1)), (others, join_entry({**token, "norm_scale": 1000.0})))
    with pytest.raises(MatchmakingException, match="changed this peer's join data"):
        admission.check_members(changed, me=peer(1), step=step)
    assert banned == []  # nobody can be named: the group does not say who led it


# ------------------------------------------------------------------------------------------ plan and report

def test_the_plan_reaches_matchmaking_and_the_report_the_host():
    plan = SharedRoundPlan(window_s=5.0)

    class Steered:
        def plan(self, *args):
            self.args = args

    steered = Steered()
    plan.steer(steered)
    assert steered.args == (None, 5.0, [], 0, False) and plan.fragment == 0
    plan.set(3, 2.5, ["a", "b"], max_group_size=4, fragment=1)
    plan.steer(steered)
    assert steered.args == (3, 2.5, ["a", "b"], 4, False) and plan.fragment == 1
    plan.set(3, 2.5, ["a", "b"], max_group_size=4, fragment=1, follows_only=True)  # a relayed peer, a client
    plan.steer(steered)
    assert steered.args == (3, 2.5, ["a", "b"], 4, True)

    report = RoundReport()
    report.count_incomplete()
    report.record_failed(["x", "y"])
    assert report.incomplete_rounds == 1 and report.failed_members == {"x", "y"}


# --------------------------------------------------------------------------------------------- round.py

def test_a_formed_groups_metadata_weights_and_kind_are_read_alike_by_every_member():
    group = GroupInfo(b"g", (peer(1), peer(2), peer(3)), (
        join_entry({"weight": 8, "admission": b"t", "digest": "a", "mixing": True}),
        join_entry({"weight": -1, "digest": "b", "mixing": True}, mode=1),  # client mode: reduces nothing
        join_entry({"weight": "lots", "digest": "a", "mixing": True}, bandwidth=2.0)))
    gathered, bandwidths = read_gathered(SERIALIZER, group)
    assert "admission" not in gathered[peer(1).to_base58()] and bandwidths == [1.0, 0.0, 2.0]
    assert claimed_weights(group, gathered) == [8.0, 0.0, 0.0]
    assert claimed_weights(group, {}) == [1.0, 1.0, 1.0]  # no metadata: weight 1
    assert mixes_states(gathered, keeps_state=True) and not mixes_states(gathered, keeps_state=False)
    assert not mixes_states({k: dict(v, digest="a") for k, v in gathered.items()}, keeps_state=True)
    assert not nobody_contributes(SERIALIZER, group)
    assert [own_norm_scale(m) for m in ({"norm_scale": 4.0}, {"norm_scale": 0.5}, {"norm_scale": math.inf}, None)] \
        == [4.0, 1.0, 1.0, 1.0]


def test_peer_lists_are_cut_whole_and_the_schema_names_what_a_group_must_share():
    ids = [f"peer{i:03d}" for i in range(10)]
    assert split_ids(joined_ids(ids, max_bytes=23)) == ids[:3]  # 7 bytes each and a comma: the 4th does not fit
    tensors = [torch.zeros(3, 2)]
    base = schema_hash(tensors, "fp16", 128, "mean")
    assert base == schema_hash([torch.ones(3, 2)], "fp16", 128, "mean")  # shapes, not values
    others = {schema_hash(tensors, "fp32", 128, "mean"), schema_hash(tensors, "fp16", 128, "clip"),
              schema_hash([torch.zeros(6)], "fp16", 128, "mean"), schema_hash(tensors, "sparse", 64, "mean"),
              schema_hash(tensors, "sparse", 128, "mean")}
    assert base not in others and len(others) == 5 and PROTOCOL_VERSION == 12


# ------------------------------------------------------------------------------------------------- audits

class AuditedReducer:
    """A reducer's stub as an auditor sees it: it shows the inputs of one part, or not."""

    def __init__(self, inputs: List[bytes], shows: bool = True):
        self.inputs, self.shows, self.asked = inputs, shows, []

    async def rpc_audit_input(self, request):
        self.asked.append(request.sender_index)
        return p2ptrain_pb2.AuditInput(available=self.shows, tensor_part=self.inputs[request.sender_index])


def signed_answer(inputs: List[torch.Tensor], scale: float = 1.0):
    """A reducer's answer for one part (the mean of ``inputs``, times ``scale``) with its receipt, and the inputs as
    sent (serialized)."""
    messages = [CODEC.compress(t, CompressionInfo.from_tensor(t)) for t in inputs]
    receipt = make_receipt([(commitment(m), 1.0) for m in messages], math.inf, "mean")
    mean = torch.stack([CODEC.extract(m) for m in messages]).mean(0) * scale
    answer = averaging_pb2.AveragingData(tensor_part=CODEC.compress(mean, CompressionInfo.from_tensor(mean)),
                                         peer_id=p2ptrain_pb2.AnswerSignature(receipt=receipt).SerializeToString())
    return answer, [m.SerializeToString() for m in messages]


@pytest.mark.parametrize("scale, shows, caught", [(1.0, True, ""), (1.5, True, "audited, part #0 of a group: it "
                                                  "signed an average at distance"), (1.0, False, "did not show")])
def test_an_audit_recomputes_a_part_and_excludes_and_reports_a_reducer_that_lied(scale, shows, caught):
    gen = torch.Generator().manual_seed(0)
    answer, inputs = signed_answer([torch.randn(256, generator=gen) for _ in range(3)], scale)
    reducer, reports = AuditedReducer(inputs, shows), []
    host = FakeHost(peer(1), stubs={peer(2): reducer})
    audits = Audits(host.context(), 1, lambda *args, **kwargs: reports.append((args, kwargs)))

    async def audit():
        audits.start(b"g", [(peer(2), 0, answer)], CODEC)
        await asyncio.gather(*audits._tasks)

    asyncio.run(audit())
    assert reducer.asked == ([0, 1, 2] if shows else [0])
    if not caught:
        assert host.bans == [] and reports == [] and audits.counts == {"parts": 1, "bytes": sum(map(len, inputs)),
                                                                        "caught": 0, "spilled": 0}
        return
    (banned, why), = host.bans
    assert banned == peer(2) and caught in why
    if shows:  # the proof, small enough for the DHT record: the inputs go inside
        (args, kwargs), = reports
        assert args[:3] == (b"g", peer(2), 0) and kwargs["inputs"] == inputs and kwargs["serve"] == ()
        assert audits.counts["caught"] == 1


def test_a_reducer_shows_its_kept_inputs_to_its_group_only_and_keeps_a_few_rounds():
    audits = Audits(FakeHost(peer(1)).context(), 1, lambda *a, **k: None)
    part = CODEC.compress(torch.ones(4), CompressionInfo.from_tensor(torch.ones(4)))
    for round_index in range(6):
        audits.keep(bytes([round_index]), [peer(1), peer(2)], {(0, 1): part})
    request = p2ptrain_pb2.AuditRequest(group_id=bytes([5]), part_index=0, sender_index=1)
    assert audits.input_for(request, peer(2)).tensor_part == part.SerializeToString()
    assert not audits.input_for(request, peer(3)).available  # not a member of that group
    assert not audits.input_for(p2ptrain_pb2.AuditRequest(group_id=bytes([0]), part_index=0, sender_index=1),
                                peer(2)).available  # an older round than KEPT_ROUNDS
    with pytest.raises(ValueError):
        Audits(FakeHost(peer(1)).context(), -1, lambda *a, **k: None)


# ----------------------------------------------------------------------------------------------- evidence

class FakeDHT:
    """A DHT of one key's subkeys: ``store`` and ``get`` as the parts call them."""

    def __init__(self):
        self.records: Dict[str, dict] = {}

    async def store(self, key, value, expiration, subkey, return_future):
        self.records.setdefault(key, {})[subkey] = ValueWithExpiration(value, expiration)

    async def get(self, key, latest, return_future):
        found = self.records.get(key)
        return None if found is None else ValueWithExpiration(found, math.inf)


@pytest.fixture(scope="module")
def identity():
    return PeerSignatureValidator(rsa.generate_private_key(public_exponent=65537, key_size=2048))


def test_evidence_one_peer_stores_convicts_its_reducer_on_another_peer(identity):
    """A signed NaN average refused by one peer's runner goes into its evidence record; another peer reading the
    records excludes the reducer, and serves nothing of it to a peer without the swarm key."""
    dht, reducer_signer = FakeDHT(), AverageSigner(identity)
    reducer = peer_id_of(reducer_signer.public_der)
    nan = torch.full((8,), float("nan"))
    average = CODEC.compress(nan, CompressionInfo.from_tensor(nan))
    receipt = make_receipt([None], math.inf, "mean")
    answer = averaging_pb2.AveragingData(tensor_part=average,
                                         peer_id=reducer_signer.sign(b"g", 0, receipt, average))
    accuser, reader = FakeHost(peer(1), PRIVATE, dht), FakeHost(peer(3), PRIVATE, dht)
    accusing, reading = (Evidence(h.context(), None, CODEC, 10.0) for h in (accuser, reader))

    async def run():
        accusing.report_bad_average(b"g", reducer, 0, answer, "NaN values")
        accusing.report_bad_average(b"g", reducer, 1, averaging_pb2.AveragingData(tensor_part=average), "unsigned")
        await asyncio.sleep(0)  # the record's store
        await reading.read()
        await reading.read()  # judged once

    asyncio.run(run())
    items = p2ptrain_pb2.Evidence.FromString(dht.records[evidence_key("run")][peer(1).to_bytes()].value).items
    assert [item.part_index for item in items] == [0]  # the unsigned answer proves nothing: not kept
    assert [(p, why) for p, why in reader.bans] == [
        (reducer, f"peer {peer(1)} holds its signed average of part #0 of a group: it signed an average with NaN or "
                  "infinite values")]
    digest = hashlib.sha256(items[0].SerializeToString()).digest()
    asked = p2ptrain_pb2.ProofRequest(item=digest, whole_item=True, admission=PRIVATE.token(peer(3)))
    assert accusing.proof_for(asked, peer(3)).available
    assert not accusing.proof_for(p2ptrain_pb2.ProofRequest(item=digest, whole_item=True), peer(4)).available


# ------------------------------------------------------------------------------------ state donor, download

def donor_of(me: PeerID, flat: torch.Tensor, outer_step: int = 3, sharing=lambda: True) -> StateDonor:
    metadata = SERIALIZER.dumps(dict(outer_step=outer_step, digest="d", shapes=[[flat.numel()]]))

    async def state_from_host():
        return metadata, [flat.clone()], None

    return StateDonor(FakeHost(me, PRIVATE).context(), SERIALIZER, state_from_host, sharing)


class DonorStub:
    """A donor's stub as a newcomer sees it: its calls reach the donor's part with the newcomer's id."""

    def __init__(self, donor: StateDonor, caller: PeerID):
        self.donor, self.caller = donor, caller

    async def rpc_state_info(self, request):
        return await self.donor.info(request, self.caller)

    async def rpc_state_chunk(self, request):
        return self.donor.chunk(request, self.caller)


def test_a_newcomer_takes_the_state_in_chunks_from_two_donors():
    flat = torch.arange(CHUNK_VALUES + 1000, dtype=torch.float32)  # two chunks
    newcomer, dht = peer(9), FakeDHT()
    donors = {peer(1): donor_of(peer(1), flat), peer(2): donor_of(peer(2), flat)}
    for donor in donors:
        asyncio.run(dht.store("key.all_averagers", 1.0, math.inf, donor.to_bytes(), True))
    host = FakeHost(newcomer, PRIVATE, dht, {p: DonorStub(d, newcomer) for p, d in donors.items()})
    evidence_reads = []

    async def read_evidence():
        evidence_reads.append(1)

    download = StateDownload(host.context(), SERIALIZER, total_size=flat.numel(), group_key_prefix=lambda: "key",
                             read_evidence=read_evidence)
    future = MPFuture()

    async def run():
        await download.run(30.0, future)
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()  # the donors' idle timers

    asyncio.run(run())
    state = future.result()
    assert torch.equal(state.flat, flat) and state.outer_step == 3 and state.metadata["digest"] == "d"
    assert sum(state.chunks_by_donor.values()) == 2 and state.failed_donors == [] and evidence_reads
    assert sum(d.states_served for d in donors.values()) == 2
    assert sum(d.state_bytes_served for d in donors.values()) == flat.numel() * 4


def test_a_donor_refuses_its_state_without_the_key_when_excluded_or_not_sharing():
    flat = flatten_state([torch.ones(10), torch.zeros(3)])
    donor = donor_of(peer(1), flat)
    keyed = p2ptrain_pb2.StateInfoRequest(admission=PRIVATE.token(peer(2)))

    async def run():
        info = await donor.info(keyed, peer(2))
        assert info.available and info.outer_step == 3 and info.num_values == 13
        chunk = donor.chunk(p2ptrain_pb2.StateChunkRequest(outer_step=3, digest="d", index=0,
                                                           admission=PRIVATE.token(peer(2))), peer(2))
        assert torch.equal(torch.frombuffer(bytearray(chunk.values), dtype=torch.float32), flat)
        assert not donor.chunk(p2ptrain_pb2.StateChunkRequest(outer_step=2, digest="d", index=0,
                                                              admission=PRIVATE.token(peer(2))), peer(2)).available
        assert not (await donor.info(p2ptrain_pb2.StateInfoRequest(), peer(3))).available
        donor._context.ban(peer(2), "caught")
        assert not (await donor.info(keyed, peer(2))).available
        assert not (await donor_of(peer(1), flat, sharing=lambda: False).info(keyed, peer(4))).available
        for task in asyncio.all_tasks() - {asyncio.current_task()}:
            task.cancel()

    asyncio.run(run())


# ------------------------------------------------------------------------------------------------ sparse gather

class PieceStub:
    """A member's stub as another member sees it: its pieces reach the other's part with the sender's id."""

    def __init__(self, gather: SparseGather, sender: PeerID):
        self.gather, self.sender = gather, sender

    async def rpc_sparse_piece(self, request):
        return self.gather.take_piece(request, self.sender)


def test_the_sparse_gather_of_three_members_gives_each_the_same_average():
    shapes = [(64, 64), (100,)]
    layout = Layout(tuple(shapes), k=32)
    members = [peer(1), peer(2), peer(3)]
    hosts = {p: FakeHost(p, PRIVATE) for p in members}
    gathers = {p: SparseGather(hosts[p].context(), layout, [[0, 1]], 10.0) for p in members}
    for p in members:
        hosts[p].stubs.update({q: PieceStub(gathers[q], p) for q in members if q != p})
    messages, gen = [], torch.Generator().manual_seed(0)
    for p in members:
        accumulator = [torch.zeros(s) for s in shapes]
        accumulate_(accumulator, [torch.randn(s, generator=gen) for s in shapes])
        message, _ = send_(accumulator, layout)
        gathers[p].write_message(message)
        messages.append(message)
    tensors = {p: [torch.zeros(s) for s in shapes] for p in members}
    group = GroupInfo(b"g", tuple(members), ())
    gathered = {p.to_base58(): {"weight": 1.0} for p in members}

    async def run():
        return await asyncio.gather(*(gathers[p].run_group(tensors[p], group, gathered, 10.0, 0, None, print)
                                      for p in members))

    results = asyncio.run(run())
    expected = average_messages(messages, layout)
    for p, result in zip(members, results):
        assert result.group_size == 3 and result.bytes_sent == 2 * len(messages[members.index(p)])
        assert all(torch.equal(t, e) for t, e in zip(tensors[p], expected))
    assert all(h.bans == [] for h in hosts.values())


def test_a_sparse_piece_that_does_not_fit_excludes_its_sender_and_a_silent_member_fails_the_round(monkeypatch):
    layout = Layout(((16, 16),), k=8)
    host = FakeHost(peer(1), PRIVATE)
    gather = SparseGather(host.context(), layout, [[0]], 10.0)
    piece = dict(group_id=b"g", index=0, pieces=1, fragment=0, admission=PRIVATE.token(peer(2)))
    assert not gather.take_piece(p2ptrain_pb2.SparsePiece(**dict(piece, fragment=1), data=b"x"), peer(2)).accepted
    assert host.bans[0][0] == peer(2) and "fragment 1, of 1" in host.bans[0][1]
    assert not gather.take_piece(p2ptrain_pb2.SparsePiece(**piece, data=b"x"), peer(3)).accepted  # no key
    assert len(host.bans) == 1

    monkeypatch.setattr("p2ptrain.averaging.sparse_round.START_TIMEOUT_S", 0.2)
    host.stubs[peer(4)] = PieceStub(SparseGather(FakeHost(peer(4)).context(), layout, [[0]], 10.0), peer(1))
    accumulator = [torch.randn(16, 16)]
    gather.write_message(send_(accumulator, layout)[0])
    failed = []
    group = GroupInfo(b"h", (peer(1), peer(4)), ())
    with pytest.raises(IncompleteRoundError):
        asyncio.run(gather.run_group([torch.zeros(16, 16)], group, {}, 5.0, 0, None, failed.extend))
    assert failed == [peer(4).to_base58()]  # it sent nothing
