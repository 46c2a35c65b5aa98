"""The ``p2ptrain`` command: parse, load config, hand off to a daemon; exit codes; signals.

This is the only module that reads environment variables (``P2PTRAIN_*``, through click) and configures logging.
Exit codes: 0 done, 2 bad input (flag, config, file, address, unreachable swarm), 130 forced stop.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import click

from p2ptrain import __version__
# light on purpose (no torch, no hivemind): every import at this level runs before --help can print
from p2ptrain.config import Setting, settings

logger = logging.getLogger("p2ptrain.cli")

EXIT_BAD_INPUT = 2
EXIT_FORCED = 130


class BadInput(click.ClickException):
    """A user mistake: printed as one line, exit code 2."""

    exit_code = EXIT_BAD_INPUT


class _TqdmHandler(logging.Handler):
    """Writes log lines around a running progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            # the line and its newline in one write: tqdm.write makes two, and a forked hivemind process writing to
            # the same stderr between them glued its line to ours ("...is closedError: could not join", in CI)
            tqdm.write(self.format(record) + "\n", file=sys.stderr, end="")
        except Exception:
            self.handleError(record)


class _OneLineFromLibraries(logging.Filter):
    """Without -v, a record of hivemind (its host, DHT and averager processes, p2pd's output it relays) or asyncio
    is one line: the exception's type and last line in place of the traceback, and an ERROR becomes a warning.
    p2ptrain handles every failure these report (a round without a group, a peer that vanished mid-round, a stream
    that broke) and logs what it did about it; -v shows them in full."""

    LIBRARIES = ("hivemind", "asyncio")

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self.LIBRARIES):
            return True
        message = record.getMessage()
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            lines = str(error).strip().splitlines()
            summary = f"{type(error).__name__}: {lines[-1]}" if lines else type(error).__name__
            message = message if lines and lines[-1] in message else f"{message} ({summary})"
        record.msg, record.args = " | ".join(line for line in message.splitlines() if line.strip()), None
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        if record.levelno >= logging.ERROR:
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


_HANDLER: Optional[logging.Handler] = None
_VERBOSE = False


def setup_logging(verbose: bool) -> None:
    global _HANDLER, _VERBOSE
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    if not verbose:
        handler.addFilter(_OneLineFromLibraries())
    _HANDLER, _VERBOSE = handler, verbose
    root = logging.getLogger("p2ptrain")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False
    # asyncio reports a task nobody awaited (in hivemind's processes too) through the root logger's last resort,
    # traceback and all: through our handler instead, one line without -v
    asyncio_logger = logging.getLogger("asyncio")
    asyncio_logger.handlers[:] = [handler]
    asyncio_logger.propagate = False
    if not verbose:
        logging.getLogger("hivemind").setLevel(logging.WARNING)
        # hivemind logs every round without a group as an ERROR with a traceback; DiLoCoOptimizer reports the
        # outcome of every round itself (a warning naming the policy), so only -v shows hivemind's version
        logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)


def setup_hivemind_logging() -> None:
    """Send hivemind's log records through our handler (one format, one line each without -v). Call after hivemind
    is imported (the commands that use it import it late, to keep --help fast): importing it installs its own
    handler and level, which this replaces. Processes forked later (the DHT, the averager) inherit the setting."""
    from hivemind.utils.logging import use_hivemind_log_handler

    if _HANDLER is None:
        return
    use_hivemind_log_handler("nowhere")  # removes hivemind's handler
    hivemind_logger = logging.getLogger("hivemind")
    hivemind_logger.handlers[:] = [_HANDLER]
    hivemind_logger.propagate = False
    hivemind_logger.setLevel(logging.DEBUG if _VERBOSE else logging.WARNING)


