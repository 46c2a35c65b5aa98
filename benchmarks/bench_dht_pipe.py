"""How large a DHT store survives the pipe between a host process and hivemind's DHT process: stock hivemind.DHT
against p2ptrain's FollowingDHT (swarm/pipe.py), a store per value size, ``--trials`` times each, on one local DHT.
Prints per size the stores that landed and the DHT processes that died; a dead DHT is replaced for the next trial.

    python benchmarks/bench_dht_pipe.py [--trials 10] [--sizes 1000 15000 16000 17000 70000 300000 1000000]

Then the median round trip of a small get through each (what the whole-message pipe costs a command).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import time

import hivemind
from hivemind.utils import get_dht_time

from p2ptrain.swarm.dht import FollowingDHT, stop_dht


def quiet(make):
    """``make()`` with its child processes' stderr sent to /dev/null: a stock DHT process that dies prints its
    traceback there."""
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        return make()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def trial(make, size: int, dht):
    """(landed, died, the DHT to use next)"""
    if dht is None or not dht.is_alive():
        if dht is not None:
            stop_dht(dht)
        dht = make()
    try:
        landed = bool(dht.store(f"k{size}", b"x" * size, get_dht_time() + 60, return_future=True).result(3))
    except Exception:
        landed = False
    if landed:  # a get goes through the same pipe: a desynced stream shows here if the store alone did not
        try:
            landed = dht.get(f"k{size}", latest=True, return_future=True).result(3) is not None
        except Exception:
            landed = False
    return landed, not dht.is_alive(), dht


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--sizes", type=int, nargs="+",
                        default=[1000, 8192, 15000, 16000, 17000, 70000, 300000, 1000000])
    args = parser.parse_args()
    logging.disable(logging.CRITICAL)  # hivemind logs every failed read with a traceback
    makers = {"hivemind.DHT": lambda: quiet(lambda: hivemind.DHT(start=True)),
              "FollowingDHT": lambda: FollowingDHT(start=True)}
    print(f"{'value bytes':>12} " + " ".join(f"{name + ' landed':>20} {'died':>5}" for name in makers), flush=True)
    dhts = dict.fromkeys(makers)
    for size in args.sizes:
        cells = []
        for name, make in makers.items():
            landed = died = 0
            for _ in range(args.trials):
                ok, dead, dhts[name] = trial(make, size, dhts[name])
                landed, died = landed + ok, died + dead
            cells.append(f"{f'{landed}/{args.trials}':>20} {died:>5}")
        print(f"{size:>12,} " + " ".join(cells), flush=True)
    # what the whole-message pipe costs a command: a get of a small local value, round trip through both pipes
    cells = []
    for name, make in makers.items():
        if dhts[name] is None or not dhts[name].is_alive():
            dhts[name] = make()
        cells.append(f"{latency_ms(dhts[name]):>17.3f} ms {'':>5}")
    print(f"{'get of 100 B':>12} " + " ".join(cells), flush=True)
    for dht in dhts.values():
        if dht is not None:
            stop_dht(dht)


def latency_ms(dht, calls: int = 300) -> float:
    """The median milliseconds of a get of a small value the DHT holds locally."""
    dht.store("small", b"x" * 100, get_dht_time() + 60)
    times = []
    for _ in range(calls):
        started = time.perf_counter()
        dht.get("small", latest=False)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


if __name__ == "__main__":
    sys.exit(main())
