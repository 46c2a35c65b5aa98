"""``p2ptrain bench --scale N``: N real ``join`` workers started at once on this machine, and what grows with N.

Per N, a ``bootstrap`` peer and N workers (each a process with its own DHT node and p2pd; the tiny model, one torch
thread, ``--target-group-size N``) run on loopback, all started in the same moment as a crowd of users would. While
they run, the harness scrapes every worker's Prometheus endpoint (``--metrics-port 0``: the port is read from its
log) and samples each worker's process tree (the worker, its averager and DHT processes, p2pd) with psutil. At the
end the workers' ``--report`` files give every round; ``summarize_scale`` turns reports and samples into the
figures of issue 21 (round time split, bytes, groups per outer step, outcomes, group-key lookups, peers seen, CPU,
memory, distinct final models). ``run_scale`` rewrites scale.json, scale.md and scale.png after each N, so an
interrupted run keeps what it measured.

Everything below ``run_scale``'s process handling is pure (reports and samples in, dicts and text out), so the
summaries are tested on hand-made reports without starting a process.
"""

from __future__ import annotations

import json
import math
import re
import statistics
import subprocess
import time
import urllib.request
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

from p2ptrain.bench.local import (LOOPBACK, ProcessTree, interrupts_raised, leftover_processes, loopback_join,
                                  read_json, stop_swarm)
from p2ptrain.daemons import DaemonError, spawn, wait_for_address
from p2ptrain.observe.metrics import round_outcome

MEMORY_BUDGET_BYTES = 24 * 2**30
"""the machine the issue asks about: how many peers fit in 24 GiB"""
METRICS_URL = re.compile(r"Prometheus metrics (?:of run \S+ )?at (http://\S+/metrics)")
"""the line a worker (and the bootstrap peer, with ``of run 'R'``) logs once its endpoint listens"""
SCRAPED = ("p2ptrain_group_lookups_total", "p2ptrain_peers_known", "p2ptrain_outer_step",
           "p2ptrain_round_failed_attempts_total", "p2ptrain_group_size", "p2ptrain_swarm_peers",
           "p2ptrain_swarm_looks_total")
"""the series a scrape keeps (plus every ``p2ptrain_rounds_total{outcome}``): a full scrape is ~60 series"""
MB = 1e6


@dataclass(frozen=True)
class ScaleConfig:
    peers: int
    """workers started at once; also their --target-group-size unless ``group_size`` is given"""
    group_size: Optional[int] = None
    """--target-group-size below ``peers``: several mixing groups per round (p2ptrain/mixing.py)"""
    local_steps: int = 10
    """--local-steps: inner steps between syncs"""
    outer_steps: int = 3
    """--max-outer-steps: syncs each worker takes part in before it leaves"""
    timeout_s: float = 600.0
    """the whole run of this N, start-up included; past it every daemon is stopped and the run counts as failed"""
    model: str = "tiny"
    scrape_period_s: float = 2.0
    """seconds between scrapes of every endpoint and samples of every process tree (a worker whose report shows
    a new round is scraped at once as well, so each round's counters are read close to its end)"""

    @property
    def num_shards(self) -> int:
        return max(16, self.peers)


def worker_args(cfg: ScaleConfig, initial_peer: str, run_id: str, report: Path) -> List[str]:
    """A worker's ``p2ptrain`` arguments: a user's defaults but for the group size, the shards and the run's length."""
    return loopback_join(initial_peer, run_id, report, model=cfg.model, local_steps=cfg.local_steps,
                         num_shards=cfg.num_shards,
                         extra=["--metrics-port", "0", "--max-outer-steps", str(cfg.outer_steps),
                                "--target-group-size", str(cfg.group_size or cfg.peers),
                                # a fleet started together trains together: on 2 cores 8 workers come up 8-17 s
                                # apart, and a first round drawn without the last ones left them alone in it
                                "--wait-for-peers", str(cfg.peers)])


# ------------------------------------------------------------------------------------------------ pure figures


