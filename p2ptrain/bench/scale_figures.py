"""``p2ptrain bench --scale``'s figures: one N's workers' reports and what the harness measured of them in, the
figures of issue 21 out (round time split, bytes, groups per outer step, outcomes, group-key lookups, peers seen, CPU,
memory, distinct final models). Pure: tested on hand-made reports without starting a process (bench/scale.py starts
them)."""

from __future__ import annotations

import math
import statistics
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence

from p2ptrain.observe.metrics import round_outcome

MEMORY_BUDGET_BYTES = 24 * 2**30
"""the machine the issue asks about: how many peers fit in 24 GiB"""
SCRAPED = ("p2ptrain_group_lookups_total", "p2ptrain_peers_known", "p2ptrain_outer_step",
           "p2ptrain_round_failed_attempts_total", "p2ptrain_group_size", "p2ptrain_swarm_peers",
           "p2ptrain_swarm_looks_total")
"""the series a scrape keeps (plus every ``p2ptrain_rounds_total{outcome}``): a full scrape is ~60 series"""


@dataclass(frozen=True)
class ScaleConfig:
    peers: int
    """workers started at once; also their --target-group-size unless ``group_size`` is given"""
    group_size: Optional[int] = None
    """--target-group-size below ``peers``: several mixing groups per round (p2ptrain/mixing.py)"""
    local_steps: int = 10
    """--local-steps: inner steps between syncs"""
    outer_steps: int = 3
    """--until-outer-step: the run's outer step every worker leaves at"""
    timeout_s: float = 600.0
    """the whole run of this N, start-up included; past it every daemon is stopped and the run counts as failed"""
    model: str = "tiny"
    scrape_period_s: float = 2.0
    """seconds between scrapes of every endpoint and samples of every process tree (a worker whose report shows
    a new round is scraped at once as well, so each round's counters are read close to its end)"""

    @property
    def num_shards(self) -> int:
        return max(16, self.peers)



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


def finite(value: Any) -> Optional[float]:
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
        # every worker leaves at the run's outer step S (--until-outer-step), one that took the state on the way too
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
