"""``p2ptrain bench --scale N``: N real ``join`` workers started at once on this machine, and what grows with N.

Per N, a ``bootstrap`` peer and N workers (each a process with its own DHT node and p2pd; the tiny model, one torch
thread, ``--target-group-size N``) run on loopback, all started in the same moment as a crowd of users would. While
they run, the harness scrapes every worker's Prometheus endpoint (``--metrics-port 0``: the port is read from its
log) and samples each worker's process tree (the worker, its averager and DHT processes, p2pd) with psutil. At the
end the workers' ``--report`` files give every round; ``summarize_scale`` turns reports and samples into the
figures of issue 21 (round time split, bytes, groups per outer step, outcomes, group-key lookups, peers seen, CPU,
memory, distinct final models). ``run_scale`` rewrites scale.json, scale.md and scale.png after each N, so an
interrupted run keeps what it measured.

This module is the process handling; the figures (bench/scale_figures.py) and the report (bench/scale_report.py) are
pure (reports and samples in, dicts and text out), so the summaries are tested on hand-made reports without starting
a process.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from p2ptrain.bench.local import (LOOPBACK, ProcessTree, interrupts_raised, leftover_processes, loopback_join,
                                  read_json, stop_swarm)
from p2ptrain.bench.scale_figures import MEMORY_BUDGET_BYTES, ScaleConfig, finite, parse_metrics, summarize_scale
from p2ptrain.bench.scale_report import plot_scale, scale_markdown, summary_line
from p2ptrain.daemons import DaemonError, spawn, wait_for_address

METRICS_URL = re.compile(r"Prometheus metrics (?:of run \S+ )?at (http://\S+/metrics)")
"""the line a worker (and the bootstrap peer, with ``of run 'R'``) logs once its endpoint listens"""


def worker_args(cfg: ScaleConfig, initial_peer: str, run_id: str, report: Path) -> List[str]:
    """A worker's ``p2ptrain`` arguments: a user's defaults but for the group size, the shards and the run's length."""
    return loopback_join(initial_peer, run_id, report, model=cfg.model, local_steps=cfg.local_steps,
                         num_shards=cfg.num_shards,
                         extra=["--metrics-port", "0", "--until-outer-step", str(cfg.outer_steps),
                                "--target-group-size", str(cfg.group_size or cfg.peers),
                                # a fleet started together trains together: on 2 cores 8 workers come up 8-17 s
                                # apart, and a first round drawn without the last ones left them alone in it
                                "--wait-for-peers", str(cfg.peers)])


# ------------------------------------------------------------------------------------------------ the processes


def _metrics_url(log: Path) -> Optional[str]:
    try:
        found = METRICS_URL.search(log.read_text(errors="replace"))
    except OSError:
        return None
    return found.group(1) if found else None


def _scrape(url: str) -> Optional[Dict[str, float]]:
    try:
        with urllib.request.urlopen(url, timeout=3) as answer:
            return parse_metrics(answer.read().decode())
    except (OSError, ValueError):
        return None  # the worker is busy or leaving: the next scrape will do


def _sample_of(values: Dict[str, float], t: float, rounds: int) -> Dict[str, Any]:
    return {"t": round(t, 2), "rounds": rounds, "lookups": values.get("p2ptrain_group_lookups_total"),
            "peers_known": finite(values.get("p2ptrain_peers_known")),
            "failed_attempts": values.get("p2ptrain_round_failed_attempts_total"),
            "outcomes": {k.split('"')[1]: v for k, v in values.items() if k.startswith("p2ptrain_rounds_total{")}}


