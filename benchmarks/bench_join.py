"""How long a newcomer waits for the swarm's state, and what serving it costs a donor.

    python benchmarks/bench_join.py --model small

Two peers (separate DHTs, one process, two threads) run one sync of the chosen built-in model with a few AdamW
steps before it, so the state has outer momentum and inner moments; then a newcomer downloads the state from them.
Prints the download seconds and bytes, and the donor-side pause: the time its state lock is held to copy the
state (training waits on that lock; the transfer itself runs in other threads and processes).
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

INNER = partial(torch.optim.AdamW, lr=1e-4)
OUTER = partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)


def make(model_name: str, dht: hivemind.DHT):
    model = build_model(model_name, seed=0)
    opt = DiLoCoOptimizer(model.parameters(), dht=dht, run_id="bench-join", local_steps=2, inner_optimizer=INNER,
                          outer_optimizer=OUTER, target_group_size=2, averaging_timeout_s=300)
    return model, opt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small")
    args = parser.parse_args()

    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    dhts = [first, hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                initial_peers=first.get_visible_maddrs())]
    peers = [make(args.model, dht) for dht in dhts]
    newcomer_dht = None
    opts = [opt for _, opt in peers]
    try:
        def two_steps(model, opt):
            for _ in range(2):  # the second step syncs
                x = torch.randint(0, 256, (2, 32))
                model(x, x)[1].backward()
                opt.step()
                opt.zero_grad()

        threads = [threading.Thread(target=two_steps, args=peer) for peer in peers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(opt.history[-1].group_size == 2 for opt in opts), "the two peers did not sync together"

        pauses = []
        for _ in range(3):
            started = time.perf_counter()
            _, tensors, _ = opts[0]._shareable_state()
            pauses.append(time.perf_counter() - started)
        state_bytes = sum(t.numel() * t.element_size() for t in tensors)

        newcomer_dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                                    initial_peers=first.get_visible_maddrs())
        model, newcomer = make(args.model, newcomer_dht)
        opts.append(newcomer)
        started = time.perf_counter()
        assert newcomer.load_state_from_peers(timeout_s=300), "the newcomer got no state"
        download_s = time.perf_counter() - started
        params = sum(p.numel() for p in model.parameters())
        print(f"model={args.model} params={params:,} state_bytes={state_bytes:,} "
              f"newcomer_download_s={download_s:.2f} donor_pause_s={min(pauses):.3f} (min of 3 copies under the lock)")
    finally:
        for opt in opts:
            opt.close()
        for dht in [*dhts, newcomer_dht]:
            if dht is not None:
                dht.shutdown()


if __name__ == "__main__":
    main()
