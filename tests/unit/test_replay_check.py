"""The replay check (replay_check.py): how far a sent pseudo-gradient is from its replay, who replays whom, and the
check acting among the attack suite's replicas (bench/replay_audit.py), replaying real inner steps."""

from __future__ import annotations

import json

import pytest
import torch

from p2ptrain.bench.convergence import Setup
from p2ptrain.bench.convergence_robust import run_robust
from p2ptrain.bench.replay_audit import ReplayAudit
from p2ptrain.bench.replicas import inner_optimizer, replica_data
from p2ptrain.config import DiLoCoConfig
from p2ptrain.model import build_model
from p2ptrain.replay_check import TOLERANCE, Audits, deviation, verdict


def test_a_replay_equal_up_to_fp16_rounding_is_no_deviation():
    replayed = [torch.randn(100), torch.randn(3, 4)]
    assert deviation(replayed, replayed) == 0.0
    # a change below fp16's resolution is not on the wire either
    assert deviation([t * (1 + 1e-5) for t in replayed], replayed) < 1e-3
    assert verdict(deviation([t.clone() for t in replayed], replayed)) is None


def test_a_drift_of_a_fifth_of_the_norm_convicts_and_says_how_far():
    torch.manual_seed(0)
    replayed = [torch.randn(1000)]
    bias = torch.randn(1000)
    sent = [replayed[0] + 0.2 * bias * replayed[0].norm() / bias.norm()]
    assert deviation(sent, replayed) == pytest.approx(0.2, rel=1e-3)
    why = verdict(deviation(sent, replayed))
    assert why is not None and "0.2 of its norm away from a replay" in why
    assert verdict(deviation(sent, replayed), tolerance=0.25) is None
    assert deviation([torch.ones(3)], [torch.zeros(3)]) == float("inf")


def test_mismatched_tensors_are_an_error_not_a_verdict():
    with pytest.raises(ValueError, match="2 sent tensors against 1"):
        deviation([torch.zeros(2), torch.zeros(2)], [torch.zeros(2)])
    with pytest.raises(ValueError, match=r"shape \(3,\) against a replayed one of \(2,\)"):
        deviation([torch.zeros(3)], [torch.zeros(2)])


def test_audits_never_pair_a_sender_with_itself_and_replay_at_their_rate():
    every = Audits(1.0, seed=0)
    pairs = every.draw(["a", "b", "c", "d"])
    assert sorted(sender for _, sender in pairs) == ["a", "b", "c", "d"]
    assert all(verifier != sender for verifier, sender in pairs)
    assert Audits(0.0, seed=0).draw(["a", "b"]) == [] and Audits(1.0).draw(["alone"]) == []
    some = Audits(0.25, seed=1)
    for _ in range(400):
        some.draw(["a", "b", "c", "d"])
    assert 0.2 < some.replayed / 1600 < 0.3
    with pytest.raises(ValueError, match="replay rate must be in"):
        Audits(1.5)


def test_replaying_every_sender_convicts_a_drift_in_its_first_round_and_no_honest_one(tmp_path):
    """Real inner steps replayed from each replica's claim: honest replays are bit-exact (deviation 0), a drift of a
    fifth of the norm is convicted by the replay of round 1 and left out from round 2; stale sends its first round
    honestly and is convicted in round 2; wrong data trains on other batches than it claims."""
    setup = Setup(model="tiny", peers=4, batch_size=2, steps=8, eval_batches=1)
    report = run_robust(setup, 2, ["mean"], ["drift", "stale", "wrong-data"], tmp_path, echo=lambda line: None,
                        replay_rate=1.0)
    runs = json.loads((tmp_path / "robust.json").read_text())["replays"]["mean"]
    assert runs["none"]["honest"] == {} and runs["none"]["honest_deviation"] == 0.0
    assert runs["none"]["overhead"] == pytest.approx(1.0) and runs["none"]["replays"] == 4 * 4
    assert runs["drift"]["attackers"] == [1] and runs["drift"]["honest"] == {}
    assert runs["stale"]["attackers"] == [2] and runs["wrong-data"]["attackers"] == [1]
    assert all(runs[name]["honest_deviation"] == 0.0 for name in runs)
    assert runs["drift"]["overhead"] == pytest.approx((4 + 3 * 3) / 16)  # the convicted sender is replayed no more
    assert f"more than {TOLERANCE:g} of its norm" in report.read_text()


def test_a_replay_audit_replays_only_senders_the_round_averages():
    """A sender another check has left out is not replayed (its replay would cost steps and catch nothing new), and a
    replica's own claim replayed is its pseudo-gradient to the bit."""
    setup = Setup(model="tiny", peers=4, batch_size=2, steps=2, eval_batches=1)
    audit = ReplayAudit(setup, local_steps=2, rate=1.0)
    shards, _ = replica_data(setup)
    models = [build_model(setup.model, seed=setup.seed) for _ in range(4)]
    inners = [inner_optimizer(m.parameters(), DiLoCoConfig()) for m in models]
    audit.phase_start(models, inners, shards)
    sent = [audit.replay(i) for i in range(4)]
    assert audit.admit(sent, eligible=[True, True, True, False]) == [True] * 4
    assert audit.audits.replayed == 3 and sorted(audit.deviations) == [0, 1, 2]
    assert all(d == [0.0] for d in audit.deviations.values()) and audit.convicted == {}
    assert audit.overhead() == pytest.approx(3 / 4)
