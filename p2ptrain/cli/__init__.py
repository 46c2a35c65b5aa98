"""The ``p2ptrain`` command: parse, load config, hand off to a daemon; exit codes.

This package is the only code that reads environment variables (``P2PTRAIN_*``, through click) and configures
logging: options.py builds the options of the run settings from config.py, logs.py the handlers, processes.py the
signal handlers and torchrun's ranks, status.py the ``status`` table.
Exit codes: 0 done, 2 bad input (flag, config, file, address, unreachable swarm), 130 forced stop.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import sys
import threading
from typing import List, NoReturn, Optional

import click

from p2ptrain import __version__
# light on purpose (no torch, no hivemind): every import at this level runs before --help can print
from p2ptrain.cli.logs import LOG_FORMATS, _TqdmHandler, setup_hivemind_logging, setup_logging  # noqa: F401 (tests)
from p2ptrain.cli.options import (EXIT_BAD_INPUT, HEALTH_FILE_OPTION, RUN_OPTIONS, BadInput, draw_bars,  # noqa: F401
                                  load_run_config, run_options)
from p2ptrain.cli.processes import EXIT_FORCED, install_stop_handlers, run_ranks
from p2ptrain.cli.bench import bench
from p2ptrain.cli.observe import check_observe_input, dashboard, dashboard_options
from p2ptrain.cli.plot import plot
from p2ptrain.cli.status import fetch_status, print_status
from p2ptrain.config_checks import is_hub_dataset, multi_rank_problem

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
                   "swarm.swarm_key_file", "swarm.relays", "observe.metrics_port", "observe.metrics_host"})
@click.option("--maddrs-file", type=click.Path(dir_okay=False, writable=True), envvar="P2PTRAIN_MADDRS_FILE",
              show_envvar=True, help="Also write the visible multiaddrs to this file, one per line.")
@click.option("--config", "config_path", type=click.Path(), envvar="P2PTRAIN_CONFIG", show_envvar=True,
              help="TOML config file (its [swarm] and [observe] tables are used).")
@HEALTH_FILE_OPTION
@dashboard_options(prefix="dashboard-")
@click.option("--metrics-refresh", "metrics_refresh_s", type=click.FloatRange(min=0.5), default=10.0,  # SWARM_LOOK_S
              show_default=True, envvar="P2PTRAIN_METRICS_REFRESH", show_envvar=True,
              help="Seconds between the --metrics-port export's reads of the run's progress records.")
@click.pass_context
def bootstrap(ctx: click.Context, maddrs_file: Optional[str], config_path: Optional[str], health_file: Optional[str],
              dashboard_port: Optional[int], dashboard_host: str, metrics_refresh_s: float, **params) -> None:
    """Run a DHT-only bootstrap peer (no model) until SIGINT/SIGTERM. With --metrics-port it exports the swarm of
    --run-id (peers by mode, outer step) to Prometheus; with --dashboard-port it serves the swarm's dashboard."""
    config = load_run_config(ctx, config_path, params)  # first: a bad flag is reported before the heavy imports
    check_observe_input(config.observe, dashboard_port=dashboard_port, dashboard_host=dashboard_host)
    from p2ptrain.config import expand_hostname
    from p2ptrain.observe import PortUnavailable
    from p2ptrain.bootstrap_peer import run_bootstrap
    from p2ptrain.swarm.dht import DHTLost, SwarmError

    setup_hivemind_logging()
    stop = threading.Event()
    install_stop_handlers(stop.set)
    try:
        run_bootstrap(config.swarm, maddrs_file=maddrs_file, stop=stop,
                      health_file=expand_hostname(health_file), run_id=config.run_id, observe=config.observe,
                      dashboard=(dashboard_host, dashboard_port) if dashboard_port is not None else None,
                      swarm_look_s=metrics_refresh_s)
    except (SwarmError, PortUnavailable) as e:
        raise BadInput(str(e)) from None
    except DHTLost:  # said in one line already, as it happened; not the user's input: 1, not 2
        sys.exit(1)


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
        if not os.path.exists(path) and not is_hub_dataset(path):
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
    final = report.final_model
    held = "" if final is None else (
        f" on the model of outer step {final['outer_step']} ("
        + (f"averaged in a group of {final['group_size']}" if final["how"] == "averaged" else final["how"])
        + f", digest {final['digest'][:8]})")
    logger.info(
        f"[{report.peer_id}] left at outer step {report.outer_steps} after {report.syncs} sync(s) of its own "
        f"({report.stopped_by or 'data exhausted'}){held}; " + losses
    )
    if report.stopped_by == "dht_lost":  # DHTWatch said why; a supervisor restarts it
        sys.exit(1)


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


cli.add_command(bench)
cli.add_command(dashboard)
cli.add_command(plot)


@cli.command()
@click.argument("path", type=click.Path(dir_okay=False))
def keygen(path: str) -> None:
    """Write a new swarm key to PATH (mode 0600). Give the same file to every peer of a private swarm with
    --swarm-key; peers without it cannot join groups, write records or download the model."""
    from p2ptrain.keyfiles import KeyFileError, generate_swarm_key

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


def entry_point() -> NoReturn:
    """The ``p2ptrain`` command and ``python -m p2ptrain``: ``main``, then an exit that skips the interpreter's
    finalization, which took 0.5-2.4 s after the work was done (tearing down torch's and hivemind's modules and
    objects: a bad --swarm-key file's error came at 2.7 s and the process ended at 3.7 s). Everything Python's own
    exit does for us still runs, in its order: non-daemon threads are joined, then the atexit callbacks
    (multiprocessing's finalizers and children, logging's flush), then stdio is flushed."""
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    leave(code)


def leave(code: int) -> NoReturn:
    from p2ptrain.lifeline import exit_now

    threading._shutdown()  # what Py_FinalizeEx does first: join non-daemon threads (and executors' at-exit hooks)
    atexit._run_exitfuncs()
    exit_now(code)


def _in_rank_process() -> bool:
    hsdp = sys.modules.get("p2ptrain.hsdp")  # not imported by the commands that start no ranks
    return hsdp is not None and hsdp.ranks_started()


if __name__ == "__main__":
    main()
