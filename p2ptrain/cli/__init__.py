"""The ``p2ptrain`` command: parse, load config, hand off to a daemon; exit codes.

This package is the only code that reads environment variables (``P2PTRAIN_*``, through click) and configures
logging: options.py builds the options of the run settings from config.py, logs.py the handlers, processes.py the
signal handlers and torchrun's ranks, status.py the ``status`` table.
Exit codes: 0 done, 2 bad input (flag, config, file, address, unreachable swarm), 130 forced stop.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from typing import List, Optional

import click

from p2ptrain import __version__
# light on purpose (no torch, no hivemind): every import at this level runs before --help can print
from p2ptrain.cli.logs import LOG_FORMATS, _TqdmHandler, setup_hivemind_logging, setup_logging  # noqa: F401 (tests)
from p2ptrain.cli.options import (EXIT_BAD_INPUT, HEALTH_FILE_OPTION, RUN_OPTIONS, BadInput, draw_bars,  # noqa: F401
                                  load_run_config, run_options)
from p2ptrain.cli.processes import EXIT_FORCED, install_stop_handlers, run_ranks
from p2ptrain.cli.observe import check_observe_input, dashboard, dashboard_options
from p2ptrain.cli.plot import plot
from p2ptrain.cli.status import fetch_status, print_status
from p2ptrain.config import HUB_ID_PATTERN, multi_rank_problem

logger = logging.getLogger("p2ptrain.cli")


# ------------------------------------------------------------------------------------------------ commands


@click.group(context_settings=dict(show_default=True, max_content_width=110))
@click.version_option(__version__, prog_name="p2ptrain")
@click.option("-v", "--verbose", is_flag=True, envvar="P2PTRAIN_VERBOSE", help="Debug logging, hivemind's too.")
@click.option("--log-format", type=click.Choice(LOG_FORMATS), default="human", envvar="P2PTRAIN_LOG_FORMAT",
              show_envvar=True, help="human: one line per event; json: one JSON object per line (for log shippers). "
                                     "Give it before the command: p2ptrain --log-format json join ...")
@click.pass_context
def cli(ctx: click.Context, verbose: bool, log_format: str) -> None:
    """Decentralized low-communication training: DiLoCo over a hivemind DHT."""
    setup_logging(verbose, log_format)


@cli.command()
@run_options(only={"run_id", "swarm.initial_peers", "swarm.initial_peers_file", "swarm.host_maddrs",
                   "swarm.announce_maddrs", "swarm.identity_path", "swarm.use_relay", "swarm.bootstrap_timeout_s",
                   "swarm.swarm_key_file", "observe.metrics_port", "observe.metrics_host"})
@click.option("--maddrs-file", type=click.Path(dir_okay=False, writable=True), envvar="P2PTRAIN_MADDRS_FILE",
              show_envvar=True, help="Also write the visible multiaddrs to this file, one per line.")
@click.option("--config", "config_path", type=click.Path(), envvar="P2PTRAIN_CONFIG", show_envvar=True,
              help="TOML config file (its [swarm] and [observe] tables are used).")
@HEALTH_FILE_OPTION
@dashboard_options(prefix="dashboard-")
@click.pass_context
def bootstrap(ctx: click.Context, maddrs_file: Optional[str], config_path: Optional[str], health_file: Optional[str],
              dashboard_port: Optional[int], dashboard_host: str, **params) -> None:
    """Run a DHT-only bootstrap peer (no model) until SIGINT/SIGTERM. With --metrics-port it exports the swarm of
    --run-id (peers by mode, outer step) to Prometheus; with --dashboard-port it serves the swarm's dashboard."""
    config = load_run_config(ctx, config_path, params)  # first: a bad flag is reported before the heavy imports
    check_observe_input(config.observe, dashboard_port=dashboard_port)
    from p2ptrain.config import expand_hostname
    from p2ptrain.observe import PortUnavailable
    from p2ptrain.peer import run_bootstrap
    from p2ptrain.swarm.dht import SwarmError

    setup_hivemind_logging()
    stop = threading.Event()
    install_stop_handlers(stop.set)
    try:
        run_bootstrap(config.swarm, maddrs_file=maddrs_file, stop=stop,
                      health_file=expand_hostname(health_file), run_id=config.run_id, observe=config.observe,
                      dashboard=(dashboard_host, dashboard_port) if dashboard_port is not None else None)
    except (SwarmError, PortUnavailable) as e:
        raise BadInput(str(e)) from None


@cli.command()
@run_options()
@click.option("--config", "config_path", type=click.Path(), envvar="P2PTRAIN_CONFIG", show_envvar=True,
              help="TOML config file; flags and P2PTRAIN_* variables override it.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), envvar="P2PTRAIN_REPORT",
              show_envvar=True, help="Write a JSON report (losses, every sync) here after every sync and at exit.")