def install_stop_handlers(on_first: Callable[[], None]) -> None:
    """First SIGINT/SIGTERM: ``on_first`` (graceful stop). Second: kill our process tree and exit 130."""
    main_pid = os.getpid()
    received = []

    def handler(signum, _frame):
        if os.getpid() != main_pid:
            # a forked hivemind child inherited this handler: behave as the default would (terminate)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        received.append(signum)
        name = signal.Signals(signum).name
        if len(received) == 1:
            logger.warning(f"{name}: finishing the current step and leaving cleanly (send it again to force)")
            on_first()
        else:
            logger.warning(f"{name} again: forcing exit")
            kill_process_tree()
            os._exit(EXIT_FORCED)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def kill_process_tree() -> None:
    """Kill every descendant (hivemind DHT and averager processes, their p2pd) so nothing is orphaned."""
    from p2ptrain.lifeline import stop_descendants

    stop_descendants(grace_s=0)


# --------------------------------------------------------------------------------------- config-backed options


def _option(s: Setting) -> Tuple[str, str, Dict[str, Any]]:
    """(flag, config key, click kwargs) of a setting, all from its declaration in config.py. The option's own default
    is None: a flag or its P2PTRAIN_* variable overrides the config file only when it was actually given; --help
    shows the config field's default."""
    bounds = dict(min=s.above if s.above is not None else s.at_least, max=s.below,
                  min_open=s.above is not None, max_open=s.below is not None)
    if s.choices is not None:
        kind: Any = click.Choice(list(s.choices))
    elif s.file:
        kind = click.Path(dir_okay=False)
    elif bounds["min"] is not None or bounds["max"] is not None:
        kind = (click.IntRange if s.type is int else click.FloatRange)(**bounds)
    else:
        kind = s.type
    shown = ", ".join(map(str, s.default)) if s.many else s.default
    kwargs = dict(help=s.help, default=None, envvar=s.env, show_envvar=True,
                  show_default=str(shown) if shown not in (None, "") else False)
    if s.type is bool:
        return f"{s.flag}/--no-{s.flag[2:]}", s.key, kwargs
    return s.flag, s.key, dict(kwargs, type=kind, multiple=s.many)


RUN_OPTIONS: List[Tuple[str, str, Dict[str, Any]]] = [_option(s) for s in settings()]


def run_options(only: Optional[set] = None) -> Callable:
    """Attach the config-backed options (or the subset whose config key is in ``only``) to a command."""

    def decorate(command: Callable) -> Callable:
        for flag, key, kwargs in reversed(RUN_OPTIONS):
            if only is None or key in only:
                command = click.option(flag, key.replace(".", "__"), **kwargs)(command)
        return command

    return decorate


