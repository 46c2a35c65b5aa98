"""The attack suite of ``bench --convergence --attack`` (bench/convergence_robust.py): what each attacker sends or
trains on, what a direction check sees of it (``SenderScores``), and a short run of the whole report."""

from __future__ import annotations

import json

import pytest
import torch

from p2ptrain.bench.convergence import Setup
from p2ptrain.bench.convergence_robust import ATTACKS, DRIFT_SCALE, SenderScores, _backwards, run_robust


def test_a_stale_attacker_sends_its_previous_round_and_its_first_honestly():
    attack = ATTACKS["stale"].sends()
    first, second, third = [torch.full((3,), 1.0)], [torch.full((3,), 2.0)], [torch.full((3,), 3.0)]
    assert attack(first)[0].tolist() == [1.0] * 3
    assert attack(second)[0].tolist() == [1.0] * 3
    assert attack(third)[0].tolist() == [2.0] * 3


def test_drift_adds_a_fifth_of_the_norm_along_one_direction_shared_by_colluders():
    honest = [torch.randn(50), torch.randn(4, 5)]
    one, other = ATTACKS["drift"].sends(), ATTACKS["drift"].sends()
    sent = one(honest)
    for h, s, o in zip(honest, sent, other(honest)):
        assert torch.equal(s, o)  # colluders: the same bias
        assert float(torch.linalg.vector_norm(s - h)) == pytest.approx(DRIFT_SCALE * float(torch.linalg.vector_norm(h)))
    again = one([2 * h for h in honest])  # the same direction every round
    bias, bias_again = sent[0] - honest[0], again[0] - 2 * honest[0]
    assert float(torch.nn.functional.cosine_similarity(bias, bias_again, dim=0)) == pytest.approx(1.0)


def test_wrong_data_reads_the_shard_backwards_as_next_token_pairs():
    text = torch.arange(10)
    x, y = text[:-1].unsqueeze(0), text[1:].unsqueeze(0)  # a batch of one: y is x shifted by one token
    (bx, by), = list(_backwards(iter([(x, y)])))
    backwards = text.flip(0)
    assert bx[0].tolist() == backwards[:-1].tolist() and by[0].tolist() == backwards[1:].tolist()


def test_a_direction_check_sees_a_flip_as_negative_and_x5_as_five():
    torch.manual_seed(0)
    common = torch.randn(1000)
    honest = [[common + 0.1 * torch.randn(1000)] for _ in range(3)]
    scores = SenderScores()
    scores(honest + [[-honest[0][0]], [5 * honest[1][0]]])
    cosines, ratios = scores.cosines[0], scores.norm_ratios[0]
    assert all(c > 0.95 for c in cosines[:3])
    assert cosines[3] < -0.95 and ratios[4] == pytest.approx(5.0, rel=0.05)
    assert scores.ranges([3])["cosine"][1] < -0.95  # one round: ranges keep it rather than skip it
    assert scores.separated([3]) == {"rounds": 1, "cosine": 1, "norm": 0}  # the flip: lowest cosine, honest norm
    assert scores.separated([4]) == {"rounds": 1, "cosine": 0, "norm": 1}  # x5: the norm farthest from 1


def test_a_short_run_with_two_colluders_of_six_writes_both_tables(tmp_path):
    """Issue 39's colluding pairs, 2 of 6. (With 2 of 4, the median of an honest sender's others is half the
    attackers': a median-based check cannot tell the sides apart there.)"""
    setup = Setup(model="tiny", peers=6, batch_size=2, steps=6, eval_batches=1)
    report = run_robust(setup, 2, ["mean"], ["flip", "stale"], tmp_path, echo=lambda line: None, attackers=2)
    text = report.read_text()
    assert "2 colluding attackers among 6 replicas" in text and "| stale |" in text and "| flip |" in text
    figures = json.loads((tmp_path / "robust.json").read_text())
    assert figures["attackers"] == 2 and set(figures["losses"]["mean"]) == {"none", "flip", "stale"}
    flip = figures["sender_scores"]["mean"]["flip"]
    assert len(flip["cosines"]) == 3 and all(len(r) == 6 for r in flip["cosines"])  # 6 steps / H = 2: 3 rounds
    assert flip["attackers"]["cosine"][1] < 0 < flip["honest"]["cosine"][0]
    assert flip["separated"] == {"rounds": 2, "cosine": 2, "norm": flip["separated"]["norm"]}
    with pytest.raises(ValueError, match="give fewer than --peers"):
        run_robust(setup, 2, ["mean"], ["flip"], tmp_path, attackers=6)


def test_the_check_acting_convicts_a_flipping_sender_in_the_third_round(tmp_path):
    setup = Setup(model="tiny", peers=4, batch_size=2, steps=12, eval_batches=1)
    report = run_robust(setup, 2, ["mean+check"], ["flip"], tmp_path, echo=lambda line: None)
    figures = json.loads((tmp_path / "robust.json").read_text())
    assert figures["convictions"]["mean+check"]["flip"]["attackers"] == [3]
    assert figures["convictions"]["mean+check"]["flip"]["honest"] == {}
    nobody = figures["convictions"]["mean+check"]["none"]
    assert nobody["attackers"] == [] and nobody["honest"] == {}  # no attacker: nobody convicted
    assert len(figures["sender_scores"]["mean+check"]["flip"]["cosines"]) == 6  # 12 steps / H = 2
    assert "| mean+check | " in report.read_text() and "3 (" in report.read_text()
