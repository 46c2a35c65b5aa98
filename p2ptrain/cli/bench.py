"""``p2ptrain bench``: real swarms over rate-limited links, the convergence experiment, ``--scale N`` workers at once
and ``--crowd M`` newcomers joining trainers; each mode's work is in ``p2ptrain/bench/``."""

from __future__ import annotations

import os
import sys

import click

from p2ptrain.cli.options import BadInput
from p2ptrain.config import AGGREGATION_NAMES


def _streaming_schedule(text: str) -> tuple:
    """``bench --streaming``'s FRAGMENTS[:OVERLAP_STEPS] as (fragments, overlap_steps or None)."""
    fragments, _, overlap = text.partition(":")
    try:
        schedule = int(fragments), (int(overlap) if overlap else None)
    except ValueError:
        schedule = (0, 0)
    if schedule[0] < 1 or (schedule[1] is not None and schedule[1] < 0):
        raise BadInput(f"--streaming {text!r} is not FRAGMENTS[:OVERLAP_STEPS]; e.g. --streaming 4 or --streaming 1:0")
    return schedule


@click.command()
@click.option("--model", "models", multiple=True, default=["small"], show_default=True,
              help="Built-in model size (repeatable).")
@click.option("--peers", type=click.IntRange(min=2), default=3, show_default=True,
              help="Training peers, each a host of its own (at most 8; --convergence: any number, replicas in one "
                   "process).")
@click.option("--rate-mbit", "rates", type=click.FloatRange(min=0.1), multiple=True, default=[100.0],
              show_default=True, help="Each host's link rate, both ways (repeatable).")
@click.option("--local-steps", "local_steps", type=click.IntRange(min=1), multiple=True,
              help="H (repeatable); default: from --phase-s.")
@click.option("--phase-s", "phases", type=click.FloatRange(min=1), multiple=True,
              help="Pick H so an inner phase lasts about this long on one core (repeatable); default 60.")
@click.option("--outer-steps", type=click.IntRange(min=2), default=3, show_default=True, help="Rounds per run.")
@click.option("--compression", "compressions", multiple=True, default=["fp16"], show_default=True,
              help="Wire codec (repeatable).")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--out", type=click.Path(file_okay=False), default="bench-out", show_default=True,
              help="Folder for report.md, report.json, plots and the daemons' logs.")
@click.option("--behind-nat", "behind_nat", type=click.IntRange(min=0), multiple=True, default=[0], show_default=True,
              help="Put this many of the workers behind NAT routers of their own (repeatable, to compare).")
@click.option("--grouping", "groupings", type=click.Choice(["pinned", "defaults"]), multiple=True,
              default=["pinned"], show_default=True,
              help="pinned: every round holds all the peers (--target-group-size etc. set to the peers); defaults: "
                   "the workers get none of those flags, as a user's (repeatable, to compare).")
@click.option("--streaming", "streaming", multiple=True, default=["1:0"], show_default=True,
              help="The sync as FRAGMENTS[:OVERLAP_STEPS] (repeatable, to compare): 1:0 is the blocking sync; "
                   "without :OVERLAP_STEPS, the most the schedule allows (H // FRAGMENTS - 1).")
@click.option("--slow-peer", "throttles", type=click.FloatRange(min=1), multiple=True, default=[1.0],
              show_default=True, help="Make the last worker this many times slower (join --throttle; repeatable).")
@click.option("--cpu-per-peer", type=click.FloatRange(min=0.05), default=None,
              help="Limit each worker (and its p2pd) to this many CPUs with a cgroup quota (root), so runs with "
                   "fewer or slower peers keep the same hardware per peer; default: they share the cores.")
@click.option("--solo", is_flag=True, help="Also run each configuration with its peers apart (each alone in a run "
                                            "of its own) first: 'samples/s vs solo' against their measured speed.")
@click.option("--loopback", is_flag=True, help="No namespaces or rate limit, even as root.")
@click.option("--clean", "clean_only", is_flag=True, help="Remove namespaces a killed benchmark left, then exit.")
@click.option("--convergence", "convergence_steps", type=click.IntRange(min=1), multiple=True,
              help="Instead: the convergence experiment at this many inner steps (repeatable): alone, data-parallel "
                   "with --peers x the batch, DiLoCo per --local-steps and --compression, and the real swarm.")