def overrides_from(ctx: click.Context, params: Dict[str, Any]) -> Dict[str, Any]:
    """The config settings the user actually gave, as flags or P2PTRAIN_* variables."""
    given = (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
    overrides = {}
    for _, dotted, _ in RUN_OPTIONS:
        name = dotted.replace(".", "__")
        if name in params and ctx.get_parameter_source(name) in given:
            value = params[name]
            overrides[dotted] = list(value) if isinstance(value, tuple) else value
    return overrides


def load_run_config(ctx: click.Context, config_path: Optional[str], params: Dict[str, Any]):
    from p2ptrain.config import ConfigError, load_config

    try:
        return load_config(config_path, overrides_from(ctx, params))
    except ConfigError as e:
        raise BadInput(str(e)) from None


def draw_bars(progress: Optional[bool], stream: Any) -> bool:
    """--progress/--no-progress as given, else a bar only on a terminal: in a log file a bar is a carriage-return
    mess (one redraw per step), and the periodic log lines already tell how far training got."""
    if progress is not None:
        return progress
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or replaced by an object without isatty
        return False


HEALTH_FILE_OPTION = click.option(
    "--health-file", type=click.Path(dir_okay=False), envvar="P2PTRAIN_HEALTH_FILE", show_envvar=True,
    help="Rewrite this JSON file every few seconds with what the daemon is doing; `p2ptrain health` checks it.")

# ------------------------------------------------------------------------------------------------ commands


@click.group(context_settings=dict(show_default=True, max_content_width=110))
@click.version_option(__version__, prog_name="p2ptrain")
@click.option("-v", "--verbose", is_flag=True, envvar="P2PTRAIN_VERBOSE", help="Debug logging, hivemind's too.")
@click.pass_context
def cli(ctx: click.Context, verbose: bool) -> None:
    """Decentralized low-communication training: DiLoCo over a hivemind DHT."""
    setup_logging(verbose)


@cli.command()
@run_options(only={"swarm.initial_peers", "swarm.initial_peers_file", "swarm.host_maddrs", "swarm.announce_maddrs",
                   "swarm.identity_path", "swarm.use_relay", "swarm.bootstrap_timeout_s", "swarm.swarm_key_file"})
@click.option("--maddrs-file", type=click.Path(dir_okay=False, writable=True), envvar="P2PTRAIN_MADDRS_FILE",
              show_envvar=True, help="Also write the visible multiaddrs to this file, one per line.")
@click.option("--config", "config_path", type=click.Path(), envvar="P2PTRAIN_CONFIG", show_envvar=True,
              help="TOML config file (its [swarm] table is used).")
@HEALTH_FILE_OPTION
@click.pass_context
def bootstrap(ctx: click.Context, maddrs_file: Optional[str], config_path: Optional[str], health_file: Optional[str],
              **params) -> None:
    """Run a DHT-only bootstrap peer (no model) until SIGINT/SIGTERM."""
    from p2ptrain.config import expand_hostname
    from p2ptrain.peer import run_bootstrap
    from p2ptrain.swarm.dht import SwarmError

    setup_hivemind_logging()

    config = load_run_config(ctx, config_path, params)
    stop = threading.Event()
    install_stop_handlers(stop.set)
    try:
        run_bootstrap(config.swarm, maddrs_file=maddrs_file, stop=stop,
                      health_file=expand_hostname(health_file))
    except SwarmError as e:
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
    from p2ptrain.checkpoint import CheckpointError
    from p2ptrain.config import ConfigError, expand_hostname
    from p2ptrain.data import DataError
    from p2ptrain.peer import Worker
    from p2ptrain.swarm.dht import SwarmError
    from p2ptrain.swarm.progress import RunMismatch

    setup_hivemind_logging()

    config = load_run_config(ctx, config_path, params)
    if nproc_per_node > 1 and "LOCAL_RANK" not in os.environ:
        from p2ptrain.hsdp import gpu_count_problem, multi_rank_problem

        problem = multi_rank_problem(config.train, nproc_per_node) or gpu_count_problem(config.train, nproc_per_node)
        if problem:
            raise BadInput(problem)
        _run_ranks(nproc_per_node)  # does not return: torchrun starts the ranks, each runs this command
    if not config.swarm.initial_peers and not config.swarm.initial_peers_file:
        logger.warning("no --initial-peers: starting a new swarm; others can join through the addresses below")
    worker = Worker(config, report_path=expand_hostname(report_path), show_progress=draw_bars(progress, sys.stderr),
                    resume=resume,
                    health_file=expand_hostname(health_file))
    install_stop_handlers(worker.request_stop)
    try:
        report = worker.run()
    except (CheckpointError, ConfigError, DataError, RunMismatch, SwarmError) as e:
        raise BadInput(str(e)) from None
    global _SKIP_FINALIZATION
    _SKIP_FINALIZATION = True  # a worker that trained ends like a rank: see main
    losses = (f"eval loss {report.initial_eval_loss:.4f} -> {report.final_eval_loss:.4f}" if report.rounds
              else f"eval loss {report.initial_eval_loss:.4f}, no round committed")
    logger.info(
        f"[{report.peer_id}] left after {report.outer_steps} outer steps ({report.stopped_by or 'data exhausted'}); "
        + losses
    )


def _run_ranks(nproc: int) -> None:
    """Run ``torchrun --standalone --nproc-per-node N -m p2ptrain join ...`` with this command's other arguments,
    in this process, and exit with its outcome. torchrun's agent starts the ranks in sessions of their own (so a
    Ctrl-C reaches them once, through it), forwards SIGINT/SIGTERM, and stops them all when one fails."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg == "--nproc-per-node":
            skip = True
        elif not arg.startswith("--nproc-per-node="):
            args.append(arg)
    logger.info(f"starting {nproc} local ranks with torchrun")
    try:
        torchrun(["--standalone", f"--nproc-per-node={nproc}", "-m", "p2ptrain", *args])
    except SignalException as e:
        # the agent passed the signal on and waited for the ranks, which leave as a 1-rank peer does
        logger.info(f"the ranks were stopped by {signal.Signals(e.sigval).name}")
        sys.exit(0)
    except ChildFailedError as e:
        # torchrun already logged each failed rank; one line more, and no traceback of the agent's own
        logger.error(f"a rank of this peer failed: {e.get_first_failure()[1].message or 'see the log above'}")
        sys.exit(1)
    sys.exit(0)


@cli.command()
@run_options(only={"run_id", "swarm.initial_peers", "swarm.initial_peers_file", "swarm.bootstrap_timeout_s",
                   "swarm.swarm_key_file"})
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
@click.pass_context
def status(ctx: click.Context, as_json: bool, **params) -> None:
    """List the peers of a run with their progress, then exit."""
    from p2ptrain.swarm.dht import SwarmError, start_dht, stop_dht
    from p2ptrain.swarm.progress import fetch_progress

    setup_hivemind_logging()

    config = load_run_config(ctx, None, params)
    if not config.swarm.initial_peers and not config.swarm.initial_peers_file:
        raise BadInput("status needs --initial-peers (or --initial-peers-file): the multiaddr of any live peer of "
                       "the run")
    swarm = config.swarm
    swarm.reachability, swarm.host_maddrs = "client", ["/ip4/0.0.0.0/tcp/0"]
    try:
        dht = start_dht(swarm)
    except SwarmError as e:
        raise BadInput(str(e)) from None
    try:
        records = fetch_progress(dht, config.run_id)
        from p2ptrain.swarm.shards import coverage, cursor_progress, fetch_cursors

        cursors = fetch_cursors(dht, config.run_id)
    finally:
        stop_dht(dht)

    peers = [
        dict(peer_id=r.peer_id, outer_step=r.outer_step, local_step=r.local_step,
             samples_per_s=round(r.samples_per_s, 2), last_seen=round(r.timestamp, 3),
             mode="client" if r.client_mode else "public", reachability=r.reachability,
             # what the run agrees on, and each worker's own settings (which may differ between workers)
             model=r.model, num_parameters=r.num_parameters, local_steps=r.local_steps, compression=r.compression,
             data=r.data, batch_size=r.batch_size, threads=r.threads)
        for r in records
    ]
    public = sum(p["mode"] == "public" for p in peers)
    # the data: which shard each worker is on, how far the swarm got through it (passes), and through the corpus;
    # cursors from a later outer step than any live peer's are an earlier run's under this run id
    data_seen = coverage(cursors.values(), max_outer_step=max((r.outer_step for r in records), default=None))
    for p, r in zip(peers, records):
        cursor = cursors.get(r.shard_index) if r.HasField("shard_index") else None
        p["shard"] = r.shard_index if r.HasField("shard_index") else None
        p["shard_passes"] = round(cursor_progress(cursor), 3) if cursor is not None else 0.0
    if as_json:
        click.echo(json.dumps({"run_id": config.run_id, "peers": peers, "public_peers": public,
                               "coverage": data_seen}))
        return
    click.echo(f"run {config.run_id}: {len(peers)} peer(s), {public} public (can lead groups and reduce), "
               f"{len(peers) - public} in client mode (behind NAT)")
    if peers:
        click.echo(f"{'peer_id':<54} {'mode':>6} {'outer':>6} {'local':>8} {'samples/s':>10} {'last seen':>10} "
                   f"{'shard':>6} {'passes':>6}")
        for p in peers:
            age = max(0.0, time.time() - p["last_seen"])
            shard = "-" if p["shard"] is None else p["shard"]
            click.echo(f"{p['peer_id']:<54} {p['mode']:>6} {p['outer_step']:>6} {p['local_step']:>8} "
                       f"{p['samples_per_s']:>10.1f} {age:>8.0f}s ago {shard:>6} {p['shard_passes']:>6.2f}")
        for p in peers:
            if p["reachability"]:
                click.echo(f"  {p['peer_id'][-8:]} {p['reachability']}")
        for p in peers:
            if p["num_parameters"]:
                click.echo(f"  {p['peer_id'][-8:]} model {p['model'] or '(unnamed)'} ({p['num_parameters']:,} "
                           f"parameters), H={p['local_steps']}, {p['compression']}; batch size {p['batch_size']}, "
                           f"{p['threads']} thread(s), data: {p['data'] or '-'}")
    if data_seen:
        click.echo(f"data: {data_seen['fraction_seen']:.1%} of the corpus seen at least once; "
                   f"{data_seen['shards_complete']} of {data_seen['num_shards']} shards complete, "
                   f"{data_seen['passes']} full pass(es) over all of them")
    elif peers:
        click.echo("data: no shard cursor published yet (they come after each committed round)")
    if peers and not public:
        click.echo("no peer can lead a group: every peer is behind NAT; rounds cannot form until a worker with a "
                   "public address (or a forwarded port) joins")


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
@click.option("--loopback", is_flag=True, help="No namespaces or rate limit, even as root.")
@click.option("--clean", "clean_only", is_flag=True, help="Remove namespaces a killed benchmark left, then exit.")
@click.option("--convergence", "convergence_steps", type=click.IntRange(min=1), multiple=True,
              help="Instead: the convergence experiment at this many inner steps (repeatable): alone, data-parallel "
                   "with --peers x the batch, DiLoCo per --local-steps and --compression, and the real swarm.")
def bench(models, peers, rates, local_steps, phases, outer_steps, compressions, batch_size, out, behind_nat, groupings,
          loopback, clean_only, convergence_steps) -> None:
    """Benchmark real swarms over rate-limited links (one network namespace per peer; root needed, else
    loopback): compute utilization, bytes on the wire, sync seconds against the bandwidth bound, eval loss."""
    from pathlib import Path

    from p2ptrain.averaging.compression import COMPRESSIONS
    from p2ptrain.bench.main import clean, run_bench
    from p2ptrain.model import MODEL_SIZES

    if clean_only:
        removed = clean()
        click.echo(f"removed {len(removed)} namespace(s): {' '.join(removed) or '-'}")
        return
    for name in models:
        if name not in MODEL_SIZES:
            raise BadInput(f"--model {name!r} is unknown; use one of: {', '.join(MODEL_SIZES)}")
    for name in compressions:
        if name not in COMPRESSIONS:
            raise BadInput(f"--compression {name!r} is unknown; use one of: {', '.join(COMPRESSIONS)}")
    if convergence_steps:
        from p2ptrain.bench.convergence import Setup, write_convergence

        setup = Setup(model=models[0], peers=peers, batch_size=batch_size)
        report = write_convergence(list(convergence_steps), list(local_steps) or [25, 50], list(compressions), setup,
                                   Path(out), echo=click.echo)
        click.echo(f"report: {report}")
        return
    if not local_steps and not phases:
        phases = (60.0,)
    try:
        report = run_bench(models=models, peers=peers, rates_mbit=rates, local_steps=local_steps, phases_s=phases,
                           outer_steps=outer_steps, compressions=compressions, batch_size=batch_size, out=Path(out),
                           loopback=loopback, behind_nat=behind_nat, groupings=groupings, echo=click.echo)
    except KeyboardInterrupt:
        click.echo(f"interrupted: the namespaces are removed; figures so far in {out}/report.md", err=True)
        sys.exit(130)
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
