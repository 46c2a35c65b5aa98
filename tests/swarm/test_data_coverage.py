"""With the default --num-shards, the live workers together go through all of the user's data, and the outer-step
limits mean what they say for a worker that joins a run in progress. Real `p2ptrain` processes on 127.0.0.1."""

from __future__ import annotations

import json
import random

import pytest

from tests.helpers import exit_code, p2ptrain, report, start_bootstrap, start_worker, stop_all, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]


def status(maddr: str, run_id: str) -> dict:
    result = p2ptrain("status", "--initial-peers", maddr, "--run-id", run_id, "--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def write_corpus(path, num_bytes: int) -> None:
    """A user's text file: sentences of random words (random: no two 64-byte windows are alike)."""
    rng = random.Random(0)
    words = [w for w in "the a of lighthouse keeper wrote letters about ships storms and the quiet sea at night "
                        "bees clocks ferry canal village fables morning evening river stone bridge".split()]
    text = []
    while sum(map(len, text)) < num_bytes:
        text.append(" ".join(rng.choice(words) for _ in range(rng.randint(5, 14))).capitalize() + ". ")
    path.write_text("".join(text)[:num_bytes])


@pytest.mark.slow  # over 10 s on 2 cores: `make test-slow` (CI runs it)
def test_two_workers_with_the_default_shards_cover_all_of_the_data(tmp_path):
    corpus = tmp_path / "notes.txt"
    # 16 shards (the default) of ~14 samples of 64 bytes: each smaller than one inner phase (5 steps x 4 samples)
    write_corpus(corpus, 16_500)
    boot, maddr = start_bootstrap(tmp_path)
    args = ["--data", str(corpus), "--local-steps", "5", "--batch-size", "4", "--target-group-size", "2",
            "--matchmaking-time", "2", "--no-group-policy", "wait", "--eval-batches", "2", "--log-interval", "2"]
    workers = [start_worker(tmp_path, i, maddr, "coverage", *args) for i in range(2)]
    procs = [(f"worker {i}", w) for i, w in enumerate(workers)]
    try:
        seen = {}

        def covered() -> bool:
            nonlocal seen
            seen = status(maddr, "coverage")
            return bool(seen["coverage"]) and seen["coverage"]["fraction_seen"] == 1.0

        wait_until(covered, "the swarm's cursors cover every sample of the corpus", 200, procs=procs)
        stop_all(workers)
        assert all(w.returncode == 0 for w in workers), [(tmp_path / f"w{i}.log").read_text()[-3000:] for i in (0, 1)]
    finally:
        stop_all([*workers, boot])

    coverage = seen["coverage"]
    print(f"coverage: {coverage}; peers: {[(p['shard'], p['shard_passes']) for p in seen['peers']]}")
    assert coverage["num_shards"] == 16 and coverage["shards_complete"] == 16
    assert {p["shard"] for p in seen["peers"]} <= set(range(16)) and len(seen["peers"]) == 2
    reports = [report(tmp_path, i) for i in range(2)]
    for i, peer in enumerate(reports):
        history = peer["shard_history"]
        shards = [h["shard"] for h in history]
        print(f"worker {i}: {[(h['shard'], h['epoch'], h['position'], h['why']) for h in history]}")
        # it moved on after each pass instead of looping on a sliver: several shards, none of them started over
        # before every shard was taken up (a first pass starts at epoch 0, sample 0; a peer that two picked at once
        # and then left to the other may come back to it later, where the swarm's training of it got to)
        assert len(set(shards)) >= 3, history
        first_pass = [h["shard"] for h in history if (h["epoch"], h["position"]) == (0, 0)]
        assert len(first_pass) == len(set(first_pass)), history
        assert all(h["why"] == "claimed" for h in history[:1])
        # every round says where in which shard the peer was
        assert all(0 <= r["shard_index"] < 16 and len(r["data_position"]) == 2 for r in peer["rounds"])
    started = {h["shard"] for peer in reports for h in peer["shard_history"]}
    assert started == set(range(16))
    log = (tmp_path / "w0.log").read_text()
    assert "fewer than one inner phase trains on (local_steps 5 x batch_size 4 = 20 samples)" in log
    assert "moving on to shard" in log and "Traceback" not in log


@pytest.mark.slow  # over 15 s on 2 cores: `make test-slow` (CI runs it)
def test_outer_step_limits_of_a_worker_that_joins_a_run_in_progress(tmp_path):
    """--max-outer-steps n: n syncs of this worker, from whatever outer step it joined at; --until-outer-step N:
    it leaves once the run's outer step it holds is N."""
    boot, maddr = start_bootstrap(tmp_path)
    # rounds wait for the group, so a newcomer keeps in step with the run once it has its state
    # (phases of 60 steps, ~1.5 s: the run must not reach the target while the newcomers start, which took 12 rounds
    # of 20 steps)
    args = ["--local-steps", "60", "--batch-size", "4", "--matchmaking-time", "3", "--no-group-policy", "wait",
            "--eval-batches", "1", "--num-shards", "4", "--log-interval", "2"]
    procs = {i: start_worker(tmp_path, i, maddr, "limits", *args) for i in (0, 1)}
    try:
        wait_until(lambda: min(report(tmp_path, i).get("outer_steps", 0) for i in (0, 1)) >= 3,
                   "the run reaches outer step 3", 150, procs=[(f"worker {i}", p) for i, p in procs.items()])
        target = report(tmp_path, 0)["outer_steps"] + 20  # beyond where the run is once the newcomer has started
        procs[2] = start_worker(tmp_path, 2, maddr, "limits", *args, "--max-outer-steps", "2")
        procs[3] = start_worker(tmp_path, 3, maddr, "limits", *args, "--until-outer-step", str(target))
        for i in (2, 3):
            assert exit_code(procs[i], 200, tmp_path / f"w{i}.log") == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]
        joined, until = report(tmp_path, 2), report(tmp_path, 3)
        assert joined["start_outer_step"] >= 3 and joined["stopped_by"] == "max_outer_steps"
        own = [r for r in joined["rounds"] if not r["caught_up"]]  # taking the state is not a sync of its own
        assert joined["syncs"] == len(own) == 2 and joined["outer_steps"] == own[-1]["outer_step"], joined["rounds"]
        assert until["outer_steps"] == target and until["stopped_by"] == "until_outer_step", until["rounds"]
        assert 3 <= until["start_outer_step"] < target
    finally:
        stop_all([*procs.values(), boot])
