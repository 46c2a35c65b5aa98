"""A benchmark configuration whose rounds stopped coming ends with one line (bench/stall.py)."""

from __future__ import annotations

from pathlib import Path

from p2ptrain.bench.stall import FIRST_ROUND_S, STALL_S, Stall

NAT_LINE = ("[2026-11-29 04:30:01] [ERROR] [w1 step 0] no group can form: this peer is behind NAT (client mode) and "
            "so are all 2 other live peer(s) of run 'bench'; only a peer that others can dial can lead a group\n")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def logs(tmp_path: Path, *texts: str) -> list:
    paths = []
    for i, text in enumerate(texts, 1):
        paths.append(tmp_path / f"w{i}.log")
        paths[-1].write_text(text)
    return paths


def test_the_first_round_may_take_start_up_and_then_the_configuration_is_given_up(tmp_path):
    clock = Clock()
    stall = Stall(logs(tmp_path, "starting\n", "starting\n"), clock)
    clock.now += FIRST_ROUND_S - 1
    assert stall.check(0) is None
    clock.now += 2
    reason = stall.check(0)
    assert reason.startswith(f"no round in {FIRST_ROUND_S + 1:.0f}s after round 0") and "w1.log" in reason


def test_later_rounds_may_take_five_times_the_longest_gap_so_far_and_at_least_the_floor(tmp_path):
    clock = Clock()
    stall = Stall(logs(tmp_path, "", ""), clock)
    clock.now += 200  # the first round: start-up, not a gap
    assert stall.check(1) is None
    for rounds in (2, 3):
        clock.now += 100
        assert stall.check(rounds) is None
    clock.now += 499
    assert stall.check(3) is None  # 5 x 100 s
    clock.now += 2
    assert "no round in 501s after round 3" in stall.check(3)
    quick = Stall(logs(tmp_path, "", ""), clock)  # rounds 10 s apart: the floor holds
    for rounds in (1, 2):
        clock.now += 10
        quick.check(rounds)
    clock.now += STALL_S - 1
    assert quick.check(2) is None
    clock.now += 2
    assert quick.check(2) is not None


def test_the_workers_own_explanation_ends_it_once_every_worker_has_said_it_twice(tmp_path):
    clock = Clock()
    paths = logs(tmp_path, NAT_LINE * 2, "starting\n" + NAT_LINE)
    stall = Stall(paths, clock)
    assert stall.check(0) is None  # worker 2 said it once: a public worker may still be starting
    paths[1].write_text("starting\n" + NAT_LINE * 2)
    clock.now += 1
    assert stall.check(0) is None  # the logs are read every 10 s
    clock.now += 10
    assert stall.check(0) == ("no round can form; every worker says (w1.log): this peer is behind NAT (client mode) "
                              "and so are all 2 other live peer(s) of run 'bench'; only a peer that others can dial "
                              "can lead a group")
