"""Receipts and audits of reducers (averaging/audit.py): what a sender refuses, what an audit convicts, and that an
accuser cannot frame an honest reducer."""

from __future__ import annotations

import asyncio
import random
import tempfile

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.compression import CompressionInfo
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2

from p2ptrain.averaging import audit
from p2ptrain.averaging.audit import (AUDIT_TOLERANCE, KEPT_ROUNDS, Audits, check_receipt, choose_audits, commitment,
                                      commitment_of, make_receipt, verdict)
from p2ptrain.averaging.compression import get_compression
from p2ptrain.averaging.evidence import AverageSigner, judge, signed_average, verified_receipt
from p2ptrain.averaging.robust import weight_cap
from p2ptrain.averaging.wire_part import WireTensor
from p2ptrain.proto import p2ptrain_pb2
from p2ptrain.security import PeerSignatureValidator, peer_id_of
from tests.reducers import reduce_part

GROUP = b"g" * 32
CODEC = get_compression("fp16")


@pytest.fixture(scope="module")
def signer():
    return AverageSigner(PeerSignatureValidator(rsa.generate_private_key(public_exponent=65537, key_size=2048)))


def _peer_of(signer) -> PeerID:
    return peer_id_of(signer.public_der)


def honest_inputs(n: int = 4, size: int = 512, seed: int = 0):
    """n senders' serialized fp16 parts (one direction plus noise), their decoded values and commitments."""
    gen = torch.Generator().manual_seed(seed)
    signal = torch.randn(size, generator=gen)
    messages = [CODEC.compress(t, CompressionInfo.from_tensor(t))
                for t in (signal + 0.5 * torch.randn(size, generator=gen) for _ in range(n))]
    serialized = [m.SerializeToString() for m in messages]
    return serialized, [CODEC.extract(m) for m in messages], [commitment(m) for m in messages]


def reduce(values, weights, aggregation: str, order, cap: float = float("inf")) -> torch.Tensor:
    """What p2ptrain's reducer answers when the senders' parts arrive in ``order``."""
    answers, reducer = reduce_part(values, weights, aggregation, order, cap)
    assert reducer.included_by_part[0] == sorted(order)
    return answers[0]


def answer_of(average: torch.Tensor) -> bytes:
    return CODEC.compress(average, CompressionInfo.from_tensor(average)).SerializeToString()


def message_of(serialized: bytes) -> runtime_pb2.Tensor:
    return runtime_pb2.Tensor.FromString(serialized)


def receipt_of(commitments, weights, cap=float("inf"), aggregation="mean", left_out=()):
    entries = [None if i in left_out else (c, w) for i, (c, w) in enumerate(zip(commitments, weights))]
    return p2ptrain_pb2.Receipt.FromString(make_receipt(entries, cap, aggregation))


def test_a_sender_refuses_a_receipt_that_leaves_out_or_alters_its_part():
    _, _, commitments = honest_inputs()
    weights = [8.0, 8.0, 16.0, 8.0]
    ok = dict(senders=4, me=2, sent=commitments[2], weight=16.0, weight_cap=float("inf"), aggregation="mean")
    assert check_receipt(receipt_of(commitments, weights), **ok) == ""
    assert "leaves this peer's part out" in check_receipt(receipt_of(commitments, weights, left_out=(2,)), **ok)
    # another member left out is not this sender's to judge: its part may have failed honestly
    assert check_receipt(receipt_of(commitments, weights, left_out=(0,)), **ok) == ""
    swapped = list(commitments)
    swapped[2] = commitment(message_of(answer_of(torch.ones(512))))
    assert "not the one this peer sent" in check_receipt(receipt_of(swapped, weights), **ok)
    assert "weighs this peer's part 1.0" in check_receipt(receipt_of(commitments, [8.0, 8.0, 1.0, 8.0]), **ok)
    assert "weight cap" in check_receipt(receipt_of(commitments, weights, cap=16.0), **ok)
    assert "aggregation" in check_receipt(receipt_of(commitments, weights, aggregation="trim"), **ok)
    assert "for 4 senders, not 5" in check_receipt(receipt_of(commitments, weights), **dict(ok, senders=5))


