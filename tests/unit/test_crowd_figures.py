"""bench --crowd's figures from hand-made reports: the newcomers' waits against the lone one, who served the
crowd's chunks, and the trainers' rounds while the crowd came."""

from __future__ import annotations

import pytest

from p2ptrain.bench.crowd import CrowdConfig, crowd_markdown, newcomer_done, summarize_crowd, trainer_rounds


def arrival(peer: str, startup_s: float, download_s: float, chunks: dict, rounds: int = 1) -> dict:
    return {"peer_id": peer, "startup_s": startup_s,
            "state_download": {"seconds": download_s, "bytes": 7 * 2**20, "chunks_by_donor": chunks,
                               "failed_donors": []},
            "rounds": [{"outer_step": 9 + i, "averaged": True, "seconds": 0.2, "finished_at": 200.0 + i}
                       for i in range(rounds)]}


def trainer(peer: str, rounds: list) -> dict:
    """``rounds``: (finished_at, seconds, outcome) with outcome "ok", "behind" or "alone"."""
    return {"peer_id": peer, "rounds": [
        {"finished_at": at, "seconds": s, "averaged": outcome == "ok", "caught_up": outcome == "behind"}
        for at, s, outcome in rounds]}


def test_a_trainers_rounds_are_split_at_the_crowds_window():
    t = trainer("QmT1", [(10, 0.2, "ok"), (20, 0.4, "ok"), (30, 0.3, "ok"), (105, 0.5, "ok"), (110, 5.0, "ok"),
                         (115, 1.0, "behind"), (200, 9.0, "ok")])
    figures = trainer_rounds(t, (100.0, 150.0))
    assert figures["median_round_s_before"] == pytest.approx(0.3)
    # 0.5 (under 0.6: not delayed), 5.0 (delayed), 1.0 (delayed, and behind); the round at 200 is after the window
    assert (figures["rounds_during"], figures["committed_during"], figures["behind_during"],
            figures["delayed_during"], figures["max_round_s_during"]) == (3, 2, 1, 2, 5.0)
    assert trainer_rounds(trainer("QmT2", []), (0.0, 1.0))["median_round_s_before"] is None


def test_the_crowds_waits_donors_and_shares():
    trainers = [trainer("QmT1", [(10, 0.2, "ok"), (120, 0.3, "ok")]), trainer("QmT2", [(10, 0.2, "ok")])]
    lone = arrival("QmLone", 4.0, 0.5, {"QmT1": 7})
    crowd = [arrival("QmA", 8.0, 1.0, {"QmT1": 4, "QmT2": 3}), arrival("QmB", 9.0, 2.0, {"QmA": 5, "QmT2": 2}),
             {"peer_id": "QmC", "rounds": []}]
    r = summarize_crowd(CrowdConfig(trainers=2, newcomers=3), trainers, lone, crowd, (100.0, 130.0))
    assert r["download_vs_lone_max"] == pytest.approx(4.0) and r["startup_vs_lone_max"] == pytest.approx(2.25)
    assert r["download_s"] == {"median": 1.5, "max": 2.0}
    donors = r["donors"]
    assert (donors["peers"], donors["chunks"], donors["by_role"]) == (3, 14, {"trainer": 9, "newcomer": 5})
    assert donors["max_share"] == pytest.approx(5 / 14) and donors["fair_share_of_trainers"] == 0.5
    assert donors["newcomers_from_one_donor"] == 0
    assert r["problems"] == ["1 newcomer(s) never took the state, e.g. newcomer 2"]
    assert r["trainer_rounds_delayed_max"] == 0 and r["trainer_rounds_behind"] == 0 and r["window_s"] == 30.0
    text = crowd_markdown(r)
    assert "| crowd of 3 | 8.50, 9.00 | 1.50, 2.00 | 2, 2, 0 |" in text and "busiest served 36%" in text


def test_a_newcomer_is_done_once_it_holds_the_state_and_averaged():
    assert not newcomer_done({"rounds": []}, 1)
    assert not newcomer_done(arrival("QmA", 1.0, 1.0, {}, rounds=0), 1)
    assert newcomer_done(arrival("QmA", 1.0, 1.0, {}, rounds=1), 1)
    caught_up = arrival("QmA", 1.0, 1.0, {}, rounds=1)
    caught_up["rounds"][0]["caught_up"] = True  # a state taken again is no round averaged
    assert not newcomer_done(caught_up, 1)
    # a round of its own with another late newcomer, then the swarm's state: not done until it averages again
    side = arrival("QmA", 1.0, 1.0, {}, rounds=2)
    side["rounds"][1].update(averaged=False, caught_up=True)
    assert not newcomer_done(side, 1)
    side["rounds"].append({"outer_step": 12, "averaged": True, "seconds": 0.2, "finished_at": 203.0})
    assert newcomer_done(side, 1)