@click.option("--mixing-group-size", "mixing_group_sizes", type=click.IntRange(min=2), multiple=True,
              help="--convergence: also DiLoCo in Moshpit mixing groups of at most G peers (repeatable), a row next "
                   "to each H and codec's one-group row, with the replicas' spread per round in the report.")
@click.option("--sparse-k", "sparse_ks", type=click.IntRange(min=1, max=4096), multiple=True,
              help="--convergence: also SparseLoCo's sparse 2-bit round keeping k values of every 4096 (repeatable: "
                   "one row per k and H), with bytes per sync and a plot of eval loss against bytes sent; with k = 128, "
                   "also the real swarm's --compression sparse at the smallest H.")
@click.option("--attack", "attacks", type=click.Choice(["x5", "flip", "direction", "drift", "stale", "wrong-data"]),
              multiple=True,
              help="--convergence: instead, one attacker among --peers replicas (repeatable): its pseudo-gradient "
                   "x5, sign-flipped, a fixed direction at 5x its norm, plus 20% of its norm along that direction, "
                   "its previous round's, or of its shard read backwards; each --aggregation without and with each "
                   "attack, at the first --local-steps, with what a direction check sees of each sender. Writes "
                   "robust.md and robust.json in --out.")
@click.option("--attackers", type=click.IntRange(min=1), default=1, show_default=True,
              help="--attack: how many of the --peers replicas attack, colluding (the same direction).")
@click.option("--aggregation", "aggregations", multiple=True, default=["mean", "clip", "trim"], show_default=True,
              type=click.Choice(AGGREGATION_NAMES),
              help="--attack: the reducers' rules to compare (repeatable); R+check: R with the sender check acting "
                   "(a sender it convicts is left out of the rounds after).")
@click.option("--replay-rate", type=click.FloatRange(min=0.0, max=1.0), default=None,
              help="--attack: also the replay check acting in every run: each round each sender's phase is replayed "
                   "with this probability by another replica, and one whose pseudo-gradient is not its replay's is "
                   "left out from the next round (robust.md says when, and what the replays cost).")
@click.option("--straggler-misses", "straggler_misses", type=click.IntRange(min=2), default=None,
              help="--convergence: instead, the last of --peers replicas misses every Mth round; what it does with "
                   "the work that missed (discard, fold into its next round) against nobody missing, at the first "
                   "--local-steps, on --seeds seeds. Writes straggler.md and straggler.json in --out.")
@click.option("--seeds", type=click.IntRange(min=1), default=3, show_default=True,
              help="--straggler-misses: seeds per policy.")
@click.option("--no-swarm", "no_swarm", is_flag=True,
              help="--convergence: leave out the real swarm's rows (--peers join daemons on this host).")
@click.option("--scale", "scale_peers", type=click.IntRange(min=2), multiple=True,
              help="Instead: N tiny-model workers started at once on loopback (repeatable: --scale 4 --scale 8): "
                   "round time split, bytes, groups, lookups, peers seen, CPU and memory per peer, final models; "
                   "--outer-steps syncs each. Writes scale.json, scale.md, scale.png in --out.")
@click.option("--scale-local-steps", type=click.IntRange(min=1), default=10, show_default=True,
              help="--scale: inner steps between syncs.")
@click.option("--scale-group-size", type=click.IntRange(min=2), default=None,
              help="--scale: --target-group-size G below N: mixing groups of at most G (default: N, one group).")
@click.option("--scale-timeout", type=click.FloatRange(min=10), default=600.0, show_default=True,
              help="--scale: seconds one N may take, start-up included; then every daemon is stopped and the N "
                   "counts as failed.")
@click.option("--crowd", "crowd_newcomers", type=click.IntRange(min=1), default=None,
              help="Instead: M newcomers join at once while --crowd-trainers train (tiny model, loopback), after "
                   "one newcomer alone: their waits, the donors' shares, the trainers' rounds. Writes crowd.md, "
                   "crowd.json in --out.")
@click.option("--crowd-trainers", type=click.IntRange(min=1), default=8, show_default=True,
              help="--crowd: workers training when the newcomers come.")