def parse_metrics(text: str) -> Dict[str, float]:
    """A Prometheus text exposition as {sample name with its labels: value}, e.g.
    ``p2ptrain_rounds_total{outcome="committed"}``; only the series the summary reads (``SCRAPED``, rounds)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: Dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name not in SCRAPED and sample.name != "p2ptrain_rounds_total":
                continue
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = float(sample.value)
    return values


def _finite(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _stats(values: Iterable[Optional[float]]) -> Dict[str, Optional[float]]:
    xs = [x for x in values if x is not None]
    return {"median": statistics.median(xs) if xs else None, "max": max(xs) if xs else None}


def sync_rounds(report: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The rounds a worker synced in (averaged, or stepped alone after matchmaking found no group): not a state taken
    because the swarm had moved on (its seconds are a download's), not a leaving peer's abandoned round."""
    return [r for r in report.get("rounds", []) if not r.get("caught_up") and not r.get("abandoned")]


def round_split(entry: Dict[str, Any]) -> Dict[str, float]:
    """A round's wall seconds, and its matchmaking and all-reduce seconds on this peer's critical path (the rest:
    pseudo-gradient, outer step, digest, records)."""
    phases = entry.get("phases") or {}
    allreduce = entry.get("allreduce_s") or phases.get("allreduce", 0.0)
    matchmaking = phases.get("matchmaking", max(entry.get("seconds", 0.0) - allreduce, 0.0))
    return {"seconds": entry.get("seconds", 0.0), "matchmaking_s": matchmaking, "allreduce_s": allreduce}


def groups_by_step(reports: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per outer step, the groups that formed, as the workers' reports tell it: ``groups`` (sizes, largest first; a
    worker that found no group and stepped alone is a group of 1), ``behind`` (workers that took the swarm's state
    instead of averaging), ``abandoned``, and ``models`` (distinct digests of the global parameters after the step:
    1 when every worker holds the same model). Members of one group report the same ``group_size``; k workers
    reporting size g are ceil(k / g) groups (two groups of one size are told apart by their digests where they
    committed)."""
    by_step: Dict[int, List[Dict[str, Any]]] = {}
    for report in reports:
        for r in report.get("rounds", []):
            by_step.setdefault(r["outer_step"], []).append(r)
    steps = []
    for step in sorted(by_step):
        rounds = by_step[step]
        synced = [r for r in rounds if not r.get("caught_up") and not r.get("abandoned")]
        groups: List[int] = []
        for size in sorted({r.get("group_size", 1) for r in synced}, reverse=True):
            members = [r for r in synced if r.get("group_size", 1) == size]
            digests = {r.get("digest") for r in members if r.get("averaged") and r.get("digest")}
            count = max(math.ceil(len(members) / max(size, 1)), len(digests) if size > 1 else 0)
            groups += [size] * count
        steps.append({"outer_step": step, "groups": groups,
                      "behind": sum(1 for r in rounds if r.get("caught_up")),
                      "abandoned": sum(1 for r in rounds if r.get("abandoned") and not r.get("caught_up")),
                      "models": len({r.get("digest") for r in rounds if r.get("digest")})})
    return steps


def rounds_to_mix(reports: Sequence[Dict[str, Any]]) -> List[Optional[int]]:
    """Mixing groups: for each outer step s of the run, after how many rounds from s every worker's state had
    reached every other's (through the groups of s, s+1, ...: a worker's state reaches the members of its group,
    then theirs); None when the run ended first. Groups are read from the reports' ``members`` (base58 ids; a
    worker's id is the first member list it appears in alone, or the ids of all members reported)."""
    by_step: Dict[int, List[List[str]]] = {}
    for report in reports:
        for r in report.get("rounds", []):
            if r.get("members") and not r.get("caught_up"):
                by_step.setdefault(r["outer_step"], []).append(sorted(r["members"]))
    everyone = {peer for groups in by_step.values() for group in groups for peer in group}
    steps = sorted(by_step)
    result: List[Optional[int]] = []
    for i, start in enumerate(steps):
        reach = {peer: {peer} for peer in everyone}
        needed = None
        for j, step in enumerate(steps[i:]):
            for group in by_step[step]:
                merged = set().union(*(reach[peer] for peer in group))
                for peer in group:
                    reach[peer] = set(merged)
            if all(reached == everyone for reached in reach.values()):
                needed = j + 1
                break
        result.append(needed)
    return result


