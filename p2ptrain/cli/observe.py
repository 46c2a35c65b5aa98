"""The commands' observability input: checks of --metrics-port and --log-to before the heavy imports, and
``p2ptrain dashboard``, the swarm's web page served from any host that can join the DHT."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Optional

import click

from p2ptrain.cli.options import BadInput, load_run_config, run_options

logger = logging.getLogger("p2ptrain.cli")

DASHBOARD_LOG_S = 60.0
"""seconds between the dashboard's 'serving' lines (its progress in a log file)"""


def check_observe_input(observe: Any, dashboard_port: Optional[int] = None,
                        dashboard_host: str = "127.0.0.1") -> None:
    """One-line errors, before anything starts, for a metrics endpoint or a logger whose package is missing, and for
    a --metrics-port or --dashboard-port that something else listens on."""
    from p2ptrain.observe import MissingExtra, require
    from p2ptrain.observe.log_targets import LogToError, parse_log_to

    try:
        if observe.metrics_port is not None:
            require("prometheus_client", extra="metrics", feature="--metrics-port")
        for spec in observe.log_to:
            target = parse_log_to(spec)
            if target.kind == "tensorboard":
                require("tensorboard", extra="tensorboard", feature="--log-to tensorboard")
            elif target.kind == "wandb":
                require("wandb", extra="wandb", feature="--log-to wandb")
    except (MissingExtra, LogToError) as e:
        raise BadInput(str(e)) from None
    if "LOCAL_RANK" in os.environ:
        return  # a rank of a multi-GPU peer: its launcher checked the ports, and rank 0 may be serving one by now
    if observe.metrics_port is not None:
        check_port_free("--metrics-port", observe.metrics_host, observe.metrics_port)
    if dashboard_port is not None:
        check_port_free("--dashboard-port", dashboard_host, dashboard_port, dashboard=True)


def check_port_free(flag: str, host: str, port: int, *, dashboard: bool = False) -> None:
    """A port something else listens on, refused before the heavy imports and the DHT (5-7 s on 2 cores) rather than
    when the server starts: bind it as the server will and let it go. The family and address are the server's:
    the dashboard's (IPv6 for a host with a colon, else IPv4) or prometheus_client's (the first getaddrinfo answer),
    both with SO_REUSEADDR. The server's own bind still answers the same way if the port is taken in between. Port
    0 takes any free one; an address that does not resolve is left to the server's own error."""
    from p2ptrain.observe import listen_problem

    if not port:
        return
    if dashboard:
        family, address = (socket.AF_INET6 if ":" in host else socket.AF_INET), (host, port)
    else:
        try:
            family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        except (socket.gaierror, UnicodeError):
            return
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except (socket.gaierror, UnicodeError):  # a name bind cannot resolve: the server says so itself
            return
        except OSError as e:
            raise BadInput(str(listen_problem(flag, host, port, e))) from None


def dashboard_options(prefix: str = "") -> Callable:
    """--[prefix]port and --[prefix]host of a dashboard: ``bootstrap`` has them as --dashboard-port (off unless
    given), ``dashboard`` as --port (8080)."""
    names = ("dashboard_port", "dashboard_host")

    def decorate(command: Callable) -> Callable:
        command = click.option(f"--{prefix}host", names[1], default="127.0.0.1", show_default=True,
                               envvar=f"P2PTRAIN_{prefix.upper().replace('-', '_')}HOST", show_envvar=True,
                               help="The address the dashboard listens on: 127.0.0.1 (this host only) or 0.0.0.0 "
                                    "(every interface).")(command)
        return click.option(f"--{prefix}port", names[0], type=click.IntRange(0, 65535),
                            default=None if prefix else 8080, show_default=not prefix,
                            envvar=f"P2PTRAIN_{prefix.upper().replace('-', '_')}PORT", show_envvar=True,
                            help=("Serve the run's dashboard on this port (0: a free one); unset: no dashboard."
                                  if prefix else "The port to serve the dashboard on (0: a free one)."))(command)

    return decorate


@click.command()
@run_options(only={"run_id", "swarm.initial_peers", "swarm.initial_peers_file", "swarm.bootstrap_timeout_s",
                   "swarm.swarm_key_file"})
@dashboard_options()
@click.option("--refresh", "refresh_s", type=click.FloatRange(min=0.5), default=2.0, show_default=True,
              help="Seconds between reads of the swarm's records.")
@click.pass_context
def dashboard(ctx: click.Context, dashboard_port: int, dashboard_host: str, refresh_s: float, **params) -> None:
    """Serve a live web page of a run: its peers, their loss curves, the rounds, warnings. Read-only; it joins the
    DHT as a client (a private run needs --swarm-key) and reads what the peers publish. JSON at /api/swarm and
    /api/status (docs/observability.md); Ctrl-C stops it."""
    config = load_run_config(ctx, None, params)
    if not config.swarm.initial_peers and not config.swarm.initial_peers_file:
        raise BadInput("dashboard needs --initial-peers (or --initial-peers-file): the multiaddr of any live peer of "
                       "the run")
    check_port_free("--port", dashboard_host, dashboard_port, dashboard=True)  # before the imports (3 s)
    from p2ptrain.cli.logs import setup_hivemind_logging
    from p2ptrain.cli.processes import install_stop_handlers
    from p2ptrain.observe import listen_problem
    from p2ptrain.observe.dashboard.server import DashboardServer
    from p2ptrain.observe.swarm_view import SwarmView
    from p2ptrain.swarm.dht import SwarmError, start_dht, stop_dht

    setup_hivemind_logging()
    stop = threading.Event()
    install_stop_handlers(stop.set)
    server = DashboardServer(lambda: {}, host=dashboard_host, port=dashboard_port)
    try:  # the port first: a taken one is the user's to fix before anything joins the swarm
        server.start()
    except OSError as e:
        raise BadInput(str(listen_problem("--port", dashboard_host, dashboard_port, e))) from None
    swarm = config.swarm
    swarm.reachability, swarm.host_maddrs = "client", ["/ip4/0.0.0.0/tcp/0"]
    try:
        dht = start_dht(swarm)
    except SwarmError as e:
        server.close()
        raise BadInput(str(e)) from None
    view = SwarmView(dht, config.run_id, private=swarm.swarm_key_file is not None, refresh_s=refresh_s)
    try:
        server.snapshot, server.status = view.snapshot, view.status
        view.start()
        click.echo(f"dashboard of run {config.run_id!r} at {server.url} (JSON: {server.url}api/swarm); Ctrl-C stops",
                   err=True)
        last_line = time.monotonic()
        while not stop.wait(timeout=1.0):
            if time.monotonic() - last_line >= DASHBOARD_LOG_S:
                last_line = time.monotonic()
                peers = view.snapshot()["peers"]
                logger.info(f"dashboard serving: {sum(not p['stale'] for p in peers)} live peer(s) in run "
                            f"{config.run_id!r}, {view.looks} reads of the DHT")
    finally:
        server.close()
        view.close()
        stop_dht(dht)
