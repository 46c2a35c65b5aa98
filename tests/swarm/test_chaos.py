"""Chaos: real worker processes on 127.0.0.1, one of them killed with SIGKILL while the swarm trains."""

from __future__ import annotations

import json
import math
import time

import pytest

from tests.helpers import descendants, start_bootstrap, start_worker, stop_all

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(300)]


def test_survivors_go_on_after_a_peer_is_killed(tmp_path):
    """SIGKILL of a worker's whole process tree half a second after its 2nd sync (with the tiny model that is
    during local training or matchmaking; an all-reduce lasts ~0.1 s, so this does not aim at one)."""
    boot, maddr = start_bootstrap(tmp_path)
    workers = []
    try:
        for i in range(3):
            workers.append(start_worker(
                tmp_path, i, maddr, "chaos", "--local-steps", "20", "--max-outer-steps", "5", "--num-shards", "3",
                "--shard-index", str(i), "--matchmaking-time", "2", "--averaging-timeout", "10",
                "--no-group-policy", "wait", "--log-interval", "1",
            ))
        victim_log = tmp_path / "w2.log"
        deadline = time.monotonic() + 150
        while "outer_step=2 " not in victim_log.read_text():
            assert time.monotonic() < deadline and all(w.poll() is None for w in workers), victim_log.read_text()
            time.sleep(0.05)
        time.sleep(0.5)  # into the next interval: its peers may be matching or averaging with it
        killed_at = time.monotonic()
        for proc in [workers[2], *descendants(workers[2])]:  # the host dies: python, DHT, averager, p2pd
            proc.kill()

        for i in (0, 1):
            assert workers[i].wait(timeout=200) == 0, (tmp_path / f"w{i}.log").read_text()
        survivors_s = time.monotonic() - killed_at
        reports = [json.loads((tmp_path / f"w{i}.json").read_text()) for i in (0, 1)]
        for report in reports:
            assert report["outer_steps"] == 5
            assert all(math.isfinite(r["eval_loss"]) for r in report["rounds"])
            assert report["final_eval_loss"] < report["initial_eval_loss"]
            assert report["rounds"][-1]["group_size"] == 2 and report["rounds"][-1]["averaged"]
        # the survivors end on the same parameters: equal digests are equal eval losses on the same batches
        assert reports[0]["final_eval_loss"] == reports[1]["final_eval_loss"]
        print(f"survivors finished 5 outer steps {survivors_s:.1f}s after the kill")
    finally:
        stop_all([*workers, boot])
