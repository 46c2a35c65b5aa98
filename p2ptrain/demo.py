"""``p2ptrain demo``: a bootstrap peer and N workers on 127.0.0.1, each a separate ``p2ptrain`` process.

The demo drives the real commands (``bootstrap``, ``join``) exactly as a user would in separate shells, follows
their progress through the DHT the way ``status`` does, and summarises and plots the workers' JSON reports.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import List, Optional

from tqdm import tqdm

from p2ptrain.daemons import DaemonError, spawn, stop_daemons, wait_for_address

logger = logging.getLogger(__name__)

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


class DemoError(DaemonError):
    """The demo could not finish; the message says where the logs are."""


def run_demo(
    *,
    workers: int,
    outer_steps: int,
    local_steps: int,
    model: str = "tiny",
    json_path: Optional[str] = None,
    keep_logs: bool = False,
    stop: Optional[threading.Event] = None,
    show_progress: bool = True,
    progress_interval_s: float = 10.0,
) -> dict:
    """``show_progress``: a tqdm bar on stdout; False: a plain line every ``progress_interval_s`` (for log files)."""
    stop = stop or threading.Event()
    log_dir = Path(tempfile.mkdtemp(prefix="p2ptrain-demo-"))
    run_id = f"demo-{uuid.uuid4().hex[:8]}"
    started = time.monotonic()
    # the log folder is removed when all goes well: name it only where it stays (an error names it then)
    logs = f"logs in {log_dir}" if keep_logs else "logs kept only if it fails (--keep-logs: always)"
    print(f"p2ptrain demo: run {run_id}, {workers} workers, {outer_steps} outer steps x {local_steps} local steps; "
          f"{logs}", flush=True)

    procs: List[subprocess.Popen] = []
    ok = False
    try:
        boot = spawn(["bootstrap", "--host-maddrs", LOOPBACK, "--maddrs-file", str(log_dir / "bootstrap.maddrs")],
                     log_dir / "bootstrap.log")
        procs.append(boot)
        bootstrap_maddr = wait_for_address(log_dir / "bootstrap.maddrs", boot, timeout_s=60)

        threads = max(1, (os.cpu_count() or 1) // workers)
        worker_procs = []
        for i in range(workers):
            args = [
                "join", "--initial-peers", bootstrap_maddr, "--host-maddrs", LOOPBACK, "--run-id", run_id,
                # the defaults group the workers and split the data, as in a swarm started by hand; the threads
                # split this host's cores between its workers, as the --threads help advises
                # --until-outer-step: the workers end on the same outer step, also one that had to take the state
                "--model", model, "--local-steps", str(local_steps), "--until-outer-step", str(outer_steps),
                "--threads", str(threads), "--log-interval", "5",
                "--report", str(log_dir / f"worker-{i}.json"), "--no-progress",
            ]
            worker_procs.append(spawn(args, log_dir / f"worker-{i}.log"))
        procs.extend(worker_procs)

        _follow(worker_procs, bootstrap_maddr, run_id, workers * outer_steps * local_steps, stop,
                show_progress=show_progress, interval_s=progress_interval_s)
        if stop.is_set():
            raise DemoError(f"stopped by signal; logs in {log_dir}")
        failed = [i for i, p in enumerate(worker_procs) if p.returncode != 0]
        if failed:
            raise DemoError(f"worker(s) {failed} failed; see {log_dir}/worker-N.log")

        reports = [json.loads((log_dir / f"worker-{i}.json").read_text()) for i in range(workers)]
        summary = {"run_id": run_id, "wall_s": round(time.monotonic() - started, 2), "workers": reports}
        _print_table(summary)
        if json_path:
            Path(json_path).write_text(json.dumps(summary, indent=2))
            print(f"wrote {json_path}")
        _plot(reports, _plots_dir(json_path, run_id))
        ok = True
        return summary
    finally:
        stop_daemons(procs[1:], timeout_s=30)  # the workers leave first, the bootstrap peer after them
        stop_daemons(procs[:1], timeout_s=30)
        if ok and not keep_logs:
            shutil.rmtree(log_dir, ignore_errors=True)


def _plots_dir(json_path: Optional[str], run_id: str) -> Path:
    """Next to the --json file (``demo.json`` -> ``demo-plots/``): where the user asked for the demo's output. Else
    a folder of its own in the temporary directory, not the current one: the log folder is removed when all went
    well, and a run (a test's, too) should not leave files in whatever folder it was started from."""
    if json_path:
        path = Path(json_path)
        return path.with_name(f"{path.stem}-plots")
    return Path(tempfile.gettempdir()) / f"p2ptrain-{run_id}-plots"


def _plot(reports: List[dict], out: Path) -> None:
    """The workers' plots (observe/plot.py), or a line saying why there are none: the run itself went well."""
    from p2ptrain.observe import MissingExtra
    from p2ptrain.observe.plot import plot_reports

    try:
        written = plot_reports(reports, out)
    except MissingExtra as e:
        print(f"no plots: {e}")
        return
    except OSError as e:
        print(f"no plots: cannot write them into {out}: {e.strerror or e}")
        return
    print(f"plots: {out} ({', '.join(path.name for path in written)})")


def _follow(worker_procs, bootstrap_maddr: str, run_id: str, total_steps: int, stop: threading.Event, *,
            show_progress: bool = True, interval_s: float = 10.0) -> None:
    """Show the swarm's local steps, read from the DHT like `status`, until the workers exit: as a progress bar, or
    (``show_progress`` False: stdout is a file) as a line every ``interval_s``, since a bar there is one redraw per
    update glued together with carriage returns."""
    from p2ptrain.swarm.dht import SwarmConfig, start_dht, stop_dht
    from p2ptrain.swarm.progress import fetch_progress

    dht = start_dht(SwarmConfig(initial_peers=[bootstrap_maddr], host_maddrs=[LOOPBACK], reachability="client"),
                    role="the demo reads the workers' records as a client", reader=True)
    bar = tqdm(total=total_steps, desc="swarm", unit="step", file=sys.stdout, disable=not show_progress)
    best: dict = {}
    last_line = -math.inf  # a first line at once, then one every interval_s
    try:
        while not stop.is_set() and any(p.poll() is None for p in worker_procs):
            for record in fetch_progress(dht, run_id, timeout_s=5):
                best[record.peer_id] = max(best.get(record.peer_id, (0, 0)), (record.local_step, record.outer_step))
            done = sum(local for local, _ in best.values())
            outer = ",".join(str(o) for _, o in best.values())
            bar.update(max(0, min(done, total_steps) - bar.n))
            bar.set_postfix(peers=len(best), outer=outer)
            if not show_progress and time.monotonic() - last_line >= interval_s:
                print(f"swarm: {min(done, total_steps)}/{total_steps} local steps, {len(best)} peer(s), "
                      f"outer steps {outer or '-'}", flush=True)
                last_line = time.monotonic()
            time.sleep(1.0)
        bar.update(total_steps - bar.n if all(p.returncode == 0 for p in worker_procs) else 0)
    finally:
        bar.close()
        stop_dht(dht)


def _print_table(summary: dict) -> None:
    print(f"\nrun {summary['run_id']} finished in {summary['wall_s']:.1f}s")
    header = f"{'worker':<10} {'outer':>5} {'loss before':>11} {'loss after':>10} {'sync s (mean)':>13} " \
             f"{'bytes sent/sync':>15} {'group sizes':<12}"
    print(header)
    print("-" * len(header))
    for w in summary["workers"]:
        rounds = w["rounds"]
        mean_s = sum(r["seconds"] for r in rounds) / max(len(rounds), 1)
        mean_bytes = sum(r["bytes_sent"] for r in rounds) / max(len(rounds), 1)
        sizes = ",".join(str(r["group_size"]) for r in rounds)
        print(f"{w['peer_id'][-8:]:<10} {w['outer_steps']:>5} {w['initial_eval_loss']:>11.4f} "
              f"{w['final_eval_loss']:>10.4f} {mean_s:>13.2f} {mean_bytes:>15,.0f} {sizes:<12}")
