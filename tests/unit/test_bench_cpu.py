"""The benchmark's fixed CPU share per worker (bench --cpu-per-peer) and its solo baseline (bench --solo)."""

import subprocess
import sys

import pytest

from p2ptrain.bench.cpu import CpuQuota, CpuQuotaUnavailable
from p2ptrain.bench.swarm import with_solo_baseline

BUSY = ("import time\n"
        "end = time.monotonic() + 1.5\n"
        "while time.monotonic() < end: pass\n"
        "print(time.process_time())\n")


def test_a_worker_under_a_quota_gets_that_share_of_a_core_and_no_more():
    try:
        quota = CpuQuota("p2ptrain-bench-test-quota", 0.1)
    except CpuQuotaUnavailable as e:
        pytest.skip(str(e))
    try:
        done = subprocess.run([*quota.prefix(), sys.executable, "-c", BUSY], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        cpu_s = float(done.stdout)
        # 1.5 s of spinning at 0.1 of a core: about 0.15 s of CPU (an unlimited spin on an idle core takes ~1.5 s;
        # the interpreter's start-up runs under the quota too)
        assert cpu_s < 0.45, cpu_s
    finally:
        quota.close()
    assert not quota.path.exists()


def test_a_quota_of_no_cpu_is_refused():
    with pytest.raises(ValueError):
        CpuQuota("p2ptrain-bench-test-zero", 0.0)


def _result(name, throughputs):
    return {"name": name, "throughput_vs_solo": 0.5,
            "peers": [{"throughput": t, "solo_throughput": 10.0} for t in throughputs]}


def test_the_solo_baseline_is_each_peers_measured_speed_apart():
    swarm, apart = _result("swarm", [3.0, 3.0, 1.5]), _result("apart", [4.0, 4.0, 2.0])
    result = with_solo_baseline(swarm, apart)
    assert result["throughput_vs_solo"] == pytest.approx(7.5 / 10.0)
    assert result["throughput_vs_median_step"] == 0.5
    assert [p["solo_throughput"] for p in result["peers"]] == [4.0, 4.0, 2.0]
    assert result["solo_from"].startswith("measured apart")
    assert swarm["throughput_vs_solo"] == 0.5  # the run's own summary is left as it was


def test_no_baseline_from_an_apart_run_that_measured_nothing():
    swarm = _result("swarm", [3.0, 3.0])
    assert with_solo_baseline(swarm, _result("apart", [4.0, None])) is swarm
    assert with_solo_baseline(swarm, _result("apart", [4.0])) is swarm
