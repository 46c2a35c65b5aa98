"""The sender check's swarm side (averaging/sender_scores.py, reducer.py, audit.py): the sums reducers sign, what a
member adds up and convicts, what a sender refuses and what an audit convicts of them."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hivemind.compression import CompressionInfo
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2

from p2ptrain.averaging.audit import check_receipt, commitment, make_receipt, verdict
from p2ptrain.averaging.bans import Bans
from p2ptrain.averaging.compression import get_compression
from p2ptrain.averaging.robust import check_aggregation
from p2ptrain.averaging.sender_scores import CONVICTION_S, STEPS_POWER, RoundSums, SenderChecks
from p2ptrain.proto import p2ptrain_pb2
from p2ptrain.sender_check import ROUNDS, round_scores
from tests.reducers import reduce_part as run_reducer

CODEC = get_compression("fp16")
CHECKED = "mean+check"
PEERS = [PeerID(f"peer-{i}".encode()) for i in range(5)]


def pseudo_gradients(n: int, size: int, seed: int, scale=None) -> list:
    """n senders' vectors, fp16-rounded as the wire carries them: one shared direction plus each one's noise;
    ``scale``: sender -> factor."""
    gen = torch.Generator().manual_seed(seed)
    shared = torch.randn(size, generator=gen)
    vectors = [CODEC.roundtrip(shared + 0.7 * torch.randn(size, generator=gen)) for _ in range(n)]
    for i, factor in (scale or {}).items():
        vectors[i] = CODEC.roundtrip(factor * vectors[i])
    return vectors


def reduce_part(parts, weights, aggregation=CHECKED, left_out=()):
    """One reducer's part: its receipt, as p2ptrain's reducer signs it, with the senders' serialized inputs."""
    _, reducer = run_reducer(parts, weights, aggregation, [i for i in range(len(parts)) if i not in left_out])
    sums = reducer.sums_by_part.get(0)
    messages = [CODEC.compress(p, CompressionInfo.from_tensor(p)) for p in parts]
    entries = [None if i in left_out else (commitment(m), w) for i, (m, w) in enumerate(zip(messages, weights))]
    receipt = p2ptrain_pb2.Receipt.FromString(make_receipt(entries, float("inf"), aggregation, sums))
    return receipt, [b"" if i in left_out else m.SerializeToString() for i, m in enumerate(messages)]


def round_sums(vectors, weights, cuts, left_out=()) -> RoundSums:
    """Every part's receipt of a round whose vector is cut at ``cuts``, added up as a member does."""
    sums = RoundSums(len(vectors))
    for start, end in zip(cuts, cuts[1:]):
        sums.add(reduce_part([v[start:end] for v in vectors], weights, left_out=left_out)[0])
    return sums


def test_the_signed_sums_of_every_part_add_up_to_the_whole_vectors_scores():
    vectors = pseudo_gradients(4, 1000, seed=0, scale={3: 5.0})
    cuts = [0, 130, 400, 401, 777, 1000]
    scores = round_sums(vectors, [8.0] * 4, cuts).scores([p.to_base58() for p in PEERS[:4]], [1.0] * 4, len(cuts) - 1)
    for whole, (peer, added) in zip(round_scores([[v] for v in vectors]), scores.items()):
        assert added.relative == pytest.approx(whole.relative, rel=1e-6)
        assert added.norm_ratio == pytest.approx(whole.norm_ratio, rel=1e-6)
    assert [s.flagged() for s in scores.values()] == [False, False, False, True]


def test_only_senders_in_every_part_with_a_weight_are_scored():
    vectors = pseudo_gradients(5, 600, seed=1)
    ids = [p.to_base58() for p in PEERS]
    sums = round_sums(vectors, [8.0, 8.0, 8.0, 8.0, 0.0], [0, 300, 600])  # a newcomer's zeros weigh 0
    assert list(sums.scores(ids, [1.0] * 5, 2)) == ids[:4]
    assert sums.scores(ids, [1.0] * 5, 3) == {}  # a part's sums missing (an unsigned answer): no scores
    partly = RoundSums(5)
    partly.add(reduce_part([v[:300] for v in vectors], [8.0] * 5)[0])
    partly.add(reduce_part([v[300:] for v in vectors], [8.0] * 5, left_out=(2,))[0])  # it failed on that part
    assert list(partly.scores(ids, [1.0] * 5, 2)) == [ids[0], ids[1], ids[3], ids[4]]


