"""The replay check from the command line: `join --replay-rate 1` workers redo each other's phases with their own
replica of the model and data (worker_replay.py), and honest workers always agree with what the others sent."""

from __future__ import annotations

import json

import pytest

from tests.helpers import exit_code, start_bootstrap, start_worker, stop_all

pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(300)]

WORKERS, OUTER_STEPS, LOCAL_STEPS = 3, 3, 4


def test_honest_workers_replay_each_others_phases_and_agree(tmp_path):
    boot, maddr = start_bootstrap(tmp_path)
    workers = []
    try:
        for i in range(WORKERS):  # unpinned shards, micro-batches and clipping: the trainer's own step, replayed
            workers.append(start_worker(
                tmp_path, i, maddr, "replayed", "--local-steps", str(LOCAL_STEPS), "--num-shards", str(WORKERS),
                "--replay-rate", "1", "--target-group-size", str(WORKERS), "--no-group-policy", "wait",
                "--max-outer-steps", str(OUTER_STEPS), "--micro-batch-size", "4", "--grad-clip", "1.0",
                "--matchmaking-time", "3"))
        for i, w in enumerate(workers):
            assert exit_code(w, 240, tmp_path / f"w{i}.log") == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]
        for i in range(WORKERS):
            done = json.loads((tmp_path / f"w{i}.json").read_text())
            replay = done["replay"]
            own = [r for r in done["rounds"] if r["averaged"] and r["group_size"] == WORKERS]
            # every round of the 3 in a group of 3: both others replayed, bit for bit (one thread each), but the
            # last round's replays, which a leaving worker may drop (they run beside the next phase, which it skips)
            assert len(own) == OUTER_STEPS, done["rounds"]
            assert (WORKERS - 1) * (OUTER_STEPS - 1) <= replay["replays"] <= (WORKERS - 1) * OUTER_STEPS, replay
            assert replay["replayed_steps"] == replay["replays"] * LOCAL_STEPS, replay
            assert replay["max_deviation"] == 0.0 and replay["convicted"] == {}, replay
            assert "excluding peer" not in (tmp_path / f"w{i}.log").read_text()
    finally:
        stop_all([*workers, boot])
