"""A crowd of newcomers (issue 21): 4 `join`s started in the same moment next to 2 training workers, through
`bench --crowd`'s harness (real daemons on 127.0.0.1). The state must come from several peers, never all from one,
and every newcomer must then average with the trainers on the same model."""

from __future__ import annotations

import json

import pytest

from p2ptrain.bench.crowd import CrowdConfig, run_crowd

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(400)]


@pytest.mark.slow  # about a minute on 2 cores (7 daemons): `make test-slow` (CI runs it)
def test_four_simultaneous_newcomers_take_the_state_from_several_peers(tmp_path):
    cfg = CrowdConfig(trainers=2, newcomers=4, timeout_s=150.0)
    result = run_crowd(cfg, tmp_path, echo=print)
    print((tmp_path / "crowd.md").read_text())
    assert result["status"] == "ok", result["problems"]
    assert not result["problems"], result["problems"]

    reports = {name: json.loads((tmp_path / f"{name}.json").read_text())
               for name in ["trainer0", "trainer1", "lone", *(f"newcomer{i}" for i in range(cfg.newcomers))]}
    state_bytes = 4 * 4 * reports["trainer0"]["num_parameters"]  # parameters, momentum, 2 AdamW moments; fp32
    peers = {r["peer_id"] for r in reports.values()}
    for arrival in result["crowd"]:
        # the whole state, 7 chunks of 1 MiB for the tiny model, from peers of this run, more than one of them
        assert arrival["bytes"] == state_bytes and sum(arrival["chunks_by_donor"].values()) == 7, arrival
        assert set(arrival["chunks_by_donor"]) <= peers - {arrival["peer_id"]}, arrival
        assert len(arrival["chunks_by_donor"]) >= 2, f"one peer served this newcomer every chunk: {arrival}"
    assert result["donors"]["max_share"] < 0.75, result["donors"]

    # the trainers hold one model at every step they both committed
    trained = [{r["outer_step"]: r["digest"] for r in reports[name]["rounds"] if r["averaged"]}
               for name in ("trainer0", "trainer1")]
    assert all(trained[0][step] == trained[1][step] for step in trained[0].keys() & trained[1].keys())
    # each newcomer ended averaging with the trainers: its last round's model is theirs at that step (a newcomer
    # that fell behind may first average a round of its own with another one, then take the state again)
    # (the harness stops every worker at once: a newcomer may record one more round alone once the trainers left)
    for i in range(cfg.newcomers):
        rounds = [r for r in reports[f"newcomer{i}"]["rounds"] if not r["abandoned"]]
        joined = [k for k, r in enumerate(rounds) if r["averaged"] and not r["caught_up"]]
        assert joined, rounds
        last = rounds[joined[-1]]
        assert not any(r["caught_up"] for r in rounds[joined[-1]:]), rounds  # no state taken again after it
        assert last["digest"] in (trained[0].get(last["outer_step"]), trained[1].get(last["outer_step"])), last
    # the trainers trained on through the crowd: every one of their rounds in its window committed or caught up
    for t in result["trainers"]:
        assert t["rounds_during"] >= 1 and t["committed_during"] + t["behind_during"] == t["rounds_during"], t
