"""`p2ptrain bench`: run swarm configurations over rate-limited links and write the report."""

from __future__ import annotations

import contextlib
import itertools
import os
import platform
import signal
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import torch

from p2ptrain.bench.cpu import leftover_cgroups, remove_cgroup
from p2ptrain.bench.netns import NetnsUnavailable, Topology, leftover_namespaces, nat_problem, netns_problem
from p2ptrain.bench.report import write_report
from p2ptrain.bench.swarm import BenchConfig, run_config, with_solo_baseline


def calibrate_local_steps(model: str, batch_size: int, phase_s: float, steps: int = 4) -> int:
    """H that makes an inner phase last about ``phase_s`` on one core of this machine, from a few timed steps."""
    from p2ptrain.data import ShardedBatches, load_corpus, split_train_val
    from p2ptrain.model import build_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        net = build_model(model)
        opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
        train, _ = split_train_val(load_corpus(None))
        batches = ShardedBatches(train, block_size=net.config.block_size, batch_size=batch_size, shard_index=0,
                                 num_shards=1)
        timings = []
        for _ in range(steps + 1):
            x, y = next(batches)
            started = time.perf_counter()
            net(x, y)[1].backward()
            opt.step()
            opt.zero_grad()
            timings.append(time.perf_counter() - started)
        step_s = sorted(timings[1:])[len(timings[1:]) // 2]  # the median, without the first (warm-up) step
    finally:
        torch.set_num_threads(threads)
    return max(1, round(phase_s / step_s))


def run_bench(*, models: Sequence[str], peers: int, rates_mbit: Sequence[Optional[float]],
              local_steps: Sequence[int], phases_s: Sequence[float], outer_steps: int,
              compressions: Sequence[str], batch_size: int, out: Path, loopback: bool,
              behind_nat: Sequence[int] = (0,), groupings: Sequence[str] = ("pinned",),
              streaming: Sequence[tuple] = ((1, 0),), throttles: Sequence[float] = (1.0,),
              cpu_per_peer: Optional[float] = None, solo: bool = False,
              echo: Callable[[str], None] = print) -> Path:
    """Run every combination and write ``out/report.md`` (+ .json, plots); returns the report's path."""
    problem = "--loopback given" if loopback else (nat_problem() if any(behind_nat) else netns_problem())
    if problem:
        echo(f"no network namespaces ({problem}): running on loopback with no rate limit, bytes from the peers' "
             "own counts" + (", and no NAT" if any(behind_nat) else ""))
        rates_mbit, behind_nat = [None], [0]
    configs: List[BenchConfig] = []
    for model in models:
        steps = list(local_steps)
        # more workers than cores share them: a step then takes peers/cores times longer than alone on a core
        share = max(1.0, peers / (os.cpu_count() or 1))
        for phase in phases_s:
            # a step of the 124m model on one CPU core takes tens of seconds: say what the wait is for
            echo(f"{model}: timing 5 inner steps on one core to pick H (--local-steps N skips this)")
            h = calibrate_local_steps(model, batch_size, phase / share)
            echo(f"{model}: H={h} makes an inner phase of about {phase:.0f}s with {peers} workers on "
                 f"{os.cpu_count()} cores")
            steps.append(h)
        for h, rate, compression, nat, grouping, (fragments, overlap), throttle in itertools.product(
                steps, rates_mbit, compressions, behind_nat, groupings, streaming, throttles):
            fragments = min(fragments, h)
            overlap = h // fragments - 1 if overlap is None else overlap  # None: the most the schedule allows
            configs.append(BenchConfig(model=model, peers=peers, rate_mbit=rate, local_steps=h,
                                       outer_steps=outer_steps, compression=compression, batch_size=batch_size,
                                       behind_nat=nat, grouping=grouping, fragments=fragments,
                                       overlap_steps=overlap, throttle=throttle, cpu_per_peer=cpu_per_peer))
    results = []
    # Ctrl-C and SIGTERM both end the run cleanly (daemons stopped, namespaces removed), even when started from a
    # shell that had SIGINT ignored (as background jobs of a non-interactive shell are)
    previous = {sig: signal.signal(sig, _raise_interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    if solo:  # each configuration's peers first train apart on the same hardware: their solo throughput, measured
        # over 2 phases after the first (a slower peer takes all H steps there: its phases are the longest)
        configs = [c for cfg in configs for c in (replace(cfg, apart=True, outer_steps=min(cfg.outer_steps, 3)), cfg)]
    apart = None
    try:
        for i, cfg in enumerate(configs, 1):
            echo(f"[{i}/{len(configs)}] {cfg.name}")
            topology = None if problem else Topology(hosts=peers + 1, rate_mbit=cfg.rate_mbit, nat=cfg.nat_hosts)
            try:
                result = run_config(cfg, out / cfg.name, topology, progress=echo)
            finally:
                if topology is not None:
                    topology.close()
            _plot_workers(out / cfg.name, cfg.peers, echo)
            if cfg.apart:
                apart = result
                echo(f"  apart: {sum(p['throughput'] or 0 for p in result['peers']):.2f} samples/s in all")
                continue
            results.append(with_solo_baseline(result, apart) if apart else result)
            r = results[-1]
            echo(f"  utilization {_pct(r['compute_utilization'])}, sync {_num(r['sync_s'])}s "
                 f"(bound {_num(r['bandwidth_bound_s'])}s), bytes x{_num(r['bytes_vs_butterfly'])} butterfly, "
                 f"eval loss {_num(r['final_eval_loss'], '.4f')}, rounds by group size {r['group_sizes']}, "
                 f"{r['caught_up_rounds']} caught up, samples/s {_pct(r['throughput_vs_solo'])} of solo"
                 + (f", {r['relayed_peers']} peer(s) relayed, {r['client_mode_peers']} in client mode, "
                    f"{r['relayed_connections']} relayed connection(s), {_pct(r['relayed_share'])} of the bytes "
                    "through the bootstrap" if cfg.behind_nat else ""))
            write_report(results, out, _environment(problem))  # after each: an interrupted run keeps its figures
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return out / "report.md"


def _plot_workers(folder: Path, peers: int, echo: Callable[[str], None]) -> None:
    """One configuration's per-worker plots (observe/plot.py: loss by step and time, each sync's split, bytes per
    round) from its workers' reports, in ``folder/plots``; report.md's plots compare the configurations instead.
    A plot that cannot be made costs only its line: the figures are in report.json either way."""
    from p2ptrain.observe import MissingExtra
    from p2ptrain.observe.plot import ReportError, load_reports, plot_reports

    try:
        written = plot_reports(load_reports([folder / f"w{i}.json" for i in range(1, peers + 1)]), folder / "plots")
    except (MissingExtra, ReportError, OSError) as e:
        echo(f"  no per-worker plots: {e}")
        return
    echo(f"  plots: {folder / 'plots'} ({', '.join(path.name for path in written)})")


def clean() -> List[str]:
    """Remove the namespaces a killed benchmark left behind; returns their names."""
    names = leftover_namespaces()
    for name in names:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    for path in leftover_cgroups():  # a killed run's CPU quotas (--cpu-per-peer), and what still runs in them
        for pid in path.joinpath("cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        remove_cgroup(path, timeout_s=5.0)
        names.append(path.name)
    return names


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _pct(x: Optional[float]) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def _num(x: Optional[float], spec: str = ".2f") -> str:
    return "n/a" if x is None else f"{x:{spec}}"


def _environment(problem: str) -> dict:
    return {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}",
        "network": "loopback, no limit" if problem else "one network namespace per peer, tbf-limited veth links",
    }


__all__ = ["run_bench", "clean", "calibrate_local_steps", "NetnsUnavailable"]