@click.option("--progress/--no-progress", default=None, show_default=False,
              help="Draw a progress bar. Default: only when stderr is a terminal; in a log file (systemd, docker, "
                   "> file) the periodic log lines (--log-interval) show progress instead.")
@click.option("--resume", is_flag=True, help="Continue from the checkpoint in --checkpoint-dir.")
@HEALTH_FILE_OPTION
@click.option("--nproc-per-node", type=click.IntRange(min=1), default=1, show_default=True,
              help="Local ranks (GPUs) of this peer: the model is sharded over them with FSDP2 (via torchrun).")
@click.pass_context
def join(ctx: click.Context, config_path: Optional[str], report_path: Optional[str], progress: Optional[bool],
         resume: bool,
         health_file: Optional[str], nproc_per_node: int, **params) -> None:
    """Join a run as a training peer."""
    config = load_run_config(ctx, config_path, params)  # first: a bad flag is reported before the heavy imports
    check_observe_input(config.observe)
    if nproc_per_node > 1 and "LOCAL_RANK" not in os.environ and multi_rank_problem(config.train, nproc_per_node):
        raise BadInput(multi_rank_problem(config.train, nproc_per_node))  # a config check: no torch needed
    for path in config.train.data:  # data.py says the same, after the heavy imports (5 s later)
        if not os.path.exists(path) and not HUB_ID_PATTERN.match(path):
            raise BadInput(f"--data {path}: no such file or folder; point --data at .txt, .jsonl, .parquet or .arrow "
                           "files, folders of them, or a Hugging Face dataset (owner/name)")
    from p2ptrain.checkpoint import CheckpointError
    from p2ptrain.config import ConfigError, expand_hostname
    from p2ptrain.observe import MissingExtra, PortUnavailable
    from p2ptrain.observe.loggers import LogToError
    from p2ptrain.data import DataError
    from p2ptrain.peer import Worker
    from p2ptrain.swarm.dht import SwarmError
    from p2ptrain.swarm.progress import RunMismatch

    setup_hivemind_logging()
    if nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        from p2ptrain.hsdp import gpu_count_problem

        problem = gpu_count_problem(config.train, nproc_per_node)
        if problem:
            raise BadInput(problem)
        run_ranks(nproc_per_node)  # does not return: torchrun starts the ranks, each runs this command
    if not config.swarm.initial_peers and not config.swarm.initial_peers_file:
        logger.warning("no --initial-peers: starting a new swarm; others can join through the addresses below")
    worker = Worker(config, report_path=expand_hostname(report_path), show_progress=draw_bars(progress, sys.stderr),
                    resume=resume,
                    health_file=expand_hostname(health_file))
    install_stop_handlers(worker.request_stop)
    try:
        report = worker.run()
    except (CheckpointError, ConfigError, DataError, RunMismatch, SwarmError, PortUnavailable, MissingExtra,
            LogToError) as e:
        raise BadInput(str(e)) from None
    global _SKIP_FINALIZATION
    _SKIP_FINALIZATION = True  # a worker that trained ends like a rank: see main
    losses = (f"eval loss {report.initial_eval_loss:.4f} -> {report.final_eval_loss:.4f}" if report.rounds
              else f"eval loss {report.initial_eval_loss:.4f}, no round committed")
    logger.info(
        f"[{report.peer_id}] left after {report.outer_steps} outer steps ({report.stopped_by or 'data exhausted'}); "
        + losses
    )


@cli.command()
@run_options(only={"run_id", "swarm.initial_peers", "swarm.initial_peers_file", "swarm.bootstrap_timeout_s",
                   "swarm.swarm_key_file"})
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.pass_context
def status(ctx: click.Context, as_json: bool, **params) -> None:
    """List the peers of a run with their progress, then exit."""
    config = load_run_config(ctx, None, params)
    if not config.swarm.initial_peers and not config.swarm.initial_peers_file:
        raise BadInput("status needs --initial-peers (or --initial-peers-file): the multiaddr of any live peer of "
                       "the run")
    setup_hivemind_logging()
    found = fetch_status(config)
    if as_json:
        click.echo(json.dumps(found))
    else:
        print_status(found)


cli.add_command(dashboard)
cli.add_command(plot)


@cli.command()
@click.argument("path", type=click.Path(dir_okay=False))
def keygen(path: str) -> None:
    """Write a new swarm key to PATH (mode 0600). Give the same file to every peer of a private swarm with
    --swarm-key; peers without it cannot join groups, write records or download the model."""
    from p2ptrain.security import KeyFileError, generate_swarm_key

    try:
        generate_swarm_key(path)
    except KeyFileError as e:
        raise BadInput(str(e)) from None
    click.echo(f"wrote a new swarm key to {path}; copy it (mode 0600) to every peer and pass --swarm-key {path}")


