"""The replay check's cost in a swarm of `join` workers on one host (loopback): a bootstrap peer and WORKERS workers
(one torch thread each, tiny model, H steps, unpinned shards of the built-in corpus), once per replay rate, the same
seeds and shards. Prints per rate what the workers trained and replayed, what the replays fetched and took, and the
held-out loss they ended on; writes results.json beside this file.

Usage: python run.py [RATE ...]   (default: 0 0.1 0.33 1)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKERS, LOCAL_STEPS, OUTER_STEPS, MODEL, BATCH = 4, 20, 8, "tiny", 8
ADAPTIVE = os.environ.get("ADAPTIVE", "0") == "1"
"""adaptive inner steps (the default of `join`): a peer late at a sync strides; off here unless ADAPTIVE=1, so that
every worker trains H steps a phase and the replays' time shows as time"""
HERE = Path(__file__).parent


def spawn(args, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "p2ptrain", *args], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def run(rate: float, tmp: Path) -> dict:
    boot = spawn(["bootstrap", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file", str(tmp / "maddrs"),
                  "--relays", "0"], tmp / "boot.log")
    workers = []
    try:
        deadline = time.monotonic() + 60
        while not (tmp / "maddrs").exists():
            assert time.monotonic() < deadline and boot.poll() is None, (tmp / "boot.log").read_text()
            time.sleep(0.2)
        maddr = (tmp / "maddrs").read_text().split()[0]
        started = time.monotonic()
        for i in range(WORKERS):
            workers.append(spawn(
                ["join", "--initial-peers", maddr, "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--run-id", "replaycost",
                 "--model", MODEL, "--local-steps", str(LOCAL_STEPS), "--num-shards", str(WORKERS), "--threads", "1",
                 "--target-group-size", str(WORKERS), "--no-group-policy", "wait", "--replay-rate", str(rate),
                 "--max-outer-steps", str(OUTER_STEPS), "--batch-size", str(BATCH), "--no-progress",
                 "--adaptive-steps" if ADAPTIVE else "--no-adaptive-steps", "--report", str(tmp / f"w{i}.json")],
                tmp / f"w{i}.log"))
        for i, w in enumerate(workers):
            if w.wait(timeout=900) != 0:
                raise RuntimeError((tmp / f"w{i}.log").read_text()[-3000:])
        wall_s = time.monotonic() - started
    finally:
        for proc in [*workers, boot]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(timeout=60)
    reports = [json.loads((tmp / f"w{i}.json").read_text()) for i in range(WORKERS)]
    replays = [r.get("replay") or {} for r in reports]
    trained = sum(r["local_steps"] for r in reports)
    return {
        "rate": rate, "wall_s": round(wall_s, 1),
        "compute_s": round(sum(r["compute_s"] for r in reports), 2),
        "trained_steps": sum(r["samples"] // BATCH for r in reports),
        "replays": sum(x.get("replays", 0) for x in replays),
        "replayed_steps": sum(x.get("replayed_steps", 0) for x in replays),
        "replay_s": round(sum(x.get("replay_s", 0.0) for x in replays), 2),
        "fetch_s": round(sum(x.get("fetch_s", 0.0) for x in replays), 2),
        "fetched_mb": round(sum(x.get("fetched_bytes", 0) for x in replays) / 1e6, 2),
        "max_deviation": max((x.get("max_deviation") or 0.0 for x in replays), default=0.0),
        "convicted": sum(len(x.get("convicted", {})) for x in replays),
        "sync_s": round(sum(rd["seconds"] for r in reports for rd in r["rounds"]) / max(1, sum(
            len(r["rounds"]) for r in reports)), 3),
        "group_sizes": sorted({rd["group_size"] for r in reports for rd in r["rounds"]}),
        "final_eval_loss": [round(r["final_eval_loss"], 5) for r in reports],
        "local_steps": trained,
    }


def main() -> None:
    rates = [float(a) for a in sys.argv[1:]] or [0.0, 0.1, 0.33, 1.0]
    print(f"{WORKERS} workers, {MODEL}, H = {LOCAL_STEPS}, {OUTER_STEPS} rounds, batch {BATCH}, adaptive steps "
          f"{'on' if ADAPTIVE else 'off'}", flush=True)
    results = []
    for rate in rates:
        with tempfile.TemporaryDirectory() as tmp:
            result = run(rate, Path(tmp))
        results.append(result)
        print(json.dumps(result), flush=True)
    name = "results-adaptive.json" if ADAPTIVE else "results.json"
    (HERE / name).write_text(json.dumps(results, indent=1) + "\n")
    print("\n| rate | replays | replayed / trained steps | replay s / compute s | fetched MB | fetch s | sync s "
          "(mean) | max deviation | convicted | final eval loss |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        print(f"| {r['rate']:g} | {r['replays']} | {r['replayed_steps'] / r['trained_steps']:.1%} | "
              f"{r['replay_s'] / r['compute_s']:.1%} | {r['fetched_mb']} | {r['fetch_s']} | {r['sync_s']} | "
              f"{r['max_deviation']:.3g} | {r['convicted']} | {', '.join(map(str, r['final_eval_loss']))} |")


if __name__ == "__main__":
    main()