def lookups_per_round(samples: Sequence[Dict[str, Any]]) -> List[float]:
    """Group-key lookups each round of one worker cost, from its scrapes in order (``rounds``: rounds in its report
    when the scrape was taken, ``lookups``: ``p2ptrain_group_lookups_total`` then). Round k's count is the counter at
    the first scrape after round k ended less the one at the first scrape after round k-1; a round that ended with
    no scrape after it (the worker exited first) has no count."""
    first_after: Dict[int, float] = {0: 0.0}
    for s in samples:
        if s.get("lookups") is not None and s["rounds"] not in first_after:
            first_after[s["rounds"]] = s["lookups"]
    rounds = sorted(k for k in first_after if k > 0)
    return [first_after[k] - first_after[k - 1] for k in rounds if k - 1 in first_after]


def summarize_scale(cfg: ScaleConfig, reports: Sequence[Dict[str, Any]], workers: Sequence[Dict[str, Any]],
                    bootstrap: Optional[Dict[str, Any]] = None, *, wall_s: float = 0.0, status: str = "ok",
                    problems: Sequence[str] = ()) -> Dict[str, Any]:
    """Every figure of one N. ``reports``: the workers' reports ({} for one that wrote none), in worker order;
    ``workers``: what the harness measured of each, in the same order: ``samples`` (its scrapes: ``t``, ``rounds``,
    ``lookups``, ``peers_known``, ``failed_attempts``), ``cpu_s``, ``peak_rss``, ``peak_pss`` (bytes, the process
    tree's sum), ``exit_code``, ``log``, ``up_s`` (seconds from the start to its metrics endpoint). ``bootstrap``: the
    same for the bootstrap peer (``peak_rss``, ``peak_pss``, ``cpu_s``, ``swarm_peers``)."""
    n = cfg.peers
    synced = [r for report in reports for r in sync_rounds(report)]
    splits = [round_split(r) for r in synced]
    # the first round also waits for the slowest worker's start-up: the later ones are what a running swarm pays
    later = [round_split(r) for report in reports for r in sync_rounds(report)[1:]]
    averaged = [r for r in synced if r.get("averaged")]
    outcomes = Counter(round_outcome(r) for report in reports for r in report.get("rounds", []))
    failed_attempts = sum(max(r.get("attempts", 1) - (round_outcome(r) in ("committed", "partial", "repaired")), 0)
                          for r in synced)
    last_digests = [report["rounds"][-1].get("digest") for report in reports if report.get("rounds")]
    per_round_lookups = [x for w in workers for x in lookups_per_round(w.get("samples", []))]
    lookups_per_peer_round = []
    for report, w in zip(reports, workers):
        last = [s["lookups"] for s in w.get("samples", []) if s.get("lookups") is not None]
        rounds = len(sync_rounds(report))
        lookups_per_peer_round.append(last[-1] / rounds if last and rounds else None)
    peers_known = [max((s["peers_known"] for s in w.get("samples", []) if s.get("peers_known") is not None),
                       default=None) for w in workers]
    seen = [p for p in peers_known if p is not None]
    rss = [w.get("peak_rss") for w in workers]
    pss = [w.get("peak_pss") for w in workers]
    bootstrap = bootstrap or {}
    per_peer_rss = max((x for x in rss if x), default=None)
    per_peer_pss = max((x for x in pss if x), default=None)
    return {
        "peers": n, "status": status, "problems": list(problems), "config": asdict(cfg), "wall_s": wall_s,
        "workers_reporting": sum(1 for report in reports if report.get("rounds")),
        "workers_failed": [{"worker": i, "exit_code": w.get("exit_code"), "log": w.get("log")}
                           for i, w in enumerate(workers) if w.get("exit_code") not in (0,)],
        "startup_s": _stats(w.get("up_s") for w in workers),
        "round_s": _stats(s["seconds"] for s in splits),
        "matchmaking_s": _stats(s["matchmaking_s"] for s in splits),
        "allreduce_s": _stats(s["allreduce_s"] for s in splits),
        "round_s_after_first": _stats(s["seconds"] for s in later),
        "matchmaking_s_after_first": _stats(s["matchmaking_s"] for s in later),
        "allreduce_s_after_first": _stats(s["allreduce_s"] for s in later),
        "bytes_sent_per_round": _stats(r.get("bytes_sent", 0) for r in averaged),
        "bytes_received_per_round": _stats(r.get("bytes_received", 0) for r in averaged),
        "group_sizes": {str(size): count for size, count in sorted(Counter(r.get("group_size", 1)
                                                                           for r in synced).items())},
        "steps": groups_by_step(reports),
        "outcomes": dict(sorted(outcomes.items())),
        "rounds_committed": outcomes.get("committed", 0),
        "rounds_not_committed": sum(v for k, v in outcomes.items() if k != "committed"),
        "failed_attempts": failed_attempts,
        "lookups_per_peer_per_round": _stats(lookups_per_peer_round),
        "lookups_per_round": _stats(per_round_lookups),
        "peers_known_max": peers_known,
        "peers_known_min_of_max": min(seen) if seen else None,
        "peers_that_missed_some": sum(1 for p in seen if p < n) + sum(1 for p in peers_known if p is None),
        "mixed_rounds": sum(1 for r in averaged if r.get("mixed")),
        "rounds_to_mix": rounds_to_mix(reports),
        "final_models": len(set(last_digests)),
        "final_digests": dict(Counter(last_digests)),
        # --max-outer-steps counts a worker's syncs, not the run's step: one that took the state instead of a round
        # ends a step later than the rest, with a model of its own by construction
        "final_outer_steps": {str(k): v for k, v in sorted(Counter(report["rounds"][-1]["outer_step"]
                                                                   for report in reports if report.get("rounds"))
                                                           .items())},
        "cpu_s_per_peer": _stats(w.get("cpu_s") for w in workers),
        "peak_rss_per_peer": _stats(rss),
        "peak_pss_per_peer": _stats(pss),
        "bootstrap": {k: bootstrap.get(k) for k in ("peak_rss", "peak_pss", "cpu_s", "swarm_peers")},
        "largest_n_in_budget_rss": largest_fit(per_peer_rss, bootstrap.get("peak_rss")),
        "largest_n_in_budget_pss": largest_fit(per_peer_pss, bootstrap.get("peak_pss")),
    }