def test_receipts_added_from_two_threads_at_once_are_all_counted():
    """A member adds its own range's receipts in the runner's executor threads, the others' in the event loop."""
    receipt, _ = reduce_part(pseudo_gradients(4, 64, seed=5), [1.0] * 4)
    sums = RoundSums(4)
    threads = [threading.Thread(target=lambda: [sums.add(receipt) for _ in range(2000)]) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sums.parts == 8000 and sums.parts_in == [8000] * 4
    assert sums.sums.squares[0] == pytest.approx(8000 * receipt.squares[0])


def test_a_sender_with_fewer_steps_is_scored_at_its_steps():
    """A slower peer (adaptive steps) or a newcomer sends a shorter pseudo-gradient and says so (norm_scale)."""
    vectors = pseudo_gradients(4, 800, seed=2, scale={0: 0.4})
    ids = [p.to_base58() for p in PEERS[:4]]
    sums = round_sums(vectors, [8.0] * 4, [0, 800])
    assert sums.scores(ids, [1.0] * 4, 1)[ids[0]].flagged()
    scaled = sums.scores(ids, [4.0, 1.0, 1.0, 1.0], 1)[ids[0]]
    assert scaled.norm_ratio == pytest.approx(sums.scores(ids, [1.0] * 4, 1)[ids[0]].norm_ratio * 4 ** STEPS_POWER)
    assert not scaled.flagged()


def test_a_poisoner_is_convicted_in_its_third_flagged_round_and_excluded_again_if_it_comes_back():
    bans = []
    checks = SenderChecks(CHECKED, lambda peer, reason, for_s: bans.append((peer, reason, for_s)))
    me = PEERS[1]
    for round_ in range(ROUNDS + 1):
        vectors = pseudo_gradients(4, 500, seed=10 + round_, scale={0: -1.0, 1: 5.0})  # me: flagged too
        checks.judge(round_sums(vectors, [8.0] * 4, [0, 250, 500]), PEERS[:4], {}, 2, me)
        if round_ < ROUNDS - 1:
            assert bans == []
    assert [(peer, for_s) for peer, _, for_s in bans] == [(PEERS[0], CONVICTION_S), (PEERS[0], CONVICTION_S)]
    assert "flagged in 3 rounds in a row" in bans[0][1] and "earlier" in bans[1][1]
    assert set(checks.check.convicted) == {PEERS[0].to_base58(), me.to_base58()}  # never excluding itself


def test_a_sender_refuses_a_receipt_whose_sums_are_missing_or_broken():
    vectors = pseudo_gradients(4, 100, seed=3)
    receipt, inputs = reduce_part(vectors, [1.0] * 4)
    me = dict(senders=4, me=0, sent=commitment(runtime_pb2.Tensor.FromString(inputs[0])), weight=1.0,
              weight_cap=float("inf"))
    assert check_receipt(receipt, aggregation=CHECKED, **me) == ""
    for field, values in (("dots", []), ("squares", [1.0, float("nan"), 1.0, 1.0]),
                          ("median_squares", [1.0, 1.0, -1.0, 1.0])):
        broken = p2ptrain_pb2.Receipt()
        broken.CopyFrom(receipt)
        del getattr(broken, field)[:]
        getattr(broken, field).extend(values)
        assert "sums" in check_receipt(broken, aggregation=CHECKED, **me), field


def test_an_audit_convicts_false_sums_and_passes_true_ones():
    vectors = pseudo_gradients(4, 400, seed=4, scale={2: 5.0})
    receipt, inputs = reduce_part(vectors, [1.0] * 4)
    average = CODEC.compress(torch.stack(vectors).mean(0), CompressionInfo.from_tensor(vectors[0]))
    assert verdict(receipt, inputs, average.SerializeToString(), CODEC) == ""
    receipt.squares[2] /= 25.0  # hides the x5 sender's norm
    assert "sums" in verdict(receipt, inputs, average.SerializeToString(), CODEC)


def test_the_sender_check_needs_signed_receipts_and_a_butterfly_round():
    assert check_aggregation("trim+check") == "trim+check"
    with pytest.raises(ValueError, match="identity key"):
        check_aggregation("mean+check", signed=False)
    with pytest.raises(ValueError, match="butterfly"):
        check_aggregation("mean+check", sparse=True)
    assert check_aggregation("mean", sparse=True, signed=False) == "mean"


def test_an_exclusion_extended_never_ends_sooner():
    bans = Bans()
    bans.add(PEERS[0], "convicted", CONVICTION_S)
    bans.add(PEERS[0], "a bad part")  # BAN_S, much shorter
    until, reason = bans._banned[PEERS[0]]
    assert reason == "convicted" and until - time.monotonic() > 0.99 * CONVICTION_S
