"""benchmarks/bench_sync.py end to end: real peers (one process each, their own DHT and p2pd) on 127.0.0.1, the raw
P2P transport ceiling, and a time split that accounts for the sync's seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# slow: two swarms of real peers and a transport measurement, about a minute on 2 cores
pytestmark = [pytest.mark.swarm, pytest.mark.slow, pytest.mark.timeout(400)]


def test_bench_sync_splits_each_sync_and_measures_the_ceiling(tmp_path):
    out = tmp_path / "sync.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_sync.py"), "--model", "tiny", "--peers",
                           "1", "2", "--syncs", "3", "--ceiling-mb", "64", "--json", str(out),
                           "--png", str(tmp_path / "sync.png")],
                          capture_output=True, text=True, timeout=380, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lone, pair = json.loads(out.read_text())
    assert "peers | sync s | publish" in proc.stdout and "transport ceiling, 2 peers" in proc.stdout

    # a lone peer: no all-reduce and no matchmaking, its sync is the fixed costs alone
    assert lone["peers"] == 1 and lone["split"]["allreduce"] == 0 and lone["split"]["matchmaking"] < 0.05
    assert lone["seconds"] < 1.0, lone

    # two peers: one group every time, bit-identical results, the butterfly's bytes, a real ceiling
    assert pair["group_sizes"] == [2] and pair["digests_agree"]
    assert 0.99 <= pair["of_butterfly"] <= 1.1, pair["of_butterfly"]
    assert pair["ceiling_mb_s"] > 10 and 0 < pair["allreduce_mb_s"]
    # the phases account for the sync's seconds: none missing, none counted twice
    assert sum(pair["split"].values()) == pytest.approx(pair["seconds"], rel=0.1, abs=0.05)
    assert pair["split"]["allreduce"] > 0 and pair["allreduce_work"]["encode"] > 0
    assert (tmp_path / "sync.png").stat().st_size > 1000
