"""``p2ptrain bench --scale``'s report: the figures of each N (bench/scale_figures.py) as a markdown table, a plot and
a summary line."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, Dict, Optional, Sequence

MB = 1e6


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



def summary_line(r: Dict[str, Any]) -> str:
    lookups = r["lookups_per_peer_per_round"]["median"]
    return (f"N={r['peers']}: {r['status']} in {r['wall_s']:.0f}s; round median {_fmt(r['round_s']['median'])}s "
            f"(matchmaking {_fmt(r['matchmaking_s']['median'])}s, all-reduce {_fmt(r['allreduce_s']['median'])}s), "
            f"max {_fmt(r['round_s']['max'])}s; groups {format_steps(r['steps']) or '-'}; "
            f"outcomes {r['outcomes'] or '-'}; {r['final_models']} final model(s); min peers known "
            f"{_fmt(r['peers_known_min_of_max'], '.0f')}/{r['peers']}; lookups/peer/round {_fmt(lookups)}; "
            f"peak RSS/peer {_fmt(r['peak_rss_per_peer']['max'], '.0f', MB)} MB"
            + "".join(f"\n  {p}" for p in r["problems"]))