@cli.command()
@click.option("--file", "health_file", type=click.Path(dir_okay=False), envvar="P2PTRAIN_HEALTH_FILE",
              show_envvar=True, required=True, help="The daemon's --health-file.")
@click.option("--max-age", type=click.FloatRange(min=1), default=30.0, show_default=True,
              help="Seconds since the daemon last wrote the file, beyond which it counts as gone or hung.")
def health(health_file: str, max_age: float) -> None:
    """Exit 0 if the daemon writing --health-file is alive and fit to serve, else print why and exit 1 (for
    Docker's HEALTHCHECK and other supervisors; no network, no DHT)."""
    from p2ptrain.config import expand_hostname
    from p2ptrain.health import check_health

    problem = check_health(expand_hostname(health_file), max_age)
    if problem:
        click.echo(f"unhealthy: {problem}", err=True)
        sys.exit(1)
    click.echo("healthy")


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


@cli.command()
@click.option("--model", "models", multiple=True, default=["small"], show_default=True,
              help="Built-in model size (repeatable).")
@click.option("--peers", type=click.IntRange(min=2, max=8), default=3, show_default=True,
              help="Training peers, each a host of its own.")
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
@click.option("--scale", "scale_peers", type=click.IntRange(min=2), multiple=True,
              help="Instead: N tiny-model workers started at once on loopback (repeatable: --scale 4 --scale 8): "
                   "round time split, bytes, groups, lookups, peers seen, CPU and memory per peer, final models; "
                   "--outer-steps syncs each. Writes scale.json, scale.md, scale.png in --out.")
@click.option("--scale-local-steps", type=click.IntRange(min=1), default=10, show_default=True,
              help="--scale: inner steps between syncs.")
@click.option("--scale-timeout", type=click.FloatRange(min=10), default=600.0, show_default=True,
              help="--scale: seconds one N may take, start-up included; then every daemon is stopped and the N "
                   "counts as failed.")
@click.option("--crowd", "crowd_newcomers", type=click.IntRange(min=1), default=None,
              help="Instead: M newcomers join at once while --crowd-trainers train (tiny model, loopback), after "
                   "one newcomer alone: their waits, the donors' shares, the trainers' rounds. Writes crowd.md, "
                   "crowd.json in --out.")
@click.option("--crowd-trainers", type=click.IntRange(min=1), default=8, show_default=True,
              help="--crowd: workers training when the newcomers come.")
def bench(models, peers, rates, local_steps, phases, outer_steps, compressions, batch_size, out, behind_nat, groupings,
          streaming, throttles, cpu_per_peer, solo, loopback, clean_only, convergence_steps, scale_peers,
          scale_local_steps, scale_timeout, crowd_newcomers, crowd_trainers) -> None:
    """Benchmark real swarms over rate-limited links (one network namespace per peer; root needed, else
    loopback): compute utilization, bytes on the wire, sync seconds against the bandwidth bound, eval loss."""
    from pathlib import Path

    from p2ptrain.averaging.compression import COMPRESSIONS
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
        if name not in COMPRESSIONS:
            raise BadInput(f"--compression {name!r} is unknown; use one of: {', '.join(COMPRESSIONS)}")
    schedules = [_streaming_schedule(text) for text in streaming]
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
                               outer_steps=outer_steps, timeout_s=scale_timeout, echo=click.echo)
        except KeyboardInterrupt:
            click.echo(f"interrupted: the daemons are stopped; figures so far in {out}/scale.md", err=True)
            sys.exit(130)
        click.echo(f"report: {Path(out) / 'scale.md'} (and scale.json, scale.png)")
        failed = [f"N={r['peers']} ({r['status']})" for r in report["results"] if r["status"] != "ok"]
        if failed:
            click.echo(f"Error: {', '.join(failed)} did not finish; see the problems in {out}/scale.md", err=True)
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

        setup = Setup(model=models[0], peers=peers, batch_size=batch_size)
        report = write_convergence(list(convergence_steps), list(local_steps) or [25, 50], list(compressions), setup,
                                   Path(out), echo=click.echo, streaming=schedules)
        click.echo(f"report: {report}")
        return
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


@cli.command()
@click.option("--workers", type=click.IntRange(min=1, max=16), default=2, help="Training peers to start.")
@click.option("--outer-steps", type=click.IntRange(min=1), default=5,
              help="The outer step the run ends at (every worker leaves there; a round each step).")
