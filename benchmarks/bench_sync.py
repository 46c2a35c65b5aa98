"""Seconds and payload bytes of one DiLoCo sync between two peers on 127.0.0.1, against the model's size.

    python benchmarks/bench_sync.py --model small --syncs 3

Two DiLoCoOptimizers, each on its own hivemind DHT, are driven from two threads of this process (no training:
one inner step of a zero gradient between syncs, so the figures are the sync alone). Prints one line per
compression with the mean seconds per sync and the bytes each peer sent and received per sync.
"""

from __future__ import annotations

import argparse
import threading
import time
from functools import partial

import hivemind
import torch

from p2ptrain import DiLoCoOptimizer
from p2ptrain.model import build_model


def run(model_name: str, compression: str, syncs: int) -> None:
    dhts = [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])]
    dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                             initial_peers=dhts[0].get_visible_maddrs()))
    models = [build_model(model_name, seed=0) for _ in dhts]
    opts = [
        DiLoCoOptimizer(model.parameters(), dht=dht, run_id=f"bench-{compression}", local_steps=1,
                        inner_optimizer=partial(torch.optim.SGD, lr=0.0),
                        outer_optimizer=partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
                        compression=compression, target_group_size=2, matchmaking_time_s=5.0,
                        averaging_timeout_s=300.0).start()
        for model, dht in zip(models, dhts)
    ]
    try:
        def drive(opt: DiLoCoOptimizer) -> None:
            for _ in range(syncs):
                opt.step()

        started = time.perf_counter()
        threads = [threading.Thread(target=drive, args=(opt,)) for opt in opts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - started
        history = opts[0].history
        params = sum(p.numel() for p in models[0].parameters())
        mean_s = sum(r.seconds for r in history) / len(history)
        sent = sum(r.bytes_sent for r in history) / len(history)
        received = sum(r.bytes_received for r in history) / len(history)
        groups = ",".join(str(r.group_size) for r in history)
        print(f"model={model_name} params={params:,} fp32_bytes={4 * params:,} compression={compression:<4} "
              f"syncs={len(history)} groups={groups} mean_sync_s={mean_s:.3f} "
              f"sent_per_sync={sent:,.0f}B ({sent / params:.2f} B/param) received_per_sync={received:,.0f}B "
              f"wall_s={wall:.1f}")
    finally:
        for opt in opts:
            opt.close()
        for dht in dhts:
            dht.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="built-in model size (tiny, small, 124m)")
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--compression", nargs="+", default=["fp16", "none"])
    args = parser.parse_args()
    for compression in args.compression:
        run(args.model, compression, args.syncs)


if __name__ == "__main__":
    main()
