"""The CUDA paths: bf16 autocast of a 1-GPU peer, and FSDP2 with bf16 parameters over NCCL for a peer of 2 GPUs.

Marked ``gpu`` and skipped where CUDA is missing (CI has no GPU); run them on a GPU machine with
``python -m pytest -m gpu tests/gpu``.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers import LOOPBACK, p2ptrain

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def lone_join(tmp_path, *extra: str):
    return p2ptrain("join", "--host-maddrs", LOOPBACK, "--run-id", "gpu", "--device", "cuda", "--model", "small",
                    "--local-steps", "10", "--max-outer-steps", "2", "--matchmaking-time", "1", "--no-progress",
                    "--batch-size", "8", "--report", str(tmp_path / "w.json"), *extra, timeout=540)


def test_one_gpu_peer_trains_in_bf16_and_keeps_fp32_global_parameters(tmp_path):
    result = lone_join(tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "on cuda x 1 rank(s)" in result.stderr
    report = json.loads((tmp_path / "w.json").read_text())
    assert report["outer_steps"] == 2
    assert report["final_eval_loss"] < report["initial_eval_loss"]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_peer_shards_with_nccl_and_trains(tmp_path):
    result = lone_join(tmp_path, "--nproc-per-node", "2", "--activation-checkpointing")
    assert result.returncode == 0, result.stderr[-4000:]
    assert "on cuda x 2 rank(s)" in result.stderr
    report = json.loads((tmp_path / "w.json").read_text())
    assert report["outer_steps"] == 2 and report["final_eval_loss"] < report["initial_eval_loss"]
