"""`join --checkpoint-dir` writes a checkpoint; `join --resume` continues exactly where the peer left off."""

from __future__ import annotations

import json

import pytest

from tests.helpers import LOOPBACK, p2ptrain

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]


def lone_join(tmp_path, report: str, *extra: str):
    # alone in its own swarm: every round times out quickly and applies the peer's own pseudo-gradient
    return p2ptrain("join", "--host-maddrs", LOOPBACK, "--run-id", "resume", "--local-steps", "5",
                    "--matchmaking-time", "1", "--shard-index", "3", "--threads", "1", "--no-progress",
                    "--checkpoint-dir", str(tmp_path / "ckpt"), "--report", str(tmp_path / report), *extra,
                    timeout=180)


@pytest.mark.slow  # over 15 s on 2 cores: `make test-slow` (CI runs it)
def test_resume_continues_from_the_checkpoint(tmp_path):
    first = lone_join(tmp_path, "first.json", "--max-outer-steps", "2")
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "ckpt" / "resume.pt").is_file()
    before = json.loads((tmp_path / "first.json").read_text())

    second = lone_join(tmp_path, "second.json", "--until-outer-step", "4", "--resume")
    assert second.returncode == 0, second.stderr
    after = json.loads((tmp_path / "second.json").read_text())
    assert "resumed from the checkpoint at outer step 2, local step 10" in second.stderr
    # the restored model is exactly the one that left: the same eval loss on the same held-out batches
    assert after["initial_eval_loss"] == before["final_eval_loss"]
    assert after["shard_index"] == before["shard_index"] == 3
    assert [r["outer_step"] for r in after["rounds"]] == [3, 4]
    assert after["outer_steps"] == 4 and after["local_steps"] == 20
    assert after["stopped_by"] == "until_outer_step" and after["syncs"] == 2

    # --max-outer-steps counts this run's syncs, wherever the checkpoint left the peer
    third = lone_join(tmp_path, "third.json", "--max-outer-steps", "2", "--resume")
    assert third.returncode == 0, third.stderr
    last = json.loads((tmp_path / "third.json").read_text())
    assert [r["outer_step"] for r in last["rounds"]] == [5, 6]
    assert last["syncs"] == 2 and last["stopped_by"] == "max_outer_steps"
    # a peer already at or past --until-outer-step leaves without training
    done = lone_join(tmp_path, "done.json", "--until-outer-step", "5", "--resume")
    assert done.returncode == 0, done.stderr
    assert "already at outer step 6, at or past --until-outer-step 5: leaving without training" in done.stderr
    assert json.loads((tmp_path / "done.json").read_text())["rounds"] == []


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (["--resume"], "no checkpoint at"),
        (["--resume", "--model", "small"], "model='tiny' but this run has 'small'"),
    ],
)
def test_bad_resume_is_a_clear_error(tmp_path, extra, fragment):
    if "--model" in extra:
        assert lone_join(tmp_path, "first.json", "--max-outer-steps", "1").returncode == 0
    result = lone_join(tmp_path, "x.json", "--max-outer-steps", "1", *extra)
    assert result.returncode == 2, result.stderr
    assert fragment in result.stderr and "Traceback" not in result.stderr
