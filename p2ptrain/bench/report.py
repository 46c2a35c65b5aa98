"""The benchmark's output: report.json (every figure), report.md (a table and notes) and PNG plots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

MiB = 1 << 20


def _fmt(value: Optional[float], spec: str, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def write_report(results: List[Dict], out: Path, environment: Dict) -> Path:
    """Write report.json, report.md and the plots for ``results`` (one ``summarize`` dict per configuration)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps({"environment": environment, "results": results}, indent=1))
    plots = _plots(results, out)
    lines = [
        "# p2ptrain swarm benchmark",
        "",
        f"Machine: {environment.get('machine', '?')}. Network: {environment.get('network', '?')}. "
        f"Bytes measured on: {results[0]['bytes_measured_on'] if results else 'n/a'}.",
        "",
        "Steady state = from the end of each peer's first round to the end of its last. Bounds: bytes, a butterfly "
        "all-reduce's 2(n-1)/n x payload per peer; seconds, those bytes over the link rate; utilization, an inner "
        "phase over the inner phase plus that bound; 'w/o waiting' leaves out the time a peer waited for slower "
        "ones (unequal shares of the CPU here), which is what communication itself costs; '... or eval' also the "
        "held-out eval each peer runs after every round (monitoring; seconds on a CPU, milliseconds on a GPU). A "
        "sync is counted from "
        "the round's last member's arrival: the "
        "time an earlier peer spent before that is *waiting* for a slower one (its own column, and not in "
        "'sync s'); bytes per sync are counted over the sync proper.",
        "",
        "| configuration | params | payload MiB | MiB/peer/sync | x butterfly | sync s | bound s | x bound | "
        "matchmaking s | all-reduce s | waiting s | eval s | inner phase s | utilization | w/o waiting | "
        "... or eval | bound allows | samples/s vs solo | vs data-parallel | final eval loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        per_sync = r["bytes_per_peer_per_sync"]
        util, util_net, util_train, util_bound = (
            r.get(k) and 100 * r[k] for k in ("compute_utilization", "utilization_without_waiting",
                                              "utilization_without_waiting_or_eval", "utilization_bound"))
        lines.append(
            f"| {r['name']} | {r['parameters'] / 1e6:.1f}M | {r['payload_bytes'] / MiB:.1f} | "
            f"{_fmt(per_sync and per_sync / MiB, '.1f')} | {_fmt(r['bytes_vs_butterfly'], '.2f')} | "
            f"{_fmt(r['sync_s'], '.2f')} | {_fmt(r['bandwidth_bound_s'], '.2f')} | {_fmt(r['sync_vs_bound'], '.2f')} | "
            f"{_fmt(r['matchmaking_s'], '.2f')} | {_fmt(r['allreduce_s'], '.2f')} | {_fmt(r['waiting_s'], '.2f')} | "
            f"{_fmt(r.get('eval_s'), '.2f')} | {_fmt(r['inner_phase_s'], '.0f')} | {_fmt(util, '.1f', '%')} | "
            f"{_fmt(util_net, '.1f', '%')} | {_fmt(util_train, '.1f', '%')} | {_fmt(util_bound, '.1f', '%')} | "
            f"{_fmt(r.get('throughput_vs_solo') and 100 * r['throughput_vs_solo'], '.1f', '%')} | "
            f"{_fmt(r['communication_reduction'], '.0f', 'x')} | {_fmt(r['final_eval_loss'], '.4f')} |"
        )
    nat = [r for r in results if r["config"].get("behind_nat")]
    if nat:
        lines += ["", "Behind NAT: the last workers each behind a NAT router of their own (MASQUERADE, no inbound). "
                      "While a public worker is live, the NATed ones act as clients: they send their whole "
                      "pseudo-gradient to the public peers and take the average back. With none, they reduce "
                      "through the bootstrap's relays, which carry every byte between them in and out.", "",
                  "| configuration | relayed / client | MiB/sync, public peer | MiB/sync, NATed peer | sync s | "
                  "sync / bound | share through the bootstrap | relayed connections |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in nat:
            by_mode = r.get("bytes_per_sync_by_mode", {})
            natted = by_mode.get("relayed") or by_mode.get("client")
            lines.append(f"| {r['name']} | {r.get('relayed_peers', 0)} / {r['client_mode_peers']} of "
                         f"{r['config']['peers']} | {_fmt(by_mode.get('public') and by_mode['public'] / MiB, '.2f')} | "
                         f"{_fmt(natted and natted / MiB, '.2f')} | {_fmt(r['sync_s'], '.2f')} | "
                         f"{_fmt(r.get('sync_vs_bound'), '.2f')} | {_fmt(r.get('relayed_share'), '.2f')} | "
                         f"{r['relayed_connections']} |")
    chatter = [r["waiting_chatter_bytes_per_s"] for r in results if r.get("waiting_chatter_bytes_per_s")]
    if chatter:
        lines += ["", f"While waiting for a slower peer, a peer's link carried {max(chatter) / 1e3:.0f} kB/s at most "
                      "(matchmaking requests under no_group_policy=wait)."]
    lines += [
        "",
        "samples/s vs solo: the samples per second entering all the peers' models, over the sum of each peer's "
        "own rate (" + "; ".join(sorted({r.get("solo_from", "median inner step") for r in results})) + "): "
        "'measured apart' is the rate it trained at alone in a run of its own with the same throttle and CPU share "
        "(bench --solo), 'median inner step' the rate at the median of its inner steps in the run itself.",
        "",
        "vs data-parallel: bytes one peer would send for the same inner steps with one fp32 all-reduce of the "
        "gradients per step (computed: steps x 2(n-1)/n x 4 bytes x parameters), over the bytes it sent here.",
        "",
        *[f"![{name}]({path.name})" for name, path in plots],
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
    return out / "report.md"


def _plots(results: List[Dict], out: Path) -> List[tuple]:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    made = []
    fig, ax = plt.subplots(figsize=(8, 5))
    for r in results:
        peer = r["peers"][0]
        start = peer["train_started_at"]
        times = [0.0] + [round_["finished_at"] - start for round_ in peer["rounds"]]
        losses = [peer["initial_eval_loss"]] + [round_["eval_loss"] for round_ in peer["rounds"]]
        ax.plot(times, losses, marker="o", label=r["name"])
    ax.set_xlabel("wall time since training started (s)")
    ax.set_ylabel("eval loss (peer 1)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "loss_vs_time.png", dpi=110)
    plt.close(fig)
    made.append(("eval loss vs wall time", out / "loss_vs_time.png"))

    fig, ax = plt.subplots(figsize=(8, 0.6 * len(results) + 1.5))
    names = [r["name"] for r in results]
    compute = [r["inner_phase_s"] or 0.0 for r in results]
    matchmaking = [r["matchmaking_s"] or 0.0 for r in results]
    transfer = [r["allreduce_s"] or 0.0 for r in results]
    waiting = [r.get("waiting_s") or 0.0 for r in results]
    evals = [r.get("eval_s") or 0.0 for r in results]
    ax.barh(names, compute, label="compute (inner phase)")
    ax.barh(names, waiting, left=compute, label="waiting for a slower peer")
    left = [c + w for c, w in zip(compute, waiting)]
    ax.barh(names, evals, left=left, label="held-out eval")
    left = [x + e for x, e in zip(left, evals)]
    ax.barh(names, matchmaking, left=left, label="matchmaking")
    ax.barh(names, transfer, left=[x + m for x, m in zip(left, matchmaking)], label="all-reduce")
    ax.set_xlabel("seconds per round (steady state)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "time_split.png", dpi=110)
    plt.close(fig)
    made.append(("time per round: compute, matchmaking, all-reduce", out / "time_split.png"))
    return made