@click.option("--local-steps", type=click.IntRange(min=1), default=20, help="Inner steps between syncs.")
@click.option("--model", default="tiny", help="Built-in model size.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="Write the per-worker table as JSON.")
@click.option("--keep-logs", is_flag=True, help="Keep the workers' log folder even when all went well.")
@click.option("--progress/--no-progress", default=None, show_default=False,
              help="Draw a progress bar of the swarm. Default: only when stdout is a terminal; else a line every few "
                   "seconds.")
def demo(workers: int, outer_steps: int, local_steps: int, model: str, json_path: Optional[str],
         keep_logs: bool, progress: Optional[bool]) -> None:
    """Train the built-in model with a bootstrap peer and N workers on 127.0.0.1."""
    from p2ptrain.daemons import DaemonError
    from p2ptrain.demo import run_demo

    stop = threading.Event()
    install_stop_handlers(stop.set)
    try:
        run_demo(workers=workers, outer_steps=outer_steps, local_steps=local_steps, model=model,
                 json_path=json_path, keep_logs=keep_logs, stop=stop, show_progress=draw_bars(progress, sys.stdout))
    except DaemonError as e:
        click.echo(f"Error: {e}", err=True)
        sys.exit(1)


@cli.command()
@click.argument("checkpoint", type=click.Path(exists=True, dir_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
def export(checkpoint: str, out_dir: str) -> None:
    """Write the swarm's model in CHECKPOINT (a 1-rank peer's <run-id>.pt) to OUT_DIR as safetensors: for a Hugging
    Face model a folder that AutoModelForCausalLM.from_pretrained loads, its tokenizer beside it."""
    from p2ptrain.checkpoint import CheckpointError
    from p2ptrain.config import ConfigError
    from p2ptrain.data import DataError
    from p2ptrain.export import export_checkpoint

    try:
        out = export_checkpoint(checkpoint, out_dir)
    except (CheckpointError, ConfigError, DataError) as e:
        raise BadInput(str(e)) from None
    click.echo(f"exported {checkpoint} to {out}")


@cli.command()
@click.argument("source", type=click.Path(exists=True))
@click.option("--prompt", default="", help="The text to continue.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=100, help="Tokens to sample.")
@click.option("--temperature", type=click.FloatRange(min=0), default=0.8, help="Sampling temperature; 0: greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=50, help="Sample among the k likeliest tokens; 0: all.")
@click.option("--seed", type=int, default=0, help="Sampling seed.")
def generate(source: str, prompt: str, max_new_tokens: int, temperature: float, top_k: int, seed: int) -> None:
    """Sample text from SOURCE: a checkpoint file or a folder written by export."""
    from p2ptrain.checkpoint import CheckpointError
    from p2ptrain.config import ConfigError
    from p2ptrain.data import DataError
    from p2ptrain.export import generate as sample, load_for_generation

    try:
        loaded = load_for_generation(source)
    except (CheckpointError, ConfigError, DataError) as e:
        raise BadInput(str(e)) from None
    text = sample(loaded, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k or None,
                  seed=seed)
    click.echo(prompt + text)


REMOVED_FLAGS = {
    "--client-mode": "use --reachability client, or leave the default (auto: the peer asks an initial peer to dial "
                     "it back and picks client mode behind NAT)",
    "--no-client-mode": "use --reachability public, or leave the default (auto)",
}
"""flags of earlier versions, each with what to use instead"""


def main(argv: Optional[List[str]] = None) -> None:
    """Entry point: click's errors and ours become one line on stderr with exit code 2."""
    try:
        code = cli.main(args=argv, prog_name="p2ptrain", standalone_mode=False)
        code = code if isinstance(code, int) else 0
    except click.exceptions.Abort:
        code = EXIT_FORCED
    except click.UsageError as e:
        command = e.ctx.command_path if e.ctx else "p2ptrain"
        message = e.format_message()
        for flag, hint in REMOVED_FLAGS.items():
            if f"No such option '{flag}'" in message:
                message = f"{flag} was removed: {hint}"
        click.echo(f"Error: {message} (see '{command} --help')", err=True)
        code = EXIT_BAD_INPUT
    except click.ClickException as e:
        click.echo(f"Error: {e.format_message()}", err=True)
        code = e.exit_code
    except SystemExit as e:
        if not _in_rank_process():
            raise
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except Exception:
        if not _in_rank_process():
            raise
        logger.exception("this rank failed")
        code = 1
    if _in_rank_process() or _SKIP_FINALIZATION:
        from p2ptrain.hsdp import exit_rank

        # a rank of a multi-rank peer, or a worker of one rank that trained: see exit_rank for why it skips
        # interpreter finalization (a 1-rank worker of the 25M model on 2 loaded cores aborted there too, 1 of 4)
        exit_rank(code)
    sys.exit(code)


_SKIP_FINALIZATION = False


def _in_rank_process() -> bool:
    hsdp = sys.modules.get("p2ptrain.hsdp")  # not imported by the commands that start no ranks
    return hsdp is not None and hsdp.ranks_started()


if __name__ == "__main__":
    main()