def run_one(cfg: ScaleConfig, out: Path, echo: Callable[[str], None] = print) -> Dict[str, Any]:
    """Run N workers to their last sync (or to ``cfg.timeout_s``, or a Ctrl-C: status "interrupted") and return
    ``summarize_scale``'s figures. The logs and reports stay in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    n = cfg.peers
    run_id = f"scale{n}-{uuid.uuid4().hex[:8]}"
    procs: List[subprocess.Popen] = []
    trees: List[ProcessTree] = []
    samples: List[List[Dict[str, Any]]] = [[] for _ in range(n)]
    urls: List[Optional[str]] = [None] * n
    up_s: List[Optional[float]] = [None] * n
    rounds_seen = [0] * n
    problems: List[str] = []
    status = "ok"
    boot_samples: List[Dict[str, float]] = []
    started = time.monotonic()
    try:
        maddrs = out / "bootstrap.maddrs"
        maddrs.unlink(missing_ok=True)
        procs.append(spawn(["bootstrap", "--host-maddrs", LOOPBACK, "--maddrs-file", str(maddrs), "--run-id", run_id,
                            "--metrics-port", "0"], out / "bootstrap.log"))
        trees.append(ProcessTree(procs[0]))
        try:
            initial_peer = wait_for_address(maddrs, procs[0])
        except DaemonError as e:
            raise DaemonError(f"{e}; see {out / 'bootstrap.log'}") from None
        boot_url = _metrics_url(out / "bootstrap.log")
        reports = [out / f"w{i}.json" for i in range(n)]
        logs = [out / f"w{i}.log" for i in range(n)]
        for path in reports:
            path.unlink(missing_ok=True)
        # all at once, as a crowd: no worker waits for another to be up
        for i in range(n):
            procs.append(spawn(worker_args(cfg, initial_peer, run_id, reports[i]), logs[i]))
            trees.append(ProcessTree(procs[-1]))
        started = time.monotonic()
        echo(f"N={n}: started {n} workers (run {run_id}; logs in {out})")
        last_scrape, last_line, last_state = -math.inf, time.monotonic(), None
        try:
            with ThreadPoolExecutor(max_workers=8) as pool:
                while any(tree.poll() is None for tree in trees[1:]):
                    now = time.monotonic()
                    if now - started > cfg.timeout_s:
                        running = [i for i, tree in enumerate(trees[1:]) if tree.poll() is None]
                        status = "timeout"
                        problems.append(f"{len(running)} worker(s) still running after {cfg.timeout_s:.0f}s, e.g. "
                                        f"worker {running[0]}: see {logs[running[0]]}")
                        break
                    for i in range(n):
                        if urls[i] is None and (url := _metrics_url(logs[i])):
                            urls[i], up_s[i] = url, now - started
                    counts = [len(read_json(path).get("rounds", [])) for path in reports]
                    fresh = [i for i in range(n) if counts[i] != rounds_seen[i]]
                    rounds_seen = counts
                    due = now - last_scrape >= cfg.scrape_period_s
                    targets = [i for i in range(n) if urls[i] and trees[i + 1].proc.returncode is None
                               and (due or i in fresh)]
                    if targets:
                        for i, values in zip(targets, pool.map(lambda i: _scrape(urls[i]), targets)):
                            if values is not None:
                                samples[i].append(_sample_of(values, time.monotonic() - started, counts[i]))
                    if due:
                        last_scrape = now
                        for tree in trees:
                            tree.sample()
                        if boot_url and (values := _scrape(boot_url)):
                            boot_samples.append(values)
                    up = sum(1 for u in urls if u)
                    running = sum(1 for tree in trees[1:] if tree.proc.returncode is None)
                    state = (up, sum(counts), running)
                    if state != last_state and now - last_line >= 5 or now - last_line >= 30:
                        echo(f"N={n}: {up}/{n} workers up, {running} running, {sum(counts)}/{n * cfg.outer_steps} "
                             f"rounds seen, {now - started:.0f}s")
                        last_line, last_state = now, state
                    time.sleep(0.5)
        except KeyboardInterrupt:  # stop, but keep what this N measured so far (a second one skips that)
            status = "interrupted"
            problems.append(f"interrupted after {time.monotonic() - started:.0f}s")
    finally:
        wall_s = time.monotonic() - started
        exited = [tree.proc.returncode for tree in trees[1:]]  # None: still running, stopped by the harness
        stop_swarm(procs)
        problems += leftover_processes(procs)
    for i, code in enumerate(exited):
        if code not in (0, None):
            problems.append(f"worker {i} exited with code {code}: see {logs[i]}")
    if status == "ok" and any(code != 0 for code in exited):
        status = "failed"
    workers = [{**tree.figures(), "samples": samples[i], "exit_code": exited[i], "log": str(logs[i]),
                "up_s": up_s[i]} for i, tree in enumerate(trees[1:])]
    # the bootstrap peer's count of the run's live peers, all modes: its own view of the swarm's size
    swarm_peers = [sum(v for k, v in s.items() if k.startswith("p2ptrain_swarm_peers")) for s in boot_samples]
    boot = {**trees[0].figures(), "swarm_peers": max(swarm_peers, default=None)}
    result = summarize_scale(cfg, [read_json(path) for path in reports], workers, boot, wall_s=wall_s, status=status,
                             problems=problems)
    (out / "measured.json").write_text(json.dumps({"workers": workers, "bootstrap": boot}))
    return result


def run_scale(peer_counts: Sequence[int], *, out: Path, local_steps: int = 10, outer_steps: int = 3,
              timeout_s: float = 600.0, group_size: Optional[int] = None,
              echo: Callable[[str], None] = print) -> Dict[str, Any]:
    """Each N in turn (a fresh bootstrap peer and run for each); scale.json, scale.md and scale.png are rewritten
    after every N. A SIGTERM or SIGINT stops the daemons as a Ctrl-C does (``local.interrupts_raised``)."""
    out.mkdir(parents=True, exist_ok=True)
    results: List[Dict[str, Any]] = []
    report = {"memory_budget_bytes": MEMORY_BUDGET_BYTES, "results": results}

    with interrupts_raised():
        for n in peer_counts:
            cfg = ScaleConfig(peers=n, local_steps=local_steps, outer_steps=outer_steps, timeout_s=timeout_s,
                              group_size=group_size if group_size and group_size < n else None)
            try:
                result = run_one(cfg, out / f"n{n}", echo)
            except DaemonError as e:
                result = summarize_scale(cfg, [], [], status="failed", problems=[str(e)])
            results.append(result)
            _write(report, out)
            echo(summary_line(result))
            if result["status"] == "interrupted":
                raise KeyboardInterrupt
    return report


def _write(report: Dict[str, Any], out: Path) -> None:
    (out / "scale.json").write_text(json.dumps(report, indent=2))
    (out / "scale.md").write_text(scale_markdown(report["results"]))
    try:
        plot_scale(report["results"], out / "scale.png")
    except Exception as e:  # noqa: BLE001 -- the figures are in the JSON and MD; a plot is not worth the run
        (out / "scale.png").unlink(missing_ok=True)
        report.setdefault("problems", []).append(f"no plot: {e}")
