"""The outer step alone: seconds and peak RSS rise of ``outer.outer_step_`` on a model's fp32 global parameters.

    python benchmarks/bench_outer_step.py [--model 124m] [--repeats 5] [--lr 0.7] [--momentum 0.9] [--trim] [--threads N]

The global parameters are fp32 copies of a built-in model's (``build_model(size, seed=0)``: the real shapes), the outer
optimizer is ``make_outer_optimizer`` (SGD with Nesterov momentum), and the averages are fixed random values, copied
back into the buffers before every step (``outer_step_`` may use them as scratch; the copy is not timed). One untimed
step first creates the momentum buffers; then ``--repeats`` timed steps, each as ``BlockingSync.apply`` calls it (with
the copy into the model's parameters) and then without that copy. Wall seconds, and CPU seconds (all threads: less
sensitive to other work on a shared machine). Back to back, a step that allocates temporaries gets them from what the
last step freed; ``--trim`` hands the freed heap back to the OS before each step (glibc's ``malloc_trim(0)``), as
training's own allocations between two syncs may leave it, so that the temporaries cost their page faults again.

The peak RSS rise of a step is VmHWM after it minus VmRSS before it, with the peak reset just before the step
(``echo 5 > /proc/self/clear_refs``, Linux): what the step allocated on top of what the process held. Prints one JSON
line: the medians and every repeat.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from typing import Dict

import torch

from p2ptrain.model import build_model
from p2ptrain.outer import make_outer_optimizer, outer_step_

MB = 1e6


def _memory_kb() -> Dict[str, int]:
    with open("/proc/self/status") as f:
        return {line.split(":")[0]: int(line.split()[1]) for line in f if line.startswith(("VmRSS", "VmHWM"))}


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="124m", help="a built-in model size")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps")
    parser.add_argument("--lr", type=float, default=0.7, help="outer learning rate")
    parser.add_argument("--momentum", type=float, default=0.9, help="outer momentum (Nesterov; 0: plain SGD)")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) before each step: a cold heap")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's; bench_sync's peers run 1)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    trim = ctypes.CDLL("libc.so.6").malloc_trim if args.trim else None

    params = [p.detach() for p in build_model(args.model, seed=0).parameters()]
    global_params = [torch.nn.Parameter(p.to(torch.float32, copy=True)) for p in params]
    outer = make_outer_optimizer(global_params, lr=args.lr, momentum=args.momentum)
    generator = torch.Generator().manual_seed(0)
    source = [torch.randn(g.shape, generator=generator).mul_(1e-3) for g in global_params]
    averages = [torch.empty_like(g) for g in global_params]
    nbytes = sum(g.numel() * g.element_size() for g in global_params)

    def step(copy_into_model: bool) -> Dict[str, float]:
        for average, values in zip(averages, source):
            average.copy_(values)
        if trim is not None:
            trim(0)
        before = _memory_kb()
        _reset_peak_rss()
        started, cpu_started = time.perf_counter(), time.process_time()
        outer_step_(outer, global_params, averages, params if copy_into_model else None)
        seconds, cpu_s = time.perf_counter() - started, time.process_time() - cpu_started
        return {"s": seconds, "cpu_s": cpu_s, "peak_rise_mb": (_memory_kb()["VmHWM"] - before["VmRSS"]) * 1024 / MB}

    first = step(True)  # creates the momentum buffers
    with_copy = [step(True) for _ in range(args.repeats)]
    alone = [step(False) for _ in range(args.repeats)]
    print(json.dumps({
        "model": args.model, "trim": args.trim, "fp32_mb": round(nbytes / MB, 1), "threads": torch.get_num_threads(),
        "first_step_s": round(first["s"], 4), "first_step_peak_rise_mb": round(first["peak_rise_mb"], 1),
        "median_s": round(statistics.median(r["s"] for r in with_copy), 4),
        "median_cpu_s": round(statistics.median(r["cpu_s"] for r in with_copy), 4),
        "median_peak_rise_mb": round(statistics.median(r["peak_rise_mb"] for r in with_copy), 1),
        "median_s_without_copy": round(statistics.median(r["s"] for r in alone), 4),
        "median_peak_rise_mb_without_copy": round(statistics.median(r["peak_rise_mb"] for r in alone), 1),
        "repeats_s": [round(r["s"], 4) for r in with_copy],
        "repeats_s_without_copy": [round(r["s"], 4) for r in alone],
    }))


if __name__ == "__main__":
    main()
