"""``p2ptrain bench --soak N``: N workers under load and churn, and whether the swarm still holds one model.

Per run, a ``bootstrap`` peer and N ``join`` workers (the tiny model, one torch thread, loopback, ``--wait-for-peers
N``, a user's defaults otherwise) train to ``--until-outer-step`` S, with everything a volunteer swarm meets at once:

- a CPU hog beside them (one busy process per core of this machine);
- one worker throttled 3x (``--throttle 3``);
- one worker killed with SIGKILL (its whole process group: a host that dies) at a random moment after the swarm
  reached outer step S/3;
- a newcomer that joins once the swarm reached outer step S/4 (its start-up takes 10-20 s here: it comes in the
  middle of the run);
- one worker that leaves cleanly early (``--until-outer-step S/2``).

``summarize_soak`` reads the workers' reports (pure, tested on hand-made ones): the distinct models held after each
outer step, the forks (a worker that stepped alone at an outer step another worker committed too), the asymmetric
rounds (a member of a committed round whose own record of that step is not that round), the rounds each worker
averaged, and the goodput: samples in the model the swarm holds over samples trained.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence

from p2ptrain.bench.local import (LOOPBACK, interrupts_raised, leftover_processes, loopback_join, read_json,
                                  stop_swarm)
from p2ptrain.daemons import DaemonError, spawn, wait_for_address

HOG = "import time\nwhile True:\n    time.time()"
"""a busy loop: the CPU hog beside the swarm"""


@dataclass(frozen=True)
class SoakConfig:
    workers: int = 4
    """workers started together (the newcomer comes on top)"""
    outer_steps: int = 20
    """S: every worker trains to the run's outer step S (--until-outer-step)"""
    local_steps: int = 20
    throttle: float = 3.0
    hog: bool = True
    kill: bool = True
    newcomer: bool = True
    early_leaver: bool = True
    timeout_s: float = 600.0
    seed: int = 0
    model: str = "tiny"


def _worker_args(cfg: SoakConfig, initial_peer: str, run_id: str, report: Path, until: int,
                 extra: Sequence[str] = ()) -> List[str]:
    return loopback_join(initial_peer, run_id, report, model=cfg.model, local_steps=cfg.local_steps,
                         num_shards=max(16, cfg.workers + 1), extra=["--until-outer-step", str(until), *extra])


def _committed(round_: Dict[str, Any]) -> bool:
    """A round this worker took part in and stepped with (averaged or alone), not a state it took."""
    return not round_.get("caught_up") and not round_.get("abandoned")


