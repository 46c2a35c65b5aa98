"""The bootstrap peer daemon: a DHT-only peer that workers dial to join (always a full member: it answers their
reachability probes), with the run's swarm exported to Prometheus and a dashboard if asked. It stops on ``stop``
(the CLI sets it on the first SIGINT/SIGTERM) and always shuts its DHT down on the way out."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple

from p2ptrain.config import ObserveConfig
from p2ptrain.health import Heartbeat, write_atomically
from p2ptrain.observe import listen_problem
from p2ptrain.swarm.dht import DHTLost, DHTWatch, SwarmConfig, start_dht, stop_dht, visible_maddrs

logger = logging.getLogger(__name__)

SWARM_LOOK_S = 10.0
"""how often a bootstrap peer with --metrics-port reads the run's progress records, unless --metrics-refresh says"""
SWARM_READ_TIMEOUT_S = 10.0
"""how long one such read may take: a DHT lookup under load can take seconds, whatever the period between reads"""


def run_bootstrap(
    swarm: SwarmConfig, *, maddrs_file: Optional[str], stop: threading.Event, status_interval_s: float = 60.0,
    health_file: Optional[str] = None, run_id: str = "p2ptrain", observe: Optional[ObserveConfig] = None,
    dashboard: Optional[Tuple[str, int]] = None, on_serving: Optional[Callable[[Dict[str, Any]], None]] = None,
    swarm_look_s: float = SWARM_LOOK_S,
) -> None:
    """A DHT-only peer: starts, prints its addresses, serves until ``stop`` is set, shuts down. Always a full
    member: workers dial it to join, and it answers their reachability probes. With ``observe.metrics_port`` it
    exports the swarm of ``run_id`` to Prometheus (read every ``swarm_look_s``); with ``dashboard`` ((host, port))
    it serves the dashboard of that run. ``on_serving``: called with the servers' ports once all are up (tests)."""
    observe = observe or ObserveConfig()
    metrics = server = view = None
    if observe.metrics_port is not None:  # before the DHT: a taken port is the user's to fix first
        from p2ptrain.observe.metrics import SwarmMetrics

        metrics = SwarmMetrics()
        try:
            metrics.start(observe.metrics_host, observe.metrics_port)
        except OSError as e:
            raise listen_problem("--metrics-port", observe.metrics_host, observe.metrics_port, e) from None
    try:
        dht = start_dht(dataclasses.replace(swarm, reachability="public"),
                        role="a bootstrap peer always is (the others dial it to join)", relays=swarm.relays)
    except BaseException:
        if metrics is not None:
            metrics.close()
        raise
    peer_id = dht.peer_id.to_base58()
    heartbeat = None
    watch = DHTWatch(dht, lambda line: stop.set()).start()
    try:
        if dashboard is not None:
            from p2ptrain.observe.dashboard.server import DashboardServer
            from p2ptrain.observe.swarm_view import SwarmView

            view = SwarmView(dht, run_id, private=swarm.swarm_key_file is not None).start()
            host, port = dashboard
            try:
                server = DashboardServer(view.snapshot, host=host, port=port, status=view.status).start()
            except OSError as e:
                raise listen_problem("--dashboard-port", host, port, e) from None
        maddrs = visible_maddrs(dht)
        print(f"bootstrap peer {peer_id} is up; workers join with --initial-peers and one of:")
        for maddr in maddrs:
            print(f"  {maddr}", flush=True)
        if dht.relays:
            print(f"relaying for workers behind NAT through {swarm.relays} relay daemons (--relays 0: off)",
                  flush=True)
        if metrics is not None:
            metrics.set_peer(peer_id)
            print(f"Prometheus metrics of run {run_id!r} at {metrics.url(observe.metrics_host)}", flush=True)
        if server is not None:
            print(f"dashboard of run {run_id!r} at {server.url}", flush=True)
        if maddrs_file:  # atomically: a worker waiting for the file must never read half of it
            write_atomically(Path(maddrs_file), "".join(f"{m}\n" for m in maddrs))
        if health_file:
            heartbeat = Heartbeat(health_file, lambda: dict(role="bootstrap", phase="serving", peer_id=peer_id,
                                                            dht_alive=dht.is_alive())).start()
        if on_serving is not None:
            on_serving(dict(metrics_port=metrics.port if metrics else None,
                            dashboard_port=server.port if server else None))
        last_status = time.monotonic()
        while True:
            if metrics is not None:
                from p2ptrain.swarm.progress import fetch_progress

                metrics.update(run_id, fetch_progress(dht, run_id, timeout_s=SWARM_READ_TIMEOUT_S))
            if stop.wait(timeout=swarm_look_s if metrics is not None else status_interval_s):
                break
            if time.monotonic() - last_status >= status_interval_s:
                logger.info(f"bootstrap peer {peer_id} serving")
                last_status = time.monotonic()
    finally:
        for closing in (server, view, metrics):
            if closing is not None:
                closing.close()
        if heartbeat is not None:
            heartbeat.stop("leaving")
        watch.stop()
        stop_dht(dht)
        if heartbeat is not None:
            heartbeat.beat(phase="left", dht_alive=False)
    if watch.lost:
        raise DHTLost(watch.lost)
