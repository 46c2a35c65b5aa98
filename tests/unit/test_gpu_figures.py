"""benchmarks/gpu_figures.py, the one command that measures issue 37's GPU figures: at tiny sizes on the CPU
(``--smoke``) every kind of piece runs and writes its figures, so a GPU machine's few minutes are not spent on a
broken script; a piece that fails or overruns is one line and the others go on."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytest.importorskip("transformers")  # the Llama pieces build a Hugging Face model


@pytest.mark.slow  # 40-55 s on 2 cores (processes, a DHT, models): `make test-slow` (CI runs it)
def test_the_smoke_run_measures_every_kind_of_piece_on_the_cpu(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_figures.py"), "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    figures = json.loads((tmp_path / "figures.json").read_text())
    pieces = figures["pieces"]
    assert set(pieces) == {"encode", "mfu-124m", "mfu-llama-compile", "sync-2", "cpu-gate-small"}
    assert all((tmp_path / f"{name}.json").is_file() for name in pieces)
    assert pieces["encode"]["same_bytes_as_cpu"] and pieces["encode"]["message_bytes"] > 0
    builtin, llama = pieces["mfu-124m"], pieces["mfu-llama-compile"]
    assert builtin["model"] == "tiny" and builtin["compile"] is None and builtin["tokens_per_s"] > 0
    assert llama["model"] == str(tmp_path / "llama-tiny") and llama["compile"] == "eager" and llama["params"] > 0
    assert (tmp_path / "llama-tiny" / "config.json").is_file()
    sync = pieces["sync-2"]
    assert sync["peers"] == 2 and sync["group_sizes"] == [2] and sync["digests_agree"]
    assert sync["split"]["allreduce"] > 0
    gate = pieces["cpu-gate-small"]  # issue 37's loopback gate: the all-reduce against raw streams, measured here
    assert gate["device"] == "cpu" and gate["digests_agree"] and gate["ceiling_mb_s"] > 0
    assert 0 < gate["of_ceiling"] == gate["allreduce_mb_s"] / gate["ceiling_mb_s"]
    assert "piece" in proc.stdout and "FAILED" not in proc.stdout and "SKIPPED" not in proc.stdout


def test_a_piece_that_fails_or_overruns_is_one_line_and_the_others_go_on(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_figures

    def fails():
        raise RuntimeError("no CUDA kernel image for this GPU\nand a second line")

    monkeypatch.setattr(gpu_figures, "plan", lambda args, out: [
        ("fails", 10, fails), ("overruns", 1, lambda: time.sleep(5)), ("works", 10, lambda: {"value": 1})])
    monkeypatch.setattr(gpu_figures, "summary", lambda name, figures: f"value {figures['value']}")
    assert gpu_figures.main(["--smoke", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAILED fails: RuntimeError: no CUDA kernel image for this GPU\n" in out
    assert "FAILED overruns: PieceTimeout: past its 1 s\n" in out
    assert json.loads((tmp_path / "works.json").read_text())["value"] == 1
    assert list(json.loads((tmp_path / "figures.json").read_text())["pieces"]) == ["works"]
    budget = gpu_figures.main(["--smoke", "--out", str(tmp_path), "--budget-s", "0"])
    assert budget == 1 and "SKIPPED works: 0 s of --budget-s left" in capsys.readouterr().out
