"""What the sender check (p2ptrain/sender_check.py) costs a reducer: the CPU seconds of its sums over one range of
every sender's pseudo-gradient (a coordinatewise median of the others per sender, then dot products), for a model of
P parameters in a group of n, against the seconds of the inner steps it checks; and the bytes the sums add to a round.

    python benchmarks/bench_sender_check.py --params 25e6 --senders 4 --part-mib 0.5

Each reducer holds 1/n of the vector; it computes the sums part by part (parts of ``--part-mib`` fp32 values, as the
all-reduce sends them), on one thread, as the reducer would. Prints one line per setting and, with --json, writes them.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from p2ptrain.sender_check import partial


def measure(params: int, senders: int, part_values: int, repeats: int = 3) -> dict:
    """Seconds of one reducer's sums over its range (params / senders values of every sender), the best of
    ``repeats``; and the bytes the sums add to what each peer receives (3 doubles per sender with each part's
    receipt, every part of every range)."""
    range_values = params // senders
    generator = torch.Generator().manual_seed(0)
    shared = torch.randn(range_values, generator=generator)
    parts = [shared + torch.randn(range_values, generator=generator) for _ in range(senders)]
    best = float("inf")
    for _ in range(repeats):
        started = time.thread_time()
        for start in range(0, range_values, part_values):
            partial([p[start:start + part_values] for p in parts])
        best = min(best, time.thread_time() - started)
    num_parts = -(-params // part_values)
    return {"params": params, "senders": senders, "part_values": part_values, "cpu_s_per_reducer": best,
            "bytes_received_per_peer": num_parts * senders * 3 * 8}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, nargs="+", default=[25e6])
    parser.add_argument("--senders", type=int, nargs="+", default=[4])
    parser.add_argument("--part-mib", type=float, default=0.5, help="fp32 MiB per wire part")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for params in args.params:
        for senders in args.senders:
            row = measure(int(params), senders, int(args.part_mib * 2**20 / 4))
            rows.append(row)
            print(f"P={row['params'] / 1e6:.0f}M n={senders}: {row['cpu_s_per_reducer']:.3f} CPU s per reducer per "
                  f"round, {row['bytes_received_per_peer'] / 1e3:.1f} kB of sums received per peer per round")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