def summarize_soak(reports: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The figures of one run from the workers' reports ({} for a worker that wrote none)."""
    by_step: Dict[int, List[tuple]] = {}
    for w, report in enumerate(reports):
        for r in report.get("rounds", []):
            by_step.setdefault(r["outer_step"], []).append((w, r))
    ids = {report.get("peer_id"): w for w, report in enumerate(reports) if report.get("peer_id")}
    models = {step: len({r.get("digest") for _, r in rounds if r.get("digest")}) for step, rounds in by_step.items()}
    forks, asymmetric = [], []
    for step, rounds in sorted(by_step.items()):
        committed = [(w, r) for w, r in rounds if _committed(r)]
        for w, r in committed:
            if not r.get("averaged") and len(committed) > 1:
                forks.append({"outer_step": step, "worker": w})
            if r.get("averaged"):
                for member in r.get("members") or []:
                    m = ids.get(member)
                    if m is None or m == w:
                        continue
                    theirs = [x for v, x in rounds if v == m]
                    if theirs and not any(x.get("averaged") and x.get("digest") == r.get("digest") for x in theirs):
                        asymmetric.append({"outer_step": step, "worker": m, "member_of": w})
    ends: Dict[int, set] = {}
    for report in reports:
        if report.get("rounds"):
            last = report["rounds"][-1]
            ends.setdefault(last["outer_step"], set()).add(last.get("digest"))
    trained = sum(report.get("samples", 0) for report in reports)
    forked = {(f["worker"], f["outer_step"]) for f in forks}
    # a forking round's samples are in a model the swarm does not hold
    kept = sum(r.get("samples", 0) for w, report in enumerate(reports) for r in report.get("rounds", [])
               if _committed(r) and (r.get("averaged") or (w, r["outer_step"]) not in forked))
    group_sizes = [r.get("group_size", 1) for report in reports for r in report.get("rounds", []) if _committed(r)]
    return {
        "models_per_step": {str(k): v for k, v in sorted(models.items())},
        "steps_with_several_models": sum(1 for v in models.values() if v > 1),
        "final_models_per_step": {str(k): len(v) for k, v in sorted(ends.items())},
        "forks": forks,
        "asymmetric": asymmetric,
        "rounds_averaged": [sum(1 for r in report.get("rounds", []) if r.get("averaged")) for report in reports],
        "states_taken": [sum(1 for r in report.get("rounds", []) if r.get("caught_up")) for report in reports],
        "group_size_median": statistics.median(group_sizes) if group_sizes else None,
        "samples_trained": trained,
        "goodput": kept / trained if trained else None,
    }


def soak_line(run: int, r: Dict[str, Any]) -> str:
    goodput = f"{r['goodput']:.0%}" if r.get("goodput") is not None else "-"
    return (f"run {run}: {r['status']} in {r['wall_s']:.0f}s; forks {len(r['forks'])}, asymmetric "
            f"{len(r['asymmetric'])}, steps with several models {r['steps_with_several_models']}, final models per "
            f"step {r['final_models_per_step']}; rounds averaged {r['rounds_averaged']}, states taken "
            f"{r['states_taken']}; goodput {goodput}" + "".join(f"\n  {p}" for p in r["problems"]))


def run_soak_once(cfg: SoakConfig, out: Path, echo: Callable[[str], None] = print) -> Dict[str, Any]:
    """One run of the scenario (module docstring); its logs and reports stay in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(cfg.seed)
    run_id = f"soak{cfg.workers}-{uuid.uuid4().hex[:8]}"
    procs: List[subprocess.Popen] = []
    hogs: List[subprocess.Popen] = []
    problems: List[str] = []
    status, started = "ok", time.monotonic()
    n = cfg.workers
    half = max(2, cfg.outer_steps // 2)
    roles = {"throttled": n - 1, "killed": 0 if cfg.kill else None, "leaver": 1 if cfg.early_leaver else None}
    reports = [out / f"w{i}.json" for i in range(n + cfg.newcomer)]
    for path in reports:
        path.unlink(missing_ok=True)
    killed_at = newcomer_at = None
    try:
        maddrs = out / "bootstrap.maddrs"
        maddrs.unlink(missing_ok=True)
        procs.append(spawn(["bootstrap", "--host-maddrs", LOOPBACK, "--maddrs-file", str(maddrs), "--run-id", run_id],
                           out / "bootstrap.log"))
        initial_peer = wait_for_address(maddrs, procs[0])
        if cfg.hog:
            hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(os.cpu_count() or 1)]
        for i in range(n):
            extra = ["--wait-for-peers", str(n)]
            if i == roles["throttled"] and cfg.throttle > 1:
                extra += ["--throttle", str(cfg.throttle)]
            until = half if i == roles["leaver"] else cfg.outer_steps
            procs.append(spawn(_worker_args(cfg, initial_peer, run_id, reports[i], until, extra), out / f"w{i}.log"))
        kill_step = max(1, cfg.outer_steps // 3)
        kill_delay_s = rng.uniform(0.0, 3.0)
        echo(f"soak N={n}: started (run {run_id}; logs in {out})")
        last_line = time.monotonic()
        while any(p.poll() is None for p in procs[1:]):
            now = time.monotonic()
            if now - started > cfg.timeout_s:
                status = "timeout"
                problems.append(f"workers still running after {cfg.timeout_s:.0f}s")
                break
            steps = [max((r["outer_step"] for r in read_json(p).get("rounds", [])), default=0) for p in reports]
            swarm_step = max(steps)
            if roles["killed"] is not None and killed_at is None and swarm_step >= kill_step:
                killed_at = now + kill_delay_s
            if killed_at is not None and now >= killed_at and procs[1 + roles["killed"]].poll() is None:
                os.killpg(procs[1 + roles["killed"]].pid, signal.SIGKILL)
                procs[1 + roles["killed"]].wait()
                echo(f"soak N={n}: killed worker {roles['killed']} (SIGKILL, its process group) at swarm outer step "
                     f"{swarm_step}")
            if cfg.newcomer and newcomer_at is None and swarm_step >= max(1, cfg.outer_steps // 4):
                newcomer_at = now
                procs.append(spawn(_worker_args(cfg, initial_peer, run_id, reports[n], cfg.outer_steps),
                                   out / f"w{n}.log"))
                echo(f"soak N={n}: a newcomer joins at swarm outer step {swarm_step}")
            if now - last_line >= 15:
                echo(f"soak N={n}: swarm at outer step {swarm_step}/{cfg.outer_steps}, {now - started:.0f}s")
                last_line = now
            time.sleep(0.3)
    except DaemonError as e:
        status = "failed"
        problems.append(str(e))
    except KeyboardInterrupt:
        status = "interrupted"
        problems.append(f"interrupted after {time.monotonic() - started:.0f}s")
    finally:
        wall_s = time.monotonic() - started
        for hog in hogs:
            hog.kill()
            hog.wait()
        exited = [p.returncode for p in procs[1:]]
        if procs:
            stop_swarm(procs)
            problems += leftover_processes(procs)
    for i, code in enumerate(exited):
        expected = -signal.SIGKILL if i == roles["killed"] else 0
        if code not in (expected, None):
            problems.append(f"worker {i} exited with code {code}: see {out / f'w{i}.log'}")
            status = "failed" if status == "ok" else status
    result = summarize_soak([read_json(p) for p in reports])
    return {**result, "status": status, "problems": problems, "wall_s": wall_s, "config": asdict(cfg)}


def run_soak(workers: Sequence[int], runs: int, out: Path, *, outer_steps: int = 20, local_steps: int = 20,
             timeout_s: float = 600.0, echo: Callable[[str], None] = print) -> Dict[str, Any]:
    """``runs`` runs for each N in ``workers``; soak.json is rewritten after every run."""
    out.mkdir(parents=True, exist_ok=True)
    report: Dict[str, Any] = {"results": {}}
    with interrupts_raised():
        for n in workers:
            results = report["results"].setdefault(str(n), [])
            for run in range(runs):
                cfg = SoakConfig(workers=n, outer_steps=outer_steps, local_steps=local_steps, timeout_s=timeout_s,
                                 seed=run)
                result = run_soak_once(cfg, out / f"n{n}" / f"run{run}", echo)
                results.append(result)
                (out / "soak.json").write_text(json.dumps(report, indent=2))
                echo(soak_line(run, result))
                if result["status"] == "interrupted":
                    raise KeyboardInterrupt
            report.setdefault("totals", {})[str(n)] = soak_totals(results)
            (out / "soak.json").write_text(json.dumps(report, indent=2))
            echo(f"soak N={n}: {soak_totals(results)}")
    return report


def soak_totals(results: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """The runs of one N together: the issue's gates."""
    goodputs = [r["goodput"] for r in results if r.get("goodput") is not None]
    return {"runs": len(results), "runs_ok": sum(r["status"] == "ok" for r in results),
            "forks": sum(len(r["forks"]) for r in results),
            "asymmetric": sum(len(r["asymmetric"]) for r in results),
            "runs_with_one_model_per_step": sum(r["steps_with_several_models"] == 0 for r in results),
            "goodput_median": statistics.median(goodputs) if goodputs else None,
            "goodput_min": min(goodputs) if goodputs else None}
