"""``bench --soak``'s figures (p2ptrain/bench/soak.py) from hand-made worker reports."""

from __future__ import annotations

from p2ptrain.bench.soak import soak_totals, summarize_soak


def entry(step, digest, *, averaged=True, members=(), caught_up=False, samples=100, group_size=None):
    return {"outer_step": step, "digest": digest, "averaged": averaged, "members": list(members),
            "caught_up": caught_up, "abandoned": False, "samples": samples,
            "group_size": group_size or (len(members) if averaged else 1)}


def test_one_model_everywhere_is_no_fork_no_asymmetry_and_full_goodput():
    both = ["A", "B"]
    reports = [{"peer_id": p, "samples": 200, "rounds": [entry(1, "d1", members=both), entry(2, "d2", members=both)]}
               for p in both]
    figures = summarize_soak(reports)
    assert figures["forks"] == [] and figures["asymmetric"] == []
    assert figures["models_per_step"] == {"1": 1, "2": 1} and figures["final_models_per_step"] == {"2": 1}
    assert figures["rounds_averaged"] == [2, 2] and figures["goodput"] == 1.0


def test_a_lone_step_beside_a_round_is_a_fork_and_a_member_that_did_not_commit_is_asymmetric():
    pair = ["A", "B"]
    reports = [
        {"peer_id": "A", "samples": 200, "rounds": [entry(1, "d1", members=pair), entry(2, "d2", members=pair)]},
        # B committed round 1 with A, but at step 2 took the state: A's round of 2 named it as a member
        {"peer_id": "B", "samples": 200, "rounds": [entry(1, "d1", members=pair),
                                                     entry(2, "d2", averaged=False, caught_up=True)]},
        # C stepped alone at step 1 while A and B averaged it: a second model; it then took the state
        {"peer_id": "C", "samples": 200, "rounds": [entry(1, "x1", averaged=False),
                                                     entry(2, "d2", averaged=False, caught_up=True)]},
    ]
    figures = summarize_soak(reports)
    assert figures["forks"] == [{"outer_step": 1, "worker": 2}]
    assert figures["asymmetric"] == [{"outer_step": 2, "worker": 1, "member_of": 0}]
    assert figures["models_per_step"] == {"1": 2, "2": 1} and figures["steps_with_several_models"] == 1
    assert figures["states_taken"] == [0, 1, 1]
    # kept: A's 200, B's round 1 (100); not C's forked step nor the samples given up for a state
    assert figures["goodput"] == 300 / 600
    totals = soak_totals([{**figures, "status": "ok"}])
    assert totals["forks"] == 1 and totals["asymmetric"] == 1 and totals["runs_with_one_model_per_step"] == 0


def test_a_report_names_the_model_its_worker_left_with():
    from p2ptrain.worker_report import WorkerReport

    assert WorkerReport().final_model is None
    report = WorkerReport(rounds=[entry(1, "d1", members=["A", "B"]), entry(2, "d2", averaged=False, caught_up=True)])
    assert report.final_model == {"outer_step": 2, "digest": "d2", "how": "took the state", "group_size": 1}
    # a round abandoned on leaving took no outer step: the model is still the one before it
    report.rounds.append({**entry(2, "d2", averaged=False), "abandoned": True})
    assert report.to_dict()["final_model"]["how"] == "took the state"
    report.rounds[-1] = entry(3, "d3", averaged=False)
    assert report.final_model["how"] == "stepped alone" and report.final_model["outer_step"] == 3
