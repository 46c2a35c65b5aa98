"""How long a newcomer waits before its first inner step, and what serving the state costs a training donor.

    python benchmarks/bench_join.py --model small

Donor A (this process) and donor B (a child process) sync once, so the state has outer momentum and AdamW moments.
Then donor A trains without pause in a thread pinned to CPU core 0, while everything else (the donors' averager
processes that serve the state, donor B, the newcomer) runs on the other cores, as on a training host that keeps a
core for networking. A newcomer (another child process) joins: DHT, optimizer, averager process, then the state in
chunks from both donors. Prints the newcomer's wait split into joining and downloading, the chunks each donor
served, donor A's inner steps per second before, during and after the download, and how long donor A's training
was held up by the state lock (one copy of its state per snapshot).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import threading
import time
from functools import partial

import hivemind
import torch

from p2ptrain import DiLoCoOptimizer
from p2ptrain.model import build_model

INNER = partial(torch.optim.AdamW, lr=1e-4)
OUTER = partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]


def make(model_name: str, dht: hivemind.DHT):
    model = build_model(model_name, seed=0)
    opt = DiLoCoOptimizer(model.parameters(), dht=dht, run_id="bench-join", local_steps=2, inner_optimizer=INNER,
                          outer_optimizer=OUTER, target_group_size=2, averaging_timeout_s=300).start()
    return model, opt


def inner_step(model, opt) -> None:
    x = torch.randint(0, 256, (4, 64))
    model(x, x)[1].backward()
    opt.step()
    opt.zero_grad()


def donor_b(model_name: str, maddrs, cores, ready, stop) -> None:
    """A second donor: syncs once with donor A, then only serves its state until ``stop``."""
    mp.set_start_method("fork", force=True)  # hivemind forks its processes; a spawned child would spawn them
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(1)
    dht = hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=maddrs)
    model, opt = make(model_name, dht)
    ready.set()
    for _ in range(2):
        inner_step(model, opt)
    stop.wait()
    opt.close()
    dht.shutdown()


def newcomer(model_name: str, maddrs, cores, results) -> None:
    mp.set_start_method("fork", force=True)
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(1)
    started = time.perf_counter()
    dht = hivemind.DHT(start=True, host_maddrs=LOOPBACK, initial_peers=maddrs)
    model, opt = make(model_name, dht)
    joined = time.perf_counter()
    ok = opt.load_state_from_peers(timeout_s=300)
    done = time.perf_counter()
    results.put(dict(ok=ok, join_s=joined - started, download_s=done - joined, download=opt.last_download,
                     params=sum(p.numel() for p in model.parameters())))
    opt.close()
    dht.shutdown()


def rate(times, start: float, end: float) -> float:
    return sum(start <= t < end for t in times) / max(end - start, 1e-9)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    parser.add_argument("--window", type=float, default=10.0, help="seconds of donor training before and after")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    other_cores = set(cores[1:]) or set(cores)
    os.sched_setaffinity(0, other_cores)  # this thread and what it starts (donor A's averager): off the training core
    ctx = mp.get_context("spawn")
    ready_b, stop_b, results = ctx.Event(), ctx.Event(), ctx.Queue()

    dht = hivemind.DHT(start=True, host_maddrs=LOOPBACK)
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    model, opt = make(args.model, dht)
    b = ctx.Process(target=donor_b, args=(args.model, maddrs, other_cores, ready_b, stop_b))
    b.start()
    stop, step_times = threading.Event(), []
    trainer = None
    try:
        assert ready_b.wait(timeout=300), "donor B did not start"
        for _ in range(2):
            inner_step(model, opt)  # the second step syncs with donor B
        assert opt.history[-1].group_size == 2, "the two donors did not sync together"
        opt.local_steps = 10**9  # no more syncs: donor A only trains from now on

        def train() -> None:
            os.sched_setaffinity(0, {cores[0]})  # this thread only
            while not stop.is_set():
                inner_step(model, opt)
                step_times.append(time.perf_counter())

        trainer = threading.Thread(target=train, daemon=True)
        trainer.start()
        time.sleep(args.window)
        joined_at = time.perf_counter()
        c = ctx.Process(target=newcomer, args=(args.model, maddrs, other_cores, results))
        c.start()
        result = results.get(timeout=600)
        done_at = time.perf_counter()
        download_at = done_at - result["download_s"]
        c.join()
        time.sleep(args.window)
        stop.set()
        trainer.join()
    finally:
        stop.set()
        if trainer is not None:
            trainer.join()
        stop_b.set()
        b.join(timeout=60)
        opt.close()
        dht.shutdown()

    assert result["ok"], "the newcomer got no state"
    download = result["download"]
    chunks = {peer[-8:]: n for peer, n in download["chunks_by_donor"].items()}
    before = rate(step_times, joined_at - args.window, joined_at)
    during = rate(step_times, download_at, done_at)
    after = rate(step_times, done_at, done_at + args.window)
    print(f"model={args.model} params={result['params']:,} state={download['bytes'] / 2**20:.1f} MiB")
    print(f"newcomer wait before its first inner step: {result['join_s'] + result['download_s']:.2f}s "
          f"(join: DHT + averager {result['join_s']:.2f}s, state download {result['download_s']:.2f}s)")
    print(f"chunks per donor: {chunks}")
    print(f"donor A inner steps/s: before {before:.2f}, during the download {during:.2f} "
          f"({(during / before - 1) * 100:+.1f}%), after {after:.2f}")
    print(f"donor A's training held up by the state lock: {opt.last_donor_pause_s * 1000:.0f} ms")


if __name__ == "__main__":
    main()
