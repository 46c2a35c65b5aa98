"""How many seconds the survivors lose when a peer dies in the middle of an all-reduce.

    python benchmarks/bench_crash.py --model small --workers 3

Starts a bootstrap peer and N `p2ptrain join` workers on 127.0.0.1 (one torch thread each). The last worker is told
(P2PTRAIN_FAULT, see p2ptrain/faults.py) to die, whole process tree, in the round that starts from outer step
``--fault-step``, right after it answered one of its senders as a reducer. Prints each survivor's sync seconds for
the normal rounds and for the broken one, and the difference: the seconds the crash cost it. It also checks that
the survivors ended every round on the same parameters (equal digests).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from tqdm import tqdm

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def p2ptrain(*args: str, log: Path, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "p2ptrain", *args], stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1", **(env or {})))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--fault-step", type=int, default=2)
    parser.add_argument("--averaging-timeout", type=float, default=30.0)
    args = parser.parse_args()
    outer_steps = args.fault_step + 3

    with tempfile.TemporaryDirectory(prefix="bench-crash-") as tmp:
        tmp = Path(tmp)
        procs = [p2ptrain("bootstrap", "--host-maddrs", LOOPBACK, "--maddrs-file", str(tmp / "maddrs"),
                          log=tmp / "boot.log")]
        try:
            while not (tmp / "maddrs").exists() or not (tmp / "maddrs").read_text().strip():
                assert procs[0].poll() is None, (tmp / "boot.log").read_text()
                time.sleep(0.2)
            maddr = (tmp / "maddrs").read_text().split()[0]
            for i in range(args.workers):
                victim = i == args.workers - 1
                procs.append(p2ptrain(
                    "join", "--initial-peers", maddr, "--host-maddrs", LOOPBACK, "--run-id", "bench-crash",
                    "--model", args.model, "--batch-size", str(args.batch_size), "--local-steps", str(args.local_steps),
                    "--until-outer-step", str(outer_steps), "--num-shards", str(args.workers), "--shard-index", str(i),
                    "--threads", "1", "--matchmaking-time", "3", "--averaging-timeout", str(args.averaging_timeout),
                    "--no-group-policy", "wait", "--eval-batches", "1", "--no-progress",
                    "--report", str(tmp / f"w{i}.json"), log=tmp / f"w{i}.log",
                    env={"P2PTRAIN_FAULT": f"kill-mid-allreduce@{args.fault_step}:1"} if victim else None,
                ))
            survivors = procs[1:-1]
            # disable=None: no bar when stderr is not a terminal (a redraw every 0.1 s would fill a log file)
            with tqdm(total=len(survivors), desc="survivors finished", unit="peer", disable=None) as bar:
                died_at = None
                while any(proc.poll() is None for proc in survivors):
                    if died_at is None and procs[-1].poll() is not None:
                        died_at = time.time()
                    bar.n = sum(proc.poll() is not None for proc in survivors)
                    bar.refresh()
                    time.sleep(0.1)
            assert (procs[-1].poll() or 0) < 0 and died_at is not None, "the victim did not die"
        finally:
            for proc in procs:  # a clean leave first (it stops p2pd too), then the whole tree
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    for child in [*psutil.Process(proc.pid).children(recursive=True), proc]:
                        child.kill()
                    proc.wait()
        reports = [json.loads((tmp / f"w{i}.json").read_text()) for i in range(args.workers - 1)]

    print(f"model={args.model} params={reports[0]['num_parameters']:,} workers={args.workers} "
          f"(one dies mid-all-reduce in the round from outer step {args.fault_step})")
    for report in reports:
        rounds = {r["outer_step"]: r for r in report["rounds"]}
        broken = rounds[args.fault_step + 1]
        normal = [r["seconds"] for step, r in rounds.items()
                  if step not in (1, args.fault_step + 1) and r["averaged"] and not r["caught_up"]]
        baseline = statistics.median(normal)
        how = "caught up from a member that committed it" if broken["caught_up"] else \
            f"averaged by {broken['group_size']} in {broken['attempts']} attempt(s)"
        print(f"  survivor {report['peer_id'][-8:]}: normal sync {baseline:.2f}s (median of {len(normal)}); "
              f"the broken round took {broken['seconds']:.2f}s ({how}), committed "
              f"{broken['finished_at'] - died_at:.2f}s after the death: lost {broken['seconds'] - baseline:.2f}s")
        print("    rounds (outer step, group, seconds, attempts, caught up):",
              [(r["outer_step"], r["group_size"], round(r["seconds"], 2), r["attempts"], r["caught_up"])
               for r in report["rounds"]])
    digests = {step: {r["digest"] for rep in reports for r in rep["rounds"] if r["outer_step"] == step}
               for step in range(1, outer_steps + 1)}
    print("survivors on the same parameters after every round:", all(len(d) == 1 for d in digests.values()))


if __name__ == "__main__":
    main()