@click.option("--soak", "soak_workers", type=click.IntRange(min=3), multiple=True,
              help="Instead: N tiny-model workers to outer step --outer-steps beside a CPU hog, one throttled 3x, one "
                   "killed mid-run, a newcomer and an early leaver (repeatable: --soak 4 --soak 8): forks, "
                   "asymmetric rounds, models per outer step, goodput. Writes soak.json in --out.")
@click.option("--soak-runs", type=click.IntRange(min=1), default=1, show_default=True,
              help="--soak: runs of each N.")
@click.option("--soak-outer-steps", type=click.IntRange(min=4), default=20, show_default=True,
              help="--soak: the run's outer step every worker trains to.")
@click.option("--soak-local-steps", type=click.IntRange(min=1), default=20, show_default=True,
              help="--soak: inner steps between syncs.")
def bench(models, peers, rates, local_steps, phases, outer_steps, compressions, batch_size, out, behind_nat, groupings,
          streaming, throttles, cpu_per_peer, solo, loopback, clean_only, convergence_steps, mixing_group_sizes,
          sparse_ks, attacks, attackers, aggregations, replay_rate, straggler_misses, seeds, no_swarm, scale_peers,
          scale_local_steps, scale_group_size, scale_timeout, crowd_newcomers,
          crowd_trainers, soak_workers, soak_runs, soak_outer_steps, soak_local_steps) -> None:
    """Benchmark real swarms over rate-limited links (one network namespace per peer; root needed, else
    loopback): compute utilization, bytes on the wire, sync seconds against the bandwidth bound, eval loss."""
    from pathlib import Path

    from p2ptrain.averaging.compression import COMPRESSION_CHOICES, SPARSE
    from p2ptrain.bench.main import clean, run_bench
    from p2ptrain.bench.swarm import BenchFailed
    from p2ptrain.model import MODEL_SIZES

    if clean_only:
        removed = clean()
        click.echo(f"removed {len(removed)} namespace(s) and CPU quota(s): {' '.join(removed) or '-'}")
        return
    for name in models:
        if name not in MODEL_SIZES:
            raise BadInput(f"--model {name!r} is unknown; use one of: {', '.join(MODEL_SIZES)}")
    for name in compressions:
        if name not in COMPRESSION_CHOICES:
            raise BadInput(f"--compression {name!r} is unknown; use one of: {', '.join(COMPRESSION_CHOICES)}")
    schedules = [_streaming_schedule(text) for text in streaming]
    if replay_rate is not None and not attacks:
        raise BadInput("--replay-rate goes with --convergence N --attack A: it is the replay check among the attack "
                       "suite's replicas")
    if scale_peers:
        from p2ptrain.bench.scale import run_scale
        from p2ptrain.observe import MissingExtra, require

        try:  # the workers' --metrics-port and the plot: say what is missing before 4-32 workers start
            require("prometheus_client", extra="metrics", feature="bench --scale")
            require("matplotlib", extra="bench", feature="bench --scale")
        except MissingExtra as e:
            raise BadInput(str(e)) from None
        try:
            report = run_scale(list(scale_peers), out=Path(out), local_steps=scale_local_steps,
                               outer_steps=outer_steps, timeout_s=scale_timeout, group_size=scale_group_size,
                               echo=click.echo)
        except KeyboardInterrupt:
            click.echo(f"interrupted: the daemons are stopped; figures so far in {out}/scale.md", err=True)
            sys.exit(130)
        click.echo(f"report: {Path(out) / 'scale.md'} (and scale.json, scale.png)")
        failed = [f"N={r['peers']} ({r['status']})" for r in report["results"] if r["status"] != "ok"]
        if failed:
            click.echo(f"Error: {', '.join(failed)} did not finish; see the problems in {out}/scale.md", err=True)
            sys.exit(1)
        return
    if soak_workers:
        from p2ptrain.bench.soak import run_soak

        report = run_soak(list(soak_workers), soak_runs, Path(out), outer_steps=soak_outer_steps,
                          local_steps=soak_local_steps, timeout_s=scale_timeout, echo=click.echo)
        click.echo(f"report: {Path(out) / 'soak.json'}")
        if any(t["runs_ok"] != t["runs"] for t in report.get("totals", {}).values()):
            click.echo(f"Error: some soak runs did not finish; see the problems in {out}/soak.json", err=True)
            sys.exit(1)
        return
    if crowd_newcomers:
        from p2ptrain.bench.crowd import CrowdConfig, run_crowd

        result = run_crowd(CrowdConfig(trainers=crowd_trainers, newcomers=crowd_newcomers,
                                       local_steps=scale_local_steps, timeout_s=scale_timeout), Path(out),
                           echo=click.echo)
        click.echo(f"report: {Path(out) / 'crowd.md'} (and crowd.json)")
        if result["status"] != "ok":
            click.echo(f"Error: the crowd run {result['status']}: {'; '.join(result['problems'])}", err=True)
            sys.exit(130 if result["status"] == "interrupted" else 1)
        return
    if convergence_steps:
        from p2ptrain.bench.convergence import Setup, write_convergence

        if SPARSE in compressions:
            raise BadInput("--compression sparse: the convergence experiment's sparse rows come from --sparse-k K "
                           "(e.g. --sparse-k 128); --compression there names the butterfly's codecs")
        setup = Setup(model=models[0], peers=peers, batch_size=batch_size)
        if straggler_misses:
            from p2ptrain.bench.convergence_straggler import run_stragglers

            report = run_stragglers(Setup(**{**setup.__dict__, "steps": convergence_steps[0]}),
                                    (list(local_steps) or [20])[0], straggler_misses, range(seeds), Path(out),
                                    echo=click.echo)
            click.echo(f"report: {report}")
            return
        if attacks:
            from dataclasses import replace

            if attackers >= peers:
                raise BadInput(f"--attackers {attackers} of --peers {peers}: leave at least one honest replica")

            from p2ptrain.bench.convergence_robust import run_robust

            report = run_robust(replace(setup, steps=convergence_steps[0]), (list(local_steps) or [15])[0],
                                list(dict.fromkeys(aggregations)), list(dict.fromkeys(attacks)), Path(out),
                                echo=click.echo, attackers=attackers, replay_rate=replay_rate)
            click.echo(f"report: {report}")
            return
        report = write_convergence(list(convergence_steps), list(local_steps) or [25, 50], list(compressions), setup,
                                   Path(out), echo=click.echo, streaming=schedules,
                                   mixing=list(dict.fromkeys(mixing_group_sizes)), swarm=not no_swarm,
                                   sparse=list(dict.fromkeys(sparse_ks)))
        click.echo(f"report: {report}")
        return
    if mixing_group_sizes or no_swarm or sparse_ks or attacks or straggler_misses:
        raise BadInput("--mixing-group-size, --sparse-k, --attack, --straggler-misses and --no-swarm go with "
                       "--convergence")
    if peers > 8:
        raise BadInput(f"--peers {peers}: at most 8 hosts (more only with --convergence)")
    if not local_steps and not phases:
        phases = (60.0,)
    if cpu_per_peer:
        from p2ptrain.bench.cpu import CpuQuota, CpuQuotaUnavailable

        try:  # a first quota now: without root or a cpu controller, say so before any run starts
            CpuQuota(f"p2ptrain-bench-probe-{os.getpid()}", cpu_per_peer).close()
        except CpuQuotaUnavailable as e:
            raise BadInput(f"--cpu-per-peer: {e}") from None
    try:
        report = run_bench(models=models, peers=peers, rates_mbit=rates, local_steps=local_steps, phases_s=phases,
                           outer_steps=outer_steps, compressions=compressions, batch_size=batch_size, out=Path(out),
                           loopback=loopback, behind_nat=behind_nat, groupings=groupings, streaming=schedules,
                           throttles=throttles, cpu_per_peer=cpu_per_peer, solo=solo, echo=click.echo)
    except KeyboardInterrupt:
        click.echo(f"interrupted: the namespaces are removed; figures so far in {out}/report.md", err=True)
        sys.exit(130)
    except BenchFailed as e:
        click.echo(f"Error: {e}; figures of the finished configurations in {out}/report.md", err=True)
        sys.exit(1)
    click.echo(f"report: {report}")