def test_the_signature_binds_the_receipt_and_the_average(signer):
    serialized, values, commitments = honest_inputs()
    average = message_of(answer_of(reduce(values, [1.0] * 4, "mean", range(4))))
    receipt = make_receipt([(c, 1.0) for c in commitments], float("inf"), "mean")
    field = signer.sign(GROUP, 3, receipt, average)
    reducer = _peer_of(signer)
    assert verified_receipt(reducer, GROUP, 3, field, average).commitments == commitments
    assert verified_receipt(reducer, GROUP, 4, field, average) is None  # another part
    assert verified_receipt(reducer, b"h" * 32, 3, field, average) is None  # another group
    assert verified_receipt(reducer, GROUP, 3, field, message_of(answer_of(torch.zeros(512)))) is None
    other = AverageSigner(PeerSignatureValidator(rsa.generate_private_key(public_exponent=65537, key_size=2048)))
    assert verified_receipt(_peer_of(other), GROUP, 3, field, average) is None  # someone else's key
    tampered = p2ptrain_pb2.AnswerSignature.FromString(field)
    tampered.receipt = make_receipt([(c, 2.0) for c in commitments], float("inf"), "mean")
    assert verified_receipt(reducer, GROUP, 3, tampered.SerializeToString(), average) is None
    assert verified_receipt(reducer, GROUP, 3, b"", average) is None


@pytest.mark.parametrize("aggregation", ["mean", "clip", "trim", "mean+check", "trim+check"])
def test_an_honest_average_passes_its_audit_whatever_the_arrival_order(aggregation):
    serialized, values, commitments = honest_inputs(5)
    weights = [8.0, 8.0, 8.0, 24.0, 0.0]
    cap = weight_cap(weights)
    receipt = receipt_of(commitments, weights, cap=cap, aggregation=aggregation)
    for seed in range(5):
        order = list(range(5))
        random.Random(seed).shuffle(order)
        average = reduce(values, weights, aggregation, order, cap)
        assert verdict(receipt, serialized, answer_of(average), CODEC) == ""


def test_an_audit_convicts_a_scaled_average_and_a_dropped_member():
    serialized, values, commitments = honest_inputs()
    weights = [1.0] * 4
    receipt = receipt_of(commitments, weights)
    honest = reduce(values, weights, "mean", range(4))
    assert verdict(receipt, serialized, answer_of(honest), CODEC) == ""
    assert "from the mean of the 4 inputs" in verdict(receipt, serialized, answer_of(1.5 * honest), CODEC)
    without_one = reduce(values[:3], weights[:3], "mean", range(3))
    assert "it signed an average at distance" in verdict(receipt, serialized, answer_of(without_one), CODEC)
    # what AUDIT_TOLERANCE lets through: a shade of its share of the norm, no more
    assert verdict(receipt, serialized, answer_of(honest * (1 + AUDIT_TOLERANCE / 2)), CODEC) == ""
    assert verdict(receipt, serialized, answer_of(honest * (1 + 2 * AUDIT_TOLERANCE)), CODEC) != ""
    # the receipt says which parts were in: a member left out (its part failed) is consistent, not a lie
    left_out = receipt_of(commitments, weights, left_out=(3,))
    assert verdict(left_out, serialized[:3] + [b""], answer_of(without_one), CODEC) == ""


def test_nothing_averaged_is_zeros_and_an_undecodable_input_convicts():
    serialized, values, commitments = honest_inputs(3)
    zero = receipt_of(commitments, [0.0, 0.0, 0.0])
    assert verdict(zero, serialized, answer_of(torch.zeros(512)), CODEC) == ""
    assert verdict(zero, serialized, answer_of(torch.ones(512)), CODEC) != ""
    junk = [serialized[0], b"\x0a\x03abc", serialized[2]]
    receipt = receipt_of([commitment(message_of(s)) for s in junk], [1.0] * 3)
    assert "does not decode" in verdict(receipt, junk, answer_of(values[0]), CODEC)


def test_an_accuser_cannot_frame_an_honest_reducer(signer):
    serialized, values, commitments = honest_inputs()
    weights = [1.0] * 4
    receipt = receipt_of(commitments, weights)
    honest = reduce(values, weights, "mean", range(4))
    # inputs that are not the committed ones prove nothing, whatever they average to
    forged = list(serialized)
    forged[1] = answer_of(values[1] * 10)
    assert verdict(receipt, forged, answer_of(honest), CODEC) == ""
    assert verdict(receipt, serialized[:3], answer_of(honest), CODEC) == ""  # an input missing
    # as evidence: signed by the reducer, judged by a third party
    message = _answer(signer, receipt.SerializeToString(), answer_of(honest))
    item = p2ptrain_pb2.SignedAverage.FromString(signed_average(_peer_of(signer), GROUP, 0, message, "audit",
                                                                serialized))
    assert judge(item, CODEC, None, None) == ""
    framed = p2ptrain_pb2.SignedAverage.FromString(signed_average(_peer_of(signer), GROUP, 0, message, "audit",
                                                                  forged))
    assert judge(framed, CODEC, None, None) == ""
    scaled = _answer(signer, receipt.SerializeToString(), answer_of(1.5 * honest))
    guilty = p2ptrain_pb2.SignedAverage.FromString(signed_average(_peer_of(signer), GROUP, 0, scaled, "audit",
                                                                  serialized))
    assert "it signed an average at distance" in judge(guilty, CODEC, None, None)  # a newcomer convicts on it too
    guilty.average = answer_of(honest)  # the accuser swaps in another average: the signature no longer holds
    assert judge(guilty, CODEC, None, None) == ""


