"""Peers of different speeds, for real: one worker made 2x or 4x slower (--throttle: it sleeps that share of each
step), next to one at full speed, through the CLI on loopback. The slow one takes fewer inner steps per phase
(adaptive steps, p2ptrain/pace.py) and averages every round with the fast one, whose wait for it shrinks; its
pseudo-gradient weighs the samples it trained on. The streaming sync carries the same guarantees for a newcomer."""

from __future__ import annotations

import statistics

import pytest

from p2ptrain.pace import LOOKS_TO_LOWER
from tests.helpers import exit_code, report, start_bootstrap, start_worker, stop_all, wait_until

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(600)]

LOCAL_STEPS = 40
BATCH = 8


def run_pair(tmp_path, run_id: str, throttle: float, outer_steps: int, *extra: str) -> tuple:
    boot, maddr = start_bootstrap(tmp_path)
    procs = [boot]
    flags = ("--model", "tiny", "--local-steps", str(LOCAL_STEPS), "--batch-size", str(BATCH), "--eval-batches", "1",
             "--until-outer-step", str(outer_steps), *extra)
    try:
        procs.append(start_worker(tmp_path, 0, maddr, run_id, *flags))
        procs.append(start_worker(tmp_path, 1, maddr, run_id, *flags, "--throttle", str(throttle)))
        for i, proc in enumerate(procs[1:]):
            assert exit_code(proc, 500, tmp_path / f"w{i}.log") == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]
    finally:
        stop_all(procs)
    return report(tmp_path, 0), report(tmp_path, 1)


@pytest.mark.slow
@pytest.mark.parametrize("throttle", [2.0, 4.0])
def test_a_slower_worker_takes_fewer_steps_and_holds_nobody_up(tmp_path, throttle):
    fast, slow = run_pair(tmp_path, f"speeds-{throttle:g}", throttle, outer_steps=12)
    logs = "\n".join((tmp_path / f"w{i}.log").read_text()[-3000:] for i in range(2))
    own = [r for r in slow["rounds"] if not r["caught_up"]]
    strided = [r for r in own if r["stride"] > 1]
    assert strided, ([(r["outer_step"], r["stride"], r["inner_steps"]) for r in own], logs)
    # settled: a stride near the throttle's and at most 2/3 of the steps. One look halves the steps at most (a one-off
    # stall must not cut H to 2): a 4x slower worker settles at its second strided phase. A look that wants a smaller
    # drop moves the count only with the next look (pace.LOOKS_TO_LOWER): on 2 cores shared with another test's swarm
    # a 2x slower worker measured 1.3-1.7x at its first two looks (27 steps, in the band two phases later; CI). From
    # then on it keeps up, every one of its rounds averaging with the fast worker
    settled = [r for r in strided if r["stride"] >= 0.75 * throttle - 0.5 and r["inner_steps"] <= LOCAL_STEPS // 1.5]
    assert settled and own.index(settled[0]) <= own.index(strided[0]) + LOOKS_TO_LOWER, \
        ([(r["outer_step"], r["stride"], r["inner_steps"]) for r in own], logs)
    later = own[own.index(settled[0]):]
    print(f"throttle {throttle:g}: slow worker's (outer step, stride, inner steps, group): "
          f"{[(r['outer_step'], r['stride'], r['inner_steps'], r['group_size']) for r in own]}")
    assert all(r["averaged"] and r["group_size"] == 2 for r in later), (later, logs)
    for r in later:
        assert r["stride"] >= 0.75 * throttle - 0.5 and r["inner_steps"] <= LOCAL_STEPS // 1.5, (r, own)
        assert r["samples"] == r["inner_steps"] * BATCH  # its weight: the samples it actually trained on
    # the fast worker's wait for it: from the time a phase of the slow one takes to about the noise of one
    before = [r["seconds"] for r in fast["rounds"][1:] if r["outer_step"] <= strided[0]["outer_step"] - 1]
    after = [r["seconds"] for r in fast["rounds"] if r["outer_step"] > settled[0]["outer_step"]]
    print(f"fast worker's sync seconds before the stride {before}, after {after}")
    assert after and statistics.median(after) < 0.5 * max(before or [float('inf')])


@pytest.mark.slow
def test_a_streaming_swarm_keeps_every_fragment_identical_for_a_newcomer_and_across_a_resume(tmp_path):
    """Three workers with --fragments 3 --overlap-steps 3, the third joining mid-run: after every phase all peers hold
    the same global bits (every fragment averaged in one group), the newcomer's included; a worker resumed from its
    checkpoint starts from exactly the model it left with and goes on with the fragment schedule."""
    run = "stream-cli"
    flags = ("--model", "tiny", "--local-steps", "24", "--fragments", "3", "--overlap-steps", "3", "--batch-size",
             str(BATCH), "--eval-batches", "1", "--matchmaking-time", "3", "--throttle", "2", "--until-outer-step",
             "16")  # throttled alike: phases of a few seconds, so that the newcomer's start-up does not outlast the run
    boot, maddr = start_bootstrap(tmp_path)
    procs = [boot]
    try:
        procs.append(start_worker(tmp_path, 0, maddr, run, *flags))
        procs.append(start_worker(tmp_path, 1, maddr, run, *flags, "--checkpoint-dir", str(tmp_path / "ckpt")))
        wait_until(lambda: report(tmp_path, 0).get("outer_steps", 0) >= 2, "the first workers' second phase", 180,
                   procs=[("worker 0", procs[1])])
        procs.append(start_worker(tmp_path, 2, maddr, run, *flags))
        for i, proc in enumerate(procs[1:]):
            assert exit_code(proc, 300, tmp_path / f"w{i}.log") == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]
        check_swarm_and_resume(tmp_path, maddr, run, flags, procs)
    finally:
        stop_all(procs)


