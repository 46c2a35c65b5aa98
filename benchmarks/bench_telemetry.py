"""What seeing the swarm costs: the seconds each telemetry sink adds to an inner step, the size of the record a
peer publishes for dashboards, and how long a scrape of /metrics and a dashboard's /api/swarm take.

    python benchmarks/bench_telemetry.py [--steps 5000] [--peers 16]

Each sink is timed alone on the training thread's call (``Telemetry.step``, and ``Telemetry.round`` once per 500
steps as a sync would be): Prometheus metrics, TensorBoard, W&B (offline), and the DHT record's window (its store
is skipped here: the DHT process does that in the background). The full record is the largest a peer publishes
(every window full). The dashboard's answer is timed for ``--peers`` peers with full windows and 2,000 rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import urllib.request
from typing import Optional

from p2ptrain.observe.telemetry import MAX_LOSSES, Telemetry, TelemetryPublisher


class _NoStore(TelemetryPublisher):
    def publish(self) -> None:  # the window's work on the training thread, without a DHT
        self._last_published = time.monotonic()
        self.record("Qm" + "x" * 44, time.time()).SerializeToString()


def _round_entry(step: int) -> dict:
    return dict(outer_step=step // 500, finished_at=time.time(), group_size=8, seconds=4.2, averaged=True,
                phases={"matchmaking": 0.5, "allreduce": 3.1, "pseudo_gradient": 0.1}, allreduce_s=3.1,
                bytes_sent=50_000_000, bytes_received=50_000_000, eval_loss=3.0, perplexity=20.1, local_step=step,
                shard_index=3, data_position=[0, step * 16], outer_lr=0.7, attempts=1)


def time_sink(telemetry: Telemetry, steps: int) -> float:
    """Median microseconds per inner step's call, syncs included (one every 500 steps)."""
    samples = []
    for step in range(steps):
        started = time.perf_counter()
        telemetry.step(local_step=step, outer_step=step // 500, loss=3.0, samples=16, tokens=16 * 256,
                       tokens_per_s=1e4, inner_lr=4e-4, outer_lr=0.7)
        if step % 500 == 499:
            telemetry.round(_round_entry(step))
        samples.append(time.perf_counter() - started)
    telemetry.close()
    return 1e6 * statistics.mean(samples), 1e6 * statistics.median(samples)


def main(argv: Optional[list] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--peers", type=int, default=16)
    args = parser.parse_args(argv)
    from p2ptrain.observe.log_targets import parse_log_to
    from p2ptrain.observe.loggers import TrainingLoggers
    from p2ptrain.observe.metrics import WorkerMetrics

    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_SILENT", "true")
        for name in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            os.environ.setdefault(name, tmp)
        sinks = {
            "nothing on": lambda: Telemetry(),
            "prometheus": lambda: Telemetry(metrics=WorkerMetrics(run_id="r", model="m", compression="fp16")),
            "tensorboard": lambda: Telemetry(loggers=TrainingLoggers(
                [parse_log_to(f"tensorboard:{tmp}/tb")], run_id="r", peer_id="Qm" + "x" * 44, config={}).open()),
            "wandb (offline)": lambda: Telemetry(loggers=TrainingLoggers(
                [parse_log_to("wandb:bench")], run_id="r", peer_id="Qm" + "y" * 44, config={}).open()),
            "dashboard record": lambda: Telemetry(publisher=_NoStore(None, "r")),
        }
        print(f"per inner step, {args.steps} steps, a round every 500 (mean / median microseconds):")
        for name, make in sinks.items():
            mean_us, median_us = time_sink(make(), args.steps)
            print(f"  {name:<18} {mean_us:8.1f} / {median_us:6.1f}")

    publisher = TelemetryPublisher(None, "a-run-id")
    for step in range(MAX_LOSSES * 2):
        publisher._last_loss_at = -1e9
        publisher.add_loss(step, 3.0)
        publisher.add_round(_round_entry(step))
    publisher.banned = ["Qm" + "z" * 44] * 8
    record = publisher.record("Qm" + "x" * 44, time.time())
    size = len(record.SerializeToString())
    print(f"PeerTelemetry with every window full ({len(record.losses)} losses, {len(record.evals)} evals, "
          f"{len(record.rounds)} rounds, 8 excluded ids): {size:,} bytes")

    from p2ptrain.observe.dashboard.server import DashboardServer
    from p2ptrain.observe.swarm_view import SwarmView

    view = SwarmView(None, "a-run-id", private=False)
    peers = []
    for i in range(args.peers):
        peer_id = f"Qm{i:044d}"
        peers.append(dict(peer_id=peer_id, outer_step=10, local_step=5000, samples_per_s=50.0,
                          last_seen=time.time(), mode="public", reachability="", shard=i, shard_passes=0.5))
    for look in range(20):  # enough reads to fill the kept history
        telemetry = {}
        for p in peers:
            t = TelemetryPublisher(None, "a-run-id")
            for step in range(MAX_LOSSES):
                t._last_loss_at = -1e9
                t.add_loss(look * MAX_LOSSES + step, 3.0)
            for r in range(4):
                t.add_round(dict(_round_entry(look * 4 + r), finished_at=time.time() + look * 4 + r))
            telemetry[p["peer_id"]] = t.record(p["peer_id"], time.time())
        view.merge(dict(run_id="a-run-id", peers=peers, public_peers=len(peers), coverage=None), telemetry)
    with DashboardServer(view.snapshot, port=0).start() as server:
        timings, body = [], b""
        for _ in range(20):
            started = time.perf_counter()
            body = urllib.request.urlopen(server.url + "api/swarm").read()
            timings.append(time.perf_counter() - started)
    answer = json.loads(body)
    print(f"/api/swarm for {args.peers} peers ({sum(len(v) for v in answer['losses'].values()):,} loss points, "
          f"{len(answer['rounds']):,} rounds): {len(body) / 1e6:.2f} MB, median {1e3 * statistics.median(timings):.0f}"
          " ms")

    metrics = WorkerMetrics(run_id="r", model="m", compression="fp16").start("127.0.0.1", 0)
    try:
        timings = []
        for _ in range(50):
            started = time.perf_counter()
            body = urllib.request.urlopen(metrics.url("127.0.0.1")).read()
            timings.append(time.perf_counter() - started)
    finally:
        metrics.close()
    print(f"/metrics scrape: {len(body):,} bytes, median {1e3 * statistics.median(timings):.1f} ms")


if __name__ == "__main__":
    main()