def _answer(signer, receipt: bytes, average: bytes):
    return averaging_pb2.AveragingData(tensor_part=message_of(average),
                                       peer_id=signer.sign(GROUP, 0, receipt, message_of(average)))


def test_audits_never_pick_the_own_range_and_catch_a_full_cheat_as_stated():
    parts = [3, 0, 3, 3, 3]  # a client-mode member reduces nothing
    for me in range(5):
        chosen = choose_audits(parts, me, 2)
        assert len(chosen) == 2 and all(peer != me and part < parts[peer] for peer, part in chosen)
    assert choose_audits(parts, 0, 100) == {(p, i) for p in (2, 3, 4) for i in range(3)}
    assert choose_audits(parts, 0, 0) == set()
    # a reducer that cheats on all of its parts, in a group of 4 equal ranges where the 3 others audit one part
    # each: caught with probability 1 - (2/3)^3 = 0.704 per round
    trials, caught = 4000, 0
    for _ in range(trials):
        caught += any(any(peer == 0 for peer, _ in choose_audits([3, 3, 3, 3], me, 1)) for me in (1, 2, 3))
    assert abs(caught / trials - (1 - (2 / 3) ** 3)) < 0.03


def test_a_commitment_binds_every_field_of_the_part():
    message = message_of(answer_of(torch.randn(512)))
    base = commitment(message)
    assert commitment(message_of(message.SerializeToString())) == base  # what the reducer parses: the same
    for change in (lambda m: m.size.__setitem__(0, 256), lambda m: setattr(m, "dtype", "bfloat16"),
                   lambda m: setattr(m, "compression", 0), lambda m: setattr(m, "requires_grad", True),
                   lambda m: setattr(m, "chunks", 2), lambda m: setattr(m, "buffer", m.buffer[:-2] + b"\0\0")):
        other = message_of(message.SerializeToString())
        change(other)
        assert commitment(other) != base


def _kept_round(tmp_dir, inputs, members):
    """An ``Audits`` with no memory for inputs that kept ``inputs`` for GROUP and set them aside after the round, with
    ``tmp_dir`` as TMPDIR."""
    tempfile.tempdir = str(tmp_dir)
    try:
        async def run():
            audits = Audits(None, 1, report=lambda *args, **kwargs: None)
            audits.memory_budget = 0
            audits.keep(GROUP, members, inputs)
            audits.set_aside(GROUP)
            await asyncio.gather(*audits._tasks)
            return audits
        return asyncio.run(run())
    finally:
        tempfile.tempdir = None


def _served(audits, part_index, sender_index, caller):
    request = p2ptrain_pb2.AuditRequest(group_id=GROUP, part_index=part_index, sender_index=sender_index)
    answer = audits.input_for(request, caller)
    return answer.tensor_part if answer.available else None


def test_a_reducer_keeps_its_audit_inputs_in_a_file_without_a_name_after_the_round(tmp_path):
    """Up to 4 rounds of inputs (4 copies of the vector in wire format) stayed in the averager's memory."""
    serialized, _, commitments = honest_inputs(3)
    inputs = {(0, i): message_of(s) for i, s in enumerate(serialized)}
    # as the part stream receives them: the fields and a view of the bytes it read (written out without a copy)
    inputs[(0, 1)] = WireTensor.of(inputs[(0, 1)], memoryview(bytearray(inputs[(0, 1)].buffer)))
    auditor, stranger = PeerID(b"\x12\x20" + b"a" * 32), PeerID(b"\x12\x20" + b"b" * 32)
    audits = _kept_round(tmp_path, inputs, [auditor])
    assert inputs == {} and len(audits._kept[GROUP].spilled) == 3  # out of memory...
    assert audits.counts["spilled"] == sum(map(len, serialized))
    assert list(tmp_path.iterdir()) == []  # ... into a file no exit can leave behind
    for i, expected in enumerate(serialized):
        served = _served(audits, 0, i, auditor)
        assert served == expected and commitment_of(served) == commitments[i]
    assert _served(audits, 0, 3, auditor) is None and _served(audits, 1, 0, auditor) is None
    assert _served(audits, 0, 0, stranger) is None  # only to a member of the group
    audits._kept[GROUP].inputs[(1, 0)] = message_of(serialized[0])  # a slow sender's part, after we went on
    assert _served(audits, 1, 0, auditor) == serialized[0]
    spilled = audits._kept[GROUP].spilled
    for later in range(KEPT_ROUNDS):  # the round is dropped with the rounds after it: its file is closed
        audits.keep(bytes([later]) * 32, [auditor], {})
    assert GROUP not in audits._kept and spilled.get((0, 0)) is None