def check_swarm_and_resume(tmp_path, maddr: str, run: str, flags: tuple, procs: list) -> None:
    reports = [report(tmp_path, i) for i in range(3)]
    logs = "\n".join((tmp_path / f"w{i}.log").read_text()[-2500:] for i in range(3))
    digests = [{r["outer_step"]: r["digest"] for r in rep["rounds"]} for rep in reports]
    newcomer_own = [r for r in reports[2]["rounds"] if not r["caught_up"]]
    assert reports[2]["start_outer_step"] >= 2 and newcomer_own, (reports[2]["rounds"], logs)
    for k, r in enumerate(newcomer_own):
        fragments = [f["fragment"] for f in r["fragments"]]
        if k == 0 and fragments != [0, 1, 2]:
            # it took the state part way through a phase, whose first fragments the state already held applied: its
            # first phase holds the fragments after them. Either a round of the next one was in flight, which it
            # joined with weight 0 (adding nothing, applying it like the donors), or none was, and it launched the
            # next one itself with the samples of the steps it trained (CI met both)
            assert fragments == list(range(fragments[0], 3)), (r, logs)
        else:
            assert fragments == [0, 1, 2], (r, logs)
        assert r["averaged"] and all(f["averaged"] for f in r["fragments"]), (r, logs)
        # the same global bits as the two others after the phase
        assert digests[0][r["outer_step"]] == digests[1][r["outer_step"]] == r["digest"], (r["outer_step"], logs)
    assert all(r["averaged"] for rep in reports[:2] for r in rep["rounds"]), logs

    # resumed alone: exactly the model it left with, and the fragment schedule goes on
    resumed = start_worker(tmp_path, 3, maddr, run, *flags[:-1], "17", "--checkpoint-dir", str(tmp_path / "ckpt"),
                           "--resume", "--matchmaking-time", "1")
    procs.append(resumed)  # stopped with the rest if anything below fails
    assert exit_code(resumed, 180, tmp_path / "w3.log") == 0, (tmp_path / "w3.log").read_text()[-3000:]
    again = report(tmp_path, 3)
    assert again["initial_eval_loss"] == reports[1]["final_eval_loss"]
    assert [r["outer_step"] for r in again["rounds"]] == [17]
    assert [f["fragment"] for f in again["rounds"][0]["fragments"]] == [0, 1, 2]