def largest_fit(per_peer_bytes: Optional[float], bootstrap_bytes: Optional[float],
                budget_bytes: float = MEMORY_BUDGET_BYTES) -> Optional[int]:
    """Workers of ``per_peer_bytes`` each (the largest measured: the safe side) that fit in ``budget_bytes`` beside
    the bootstrap peer."""
    if not per_peer_bytes:
        return None
    return max(int((budget_bytes - (bootstrap_bytes or 0)) // per_peer_bytes), 0)


def _fmt(value: Optional[float], spec: str = ".1f", scale: float = 1.0) -> str:
    return "-" if value is None else format(value if scale == 1.0 else value / scale, spec)


def format_steps(steps: Sequence[Dict[str, Any]]) -> str:
    """``s1: 2+1x6 (6 behind), 3 models; s2: 8`` -- per outer step its groups' sizes (``1x6``: six groups of 1), the
    workers that took the state, and the distinct models after it when more than one."""
    parts = []
    for step in steps:
        sizes = Counter(step["groups"])
        groups = "+".join(f"{size}" if count == 1 else f"{size}x{count}" for size, count in
                          sorted(sizes.items(), reverse=True)) or "none"
        extra = [f"{step['behind']} behind"] if step["behind"] else []
        extra += [f"{step['abandoned']} abandoned"] if step["abandoned"] else []
        models = f", {step['models']} models" if step["models"] > 1 else ""
        parts.append(f"s{step['outer_step']}: {groups}{' (' + ', '.join(extra) + ')' if extra else ''}{models}")
    return "; ".join(parts)


TABLE_HEADER = ("| N | status | wall s | round s median (mm + ar) | round s max (mm + ar) | MB sent / recv per peer "
                "per round | groups per outer step | rounds by outcome | failed attempts | group-key lookups per peer "
                "per round (median, max) | min over peers of max peers known | final models | CPU s per peer "
                "(median, max) | peak RSS per peer MB (median, max) | peak PSS per peer MB (median, max) | "
                "largest N in 24 GiB (RSS, PSS) |")


def scale_row(r: Dict[str, Any]) -> str:
    def split(kind: str) -> str:
        return (f"{_fmt(r['round_s'][kind])} ({_fmt(r['matchmaking_s'][kind])} + "
                f"{_fmt(r['allreduce_s'][kind])})")

    outcomes = ", ".join(f"{k} {v}" for k, v in r["outcomes"].items()) or "-"
    lookups = r["lookups_per_peer_per_round"]
    cells = [
        str(r["peers"]) + (f" (G={r['config']['group_size']})" if r.get("config", {}).get("group_size") else ""),
        r["status"], f"{r['wall_s']:.0f}", split("median"), split("max"),
        f"{_fmt(r['bytes_sent_per_round']['median'], '.2f', MB)} / "
        f"{_fmt(r['bytes_received_per_round']['median'], '.2f', MB)}",
        format_steps(r["steps"]) or "-", outcomes, str(r["failed_attempts"]),
        f"{_fmt(lookups['median'])}, {_fmt(lookups['max'])}",
        f"{_fmt(r['peers_known_min_of_max'], '.0f')} of {r['peers']}", final_models(r) + mixing_cell(r),
        f"{_fmt(r['cpu_s_per_peer']['median'], '.0f')}, {_fmt(r['cpu_s_per_peer']['max'], '.0f')}",
        f"{_fmt(r['peak_rss_per_peer']['median'], '.0f', MB)}, {_fmt(r['peak_rss_per_peer']['max'], '.0f', MB)}",
        f"{_fmt(r['peak_pss_per_peer']['median'], '.0f', MB)}, {_fmt(r['peak_pss_per_peer']['max'], '.0f', MB)}",
        f"{_fmt(r['largest_n_in_budget_rss'], 'd')}, {_fmt(r['largest_n_in_budget_pss'], 'd')}",
    ]
    return "| " + " | ".join(cells) + " |"


def mixing_cell(r: Dict[str, Any]) -> str:
    """``; 24 mixed rounds, all states met within 2 rounds`` for a run in mixing groups, else empty."""
    if not r.get("mixed_rounds"):
        return ""
    met = min((x for x in r.get("rounds_to_mix", []) if x), default=None)
    return f"; {r['mixed_rounds']} mixed rounds, " + (f"all states met within {met} rounds" if met else
                                                      "the states had not all met by the end")


def final_models(r: Dict[str, Any]) -> str:
    """``1``, or ``3 (ended at s3 x6, s4 x2)`` when the workers ended on different outer steps."""
    ends = r.get("final_outer_steps") or {}
    where = ", ".join(f"s{step} x{count}" for step, count in ends.items())
    return f"{r['final_models']}" + (f" (ended at {where})" if len(ends) > 1 else "")


def scale_markdown(results: Sequence[Dict[str, Any]]) -> str:
    lines = ["# p2ptrain bench --scale", "",
             "N real `join` workers started at once on loopback (tiny model, one torch thread each, "
             "`--target-group-size N`, or G where the N column says `(G=...)`: mixing groups, see "
             "docs/rounds.md) and a bootstrap peer, on one machine. Round times are each worker's syncs "
             "(not a state taken after being left behind): mm = matchmaking, ar = all-reduce. Bytes: the all-reduce "
             "payload of the rounds that averaged. Groups per outer step: `8+2+1x3` is a group of 8, one of 2 and "
             "three workers alone; *behind* ones took the swarm's state instead. Peers known: the most live peers a "
             "worker saw (itself included; N = no DHT split). Memory: the peak of each worker's process tree "
             "(worker, averager, DHT, p2pd); RSS counts pages the forked processes share once per process, PSS "
             "splits them; the largest N that fits 24 GiB uses the largest peer's peak plus the bootstrap peer's.",
             "", TABLE_HEADER, "|" + "---|" * TABLE_HEADER.count(" | ") + "---|"]
    lines += [scale_row(r) for r in results]
    problems = [(r["peers"], p) for r in results for p in r["problems"]]
    if problems:
        lines += ["", "## Problems", ""] + [f"- N={n}: {p}" for n, p in problems]
    return "\n".join(lines) + "\n"


def plot_scale(results: Sequence[Dict[str, Any]], path: Path) -> Path:
    """Round time split (median matchmaking and all-reduce, stacked; the max round as a marker) and bytes per peer
    per round against N."""
    from p2ptrain.observe import require

    require("matplotlib", extra="bench", feature="p2ptrain bench --scale's plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = sorted(results, key=lambda r: r["peers"])
    ns = [r["peers"] for r in rows]
    value = (lambda r, key, kind="median": r[key][kind] or 0.0)
    figure = Figure(figsize=(11, 4.2), layout="constrained")
    FigureCanvasAgg(figure)
    left, right = figure.subplots(1, 2)
    xs = list(range(len(ns)))
    mm = [value(r, "matchmaking_s") for r in rows]
    ar = [value(r, "allreduce_s") for r in rows]
    left.bar(xs, mm, label="matchmaking (median)", color="tab:orange")
    left.bar(xs, ar, bottom=mm, label="all-reduce (median)", color="tab:blue")
    left.plot(xs, [value(r, "round_s", "max") for r in rows], "kv", label="slowest round")
    left.plot(xs, [value(r, "round_s") for r in rows], "k_", markersize=14, label="round (median)")
    left.set(xticks=xs, xticklabels=[str(n) for n in ns], xlabel="workers N", ylabel="seconds",
             title="round time split")
    left.legend(fontsize=8)
    right.plot(ns, [value(r, "bytes_sent_per_round") / MB for r in rows], "o-", label="sent (median)")
    right.plot(ns, [value(r, "bytes_received_per_round") / MB for r in rows], "s--", label="received (median)")
    right.set(xscale="log", xticks=ns, xticklabels=[str(n) for n in ns], xlabel="workers N",
              ylabel="MB per peer per round", title="all-reduce bytes per peer")
    right.minorticks_off()  # the log axis's own ticks would crowd the N ticks
    right.set_ylim(bottom=0)
    right.legend(fontsize=8)
    figure.savefig(path, dpi=110)
    return path


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
            "peers_known": _finite(values.get("p2ptrain_peers_known")),
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


def summary_line(r: Dict[str, Any]) -> str:
    lookups = r["lookups_per_peer_per_round"]["median"]
    return (f"N={r['peers']}: {r['status']} in {r['wall_s']:.0f}s; round median {_fmt(r['round_s']['median'])}s "
            f"(matchmaking {_fmt(r['matchmaking_s']['median'])}s, all-reduce {_fmt(r['allreduce_s']['median'])}s), "
            f"max {_fmt(r['round_s']['max'])}s; groups {format_steps(r['steps']) or '-'}; "
            f"outcomes {r['outcomes'] or '-'}; {r['final_models']} final model(s); min peers known "
            f"{_fmt(r['peers_known_min_of_max'], '.0f')}/{r['peers']}; lookups/peer/round {_fmt(lookups)}; "
            f"peak RSS/peer {_fmt(r['peak_rss_per_peer']['max'], '.0f', MB)} MB"
            + "".join(f"\n  {p}" for p in r["problems"]))