def test_audit_inputs_stay_in_memory_when_the_temporary_directory_cannot_take_them(tmp_path):
    serialized, _, _ = honest_inputs(2)
    inputs = {(0, i): message_of(s) for i, s in enumerate(serialized)}
    auditor = PeerID(b"\x12\x20" + b"a" * 32)
    audits = _kept_round(tmp_path / "missing", inputs, [auditor])
    assert len(inputs) == 2 and audits._kept[GROUP].spilled is None
    assert [_served(audits, 0, i, auditor) for i in range(2)] == serialized


def test_the_oldest_rounds_inputs_go_out_first_and_only_over_the_memory_budget(tmp_path, monkeypatch):
    serialized, _, _ = honest_inputs(2)
    part_bytes = message_of(serialized[0]).ByteSize()
    monkeypatch.setenv("P2PTRAIN_AUDIT_MEMORY_MB", str(2.5 * 2 * part_bytes / 1e6))  # two and a half rounds
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    auditor = PeerID(b"\x12\x20" + b"a" * 32)
    rounds = [bytes([k]) * 32 for k in range(4)]

    async def run():
        audits = Audits(None, 1, report=lambda *args, **kwargs: None)
        assert audits.memory_budget == int(2.5 * 2 * part_bytes)
        for group in rounds:
            audits.keep(group, [auditor], {(0, i): message_of(s) for i, s in enumerate(serialized)})
            audits.set_aside(group)
            await asyncio.gather(*audits._tasks)
        return audits
    audits = asyncio.run(run())
    assert [audits._kept[g].spilled is not None for g in rounds] == [True, True, False, False]
    for group in rounds:
        served = [audits.input_for(p2ptrain_pb2.AuditRequest(group_id=group, part_index=0, sender_index=i), auditor)
                  for i in range(2)]
        assert [answer.tensor_part for answer in served] == serialized
    monkeypatch.setenv("P2PTRAIN_AUDIT_MEMORY_MB", "lots")  # not a number: the share of the RAM, and a warning
    assert Audits(None, 1, report=None).memory_budget > 0


@pytest.mark.parametrize("keep_last, shown", [(0, [False, False, True]), (2, [False, True, True])])
def test_under_the_replay_check_the_last_two_rounds_inputs_are_shown_whatever_their_age(monkeypatch, keep_last,
                                                                                           shown):
    """Audits are asked within seconds of their round; a replay may fetch a sender's parts of two rounds ago, phases
    of minutes apart: those rounds' inputs stay shown past ``AUDIT_KEEP_S`` (the older ones go by age as before)."""
    serialized, _, _ = honest_inputs(2)
    auditor = PeerID(b"\x12\x20" + b"a" * 32)
    clock = [1000.0]
    monkeypatch.setattr(audit.time, "monotonic", lambda: clock[0])
    audits = Audits(None, 1, report=lambda *args, **kwargs: None)
    audits.keep_last = keep_last
    rounds = [bytes([k]) * 32 for k in range(3)]
    for group in rounds:
        audits.keep(group, [auditor], {(0, i): message_of(s) for i, s in enumerate(serialized)})
        clock[0] += audit.AUDIT_KEEP_S + 1  # a long phase between rounds
    clock[0] -= audit.AUDIT_KEEP_S  # the last round is young
    request = (lambda group: p2ptrain_pb2.AuditRequest(group_id=group, part_index=0, sender_index=1))
    assert [audits.input_for(request(group), auditor).available for group in rounds] == shown


@pytest.mark.parametrize("values", [0, 1, 100, 1 << 21])
def test_a_kept_wire_tensor_is_written_as_protobuf_serializes_it(values):
    """Written as its fields around a view of its bytes (no copy): what an auditor reads back must be the sender's
    message to the byte, the length's varint of one to three bytes included."""
    from p2ptrain.averaging.kept_inputs import serialized_pieces
    part = torch.arange(values, dtype=torch.float16)
    wire = WireTensor(memoryview(part.numpy()).cast("B") if values else b"", (values,), "float16", 3)
    assert b"".join(bytes(piece) for piece in serialized_pieces(wire)) == wire.to_proto().SerializeToString()
