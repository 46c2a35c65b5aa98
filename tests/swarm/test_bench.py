"""`p2ptrain bench` end to end: real daemons in network namespaces behind tbf-limited links (root needed)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from p2ptrain.bench.netns import leftover_namespaces, netns_problem
from tests.helpers import exit_code

# slow: network namespaces and two 20 s benchmark runs; `make test-slow` (CI runs it)
pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(300),
              pytest.mark.skipif(bool(netns_problem()), reason=netns_problem() or "")]

ARGS = ["--model", "tiny", "--peers", "2", "--local-steps", "15", "--rate-mbit", "50"]


def bench(*args: str, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "p2ptrain", "bench", *args], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def test_bench_measures_a_rate_limited_swarm_and_cleans_up(tmp_path):
    before = set(leftover_namespaces())
    proc = bench(*ARGS, "--outer-steps", "3", "--out", str(tmp_path / "out"), log=tmp_path / "bench.log")
    assert exit_code(proc, 240, tmp_path / "bench.log") == 0, (tmp_path / "bench.log").read_text()[-3000:]
    assert set(leftover_namespaces()) == before
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    result = report["results"][0]
    assert result["bytes_measured_on"].startswith("wire")
    # the wire carries the payload plus framing: never less than the butterfly bound, not much more
    assert 1.0 <= result["bytes_vs_butterfly"] <= 1.5, result["bytes_vs_butterfly"]
    # 2 peers at 50 Mbit/s: a sync cannot beat the link
    assert result["sync_s"] >= result["bandwidth_bound_s"]
    for peer in result["peers"]:
        assert [r["group_size"] for r in peer["rounds"]] == [2, 2, 2]
        assert 0.0 < peer["compute_utilization"] <= peer["utilization_without_waiting"] \
            <= peer["utilization_without_waiting_or_eval"] < 1.0
        assert all(r["eval_s"] > 0 for r in peer["rounds"])
        assert all(r["wire_sent"] >= r["payload_sent"] for r in peer["rounds"])
    # samples into the models over the peers' own rates: below 1 by what syncs and evals cost (a median step time
    # sets a peer's own rate, so a little above 1 is noise)
    assert 0.3 < result["throughput_vs_solo"] < 1.1, result["throughput_vs_solo"]
    assert result["final_eval_loss"] < result["peers"][0]["initial_eval_loss"]
    assert result["communication_reduction"] > 1
    for name in ("report.md", "loss_vs_time.png", "time_split.png"):
        assert (tmp_path / "out" / name).stat().st_size > 0
    assert "| tiny-2peers-50Mbit-H15-fp16 |" in (tmp_path / "out" / "report.md").read_text()


def test_ctrl_c_tears_the_namespaces_and_daemons_down(tmp_path):
    before = set(leftover_namespaces())
    log = tmp_path / "bench.log"
    proc = bench(*ARGS, "--outer-steps", "50", "--out", str(tmp_path / "out"), log=log)
    try:
        deadline = time.monotonic() + 120
        while "1/50 rounds" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.3)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(set(leftover_namespaces()) - before) == 4  # a switch, a bootstrap host, 2 peer hosts
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=90) == 130, log.read_text()[-3000:]
        _, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, alive
        assert set(leftover_namespaces()) == before
        assert "interrupted: the namespaces are removed" in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
