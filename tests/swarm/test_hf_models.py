"""The user's own model and data over a real swarm: a tiny Llama-style Hugging Face model with a tokenizer trained
here, jsonl data, a module:factory model; export, from_pretrained and generate; a newcomer that resumes the LR
schedule and the data cursor. Everything is made locally (no hub)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import exit_code, p2ptrain, report, start_bootstrap, start_worker, stop_all
from tests.hf_fixtures import documents, make_llama, write_jsonl

pytestmark = [pytest.mark.swarm, pytest.mark.slow]  # a minute or more on 2 cores: `make test-slow` (CI runs it)

SWARM = ("--local-steps", "8", "--batch-size", "8", "--num-shards", "2", "--target-group-size", "2",
         "--no-group-policy", "wait", "--inner-lr", "3e-3", "--eval-batches", "4")


def run_two(tmp_path, run_id: str, *args: str, steps: int = 3) -> list:
    """Two workers of ``args`` until outer step ``steps``; their reports."""
    boot, maddr = start_bootstrap(tmp_path)
    workers = []
    try:
        for i in range(2):
            workers.append(start_worker(tmp_path, i, maddr, run_id, *SWARM, "--shard-index", str(i),
                                        "--until-outer-step", str(steps), "--checkpoint-dir", str(tmp_path / f"ck{i}"),
                                        *args))
        for i, w in enumerate(workers):
            assert exit_code(w, 240, tmp_path / f"w{i}.log") == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]
        return [report(tmp_path, i) for i in range(2)]
    finally:
        stop_all([*workers, boot])


def assert_trained_together(reports: list, steps: int) -> None:
    """Every outer step averaged by both, the same parameters on both after each, and the held-out loss fell."""
    digests = [{x["outer_step"]: x["digest"] for x in r["rounds"]} for r in reports]
    assert sorted(digests[0]) == list(range(1, steps + 1)), reports[0]["rounds"]
    assert digests[0] == digests[1]  # bit-identical global parameters after every sync
    for r in reports:
        assert r["final_eval_loss"] < r["initial_eval_loss"] - 0.3, (r["initial_eval_loss"], r["final_eval_loss"])


def test_a_hugging_face_llama_with_its_own_tokenizer_trains_exports_and_generates(tmp_path):
    docs = documents(600)
    llama = make_llama(tmp_path / "llama", tokenizer_texts=docs)
    data = write_jsonl(tmp_path / "docs.jsonl", docs)
    reports = run_two(tmp_path, "hf-llama", "--model", str(llama), "--data", str(data), "--seq-len", "64")
    assert_trained_together(reports, 3)
    assert reports[0]["model"].startswith("llama-")

    out = tmp_path / "exported"
    result = p2ptrain("export", str(tmp_path / "ck0" / "hf-llama.pt"), str(out))
    assert result.returncode == 0, result.stderr
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|endoftext|>"
    state = torch.load(tmp_path / "ck0" / "hf-llama.pt", map_location="cpu", weights_only=True)
    swarm = state["optimizer"]["global_params"]
    assert len(swarm) == len(list(exported.parameters()))
    for p, g in zip(exported.parameters(), swarm):
        assert torch.equal(p.detach(), g)  # the exported weights are the swarm's, bit for bit

    result = p2ptrain("generate", str(out), "--prompt", "the river", "--max-new-tokens", "12", "--temperature", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("the river") and len(result.stdout.strip()) > len("the river")
    # the model learnt the little language: greedy text continues with its words
    assert any(word in result.stdout[len("the river"):] for word in ("the", "and"))


def test_a_module_factory_model_trains_the_same_way(tmp_path):
    data = write_jsonl(tmp_path / "docs.jsonl", documents(400))
    reports = run_two(tmp_path, "factory", "--model", "tests.models.factories:tiny_recurrent_lm", "--data", str(data))
    assert_trained_together(reports, 3)

    out = tmp_path / "exported"
    result = p2ptrain("export", str(tmp_path / "ck1" / "factory.pt"), str(out))
    assert result.returncode == 0, result.stderr
    from p2ptrain.export import load_for_generation

    exported = list(load_for_generation(out).model.parameters())  # a fresh model with model.safetensors loaded
    swarm = torch.load(tmp_path / "ck1" / "factory.pt", map_location="cpu", weights_only=True)["optimizer"]
    assert len(exported) == len(swarm["global_params"])
    assert all(torch.equal(p.detach(), g) for p, g in zip(exported, swarm["global_params"]))
    for source in (out, tmp_path / "ck1" / "factory.pt"):  # an exported folder, or the checkpoint itself
        result = p2ptrain("generate", str(source), "--prompt", "the ", "--max-new-tokens", "20", "--seed", "1")
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("the ") and len(result.stdout) > len("the ") + 1


def test_a_newcomer_resumes_the_lr_schedule_and_the_data_cursor(tmp_path):
    """Worker 1 leaves at outer step 2 of a cosine schedule and worker 2 joins: it takes worker 1's data shard where
    worker 1 left it, and its learning rate in each of its rounds is the one the schedule gives the swarm's inner
    step, not its own count from zero."""
    docs = documents(600)
    llama = make_llama(tmp_path / "llama", tokenizer_texts=docs)
    data = write_jsonl(tmp_path / "docs.jsonl", docs)
    schedule = ("--lr-schedule", "cosine", "--warmup-steps", "4", "--total-steps", "48", "--min-lr-ratio", "0.1")
    common = (*SWARM, "--model", str(llama), "--data", str(data), "--seq-len", "64", *schedule)
    boot, maddr = start_bootstrap(tmp_path)
    workers = []
    try:
        workers = [start_worker(tmp_path, 0, maddr, "hf-newcomer", *common, "--until-outer-step", "5"),
                   start_worker(tmp_path, 1, maddr, "hf-newcomer", *common, "--until-outer-step", "2")]
        assert exit_code(workers[1], 240, tmp_path / "w1.log") == 0, (tmp_path / "w1.log").read_text()[-3000:]
        workers.append(start_worker(tmp_path, 2, maddr, "hf-newcomer", *common, "--until-outer-step", "5"))
        for i in (0, 2):
            assert exit_code(workers[i], 240, tmp_path / f"w{i}.log") == 0, \
                (tmp_path / f"w{i}.log").read_text()[-3000:]
    finally:
        stop_all([*workers, boot])
    left, newcomer = report(tmp_path, 1), report(tmp_path, 2)
    assert newcomer["start_outer_step"] >= 2, newcomer
    assert newcomer["data_cursor"]["from_peer"] == left["peer_id"], newcomer["data_cursor"]
    assert [newcomer["data_cursor"]["epoch"], newcomer["data_cursor"]["position"]] == left["rounds"][-1]["data_position"]
    assert newcomer["rounds"], newcomer
    for r in newcomer["rounds"]:
        step = r["local_step"]  # the swarm's inner step at this round: the schedule's position
        assert step == 8 * r["outer_step"], r  # the swarm's count (H = 8 per outer step), not one from zero
        progress = (step - 4) / (48 - 4)
        expected = 3e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        assert r["inner_lr"] == pytest.approx(expected, rel=1e-6), (r, expected)
