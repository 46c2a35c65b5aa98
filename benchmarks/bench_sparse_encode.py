"""Seconds of one sparse (SparseLoCo) message's encode where the accumulator lives, the CPU or a GPU (issue 37).

    python benchmarks/bench_sparse_encode.py --model small --device cpu --repeats 5
    python benchmarks/bench_sparse_encode.py --model 124m --device cuda --check-cpu --json encode.json

The accumulator is a model's parameters' shapes (``--model``: a built-in size, a Hugging Face folder, a factory)
filled with normal noise, on ``--device``. Each repeat times ``encode`` (the message and what it decodes to) and
then ``send_`` (that and the accumulator's update), synchronizing the device around each; the first call, a warm-up,
is left out. ``--check-cpu`` also encodes the same values on the CPU and checks the two messages are the same bytes
(averaging/sparse.py, "Devices"), and times the CPU's encode. Prints one line; ``--json`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from p2ptrain.averaging.sparse import DEFAULT_K, Layout, encode, send_
from p2ptrain.model_source import build_from_spec, resolve_model


def _timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def measure(model: str, device: str, repeats: int = 3, k: int = DEFAULT_K, check_cpu: bool = False) -> dict:
    """The figures of ``model``'s shapes encoded on ``device`` (see the module's docstring)."""
    dev = torch.device(device)
    shapes = [tuple(p.shape) for p in build_from_spec(resolve_model(model), seed=0).parameters()]
    layout = Layout(tuple(shapes), k=k)
    gen = torch.Generator().manual_seed(0)
    host = [torch.randn(shape, generator=gen) for shape in shapes]
    accumulator = [t.to(dev) for t in host]
    message, _ = encode(accumulator, layout)  # the warm-up: the device's kernels and allocator
    encode_s = [_timed(lambda: encode(accumulator, layout), dev) for _ in range(repeats)]
    send_s = []
    for _ in range(repeats):
        copy = [t.clone() for t in accumulator]
        send_s.append(_timed(lambda: send_(copy, layout), dev))
    figures = dict(model=model, device=str(dev), device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda"
                   else "cpu", params=sum(t.numel() for t in host), k=k, torch_threads=torch.get_num_threads(),
                   message_bytes=len(message), fp16_bytes=layout.dense_fp16_bytes, repeats=repeats,
                   encode_s=statistics.median(encode_s), encode_best_s=min(encode_s),
                   send_s=statistics.median(send_s), send_best_s=min(send_s))
    if check_cpu:
        cpu_message, _ = encode(host, layout)
        figures.update(cpu_encode_s=_timed(lambda: encode(host, layout), torch.device("cpu")),
                       same_bytes_as_cpu=cpu_message == message)
    return figures


def describe(f: dict) -> str:
    line = (f"sparse encode: {f['model']} ({f['params'] / 1e6:.1f}M params, k={f['k']}) on {f['device_name']}: "
            f"encode {f['encode_s'] * 1000:.1f} ms (best {f['encode_best_s'] * 1000:.1f}), send_ "
            f"{f['send_s'] * 1000:.1f} ms; message {f['message_bytes']:,} bytes = "
            f"{f['message_bytes'] / f['fp16_bytes']:.2%} of fp16")
    if "cpu_encode_s" in f:
        line += f"; the CPU's encode {f['cpu_encode_s'] * 1000:.0f} ms, same bytes: {f['same_bytes_as_cpu']}"
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="built-in size, Hugging Face folder or package.module:factory")
    parser.add_argument("--device", default="cpu", help="where the accumulator lives: cpu or cuda")
    parser.add_argument("--repeats", type=int, default=3, help="timed encodes (and send_s) after the warm-up")
    parser.add_argument("--k", type=int, default=DEFAULT_K, help="values kept per chunk of 4096")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--check-cpu", action="store_true", help="also encode on the CPU: same bytes, and its time")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device here; run on a GPU machine or use --device cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    figures = measure(args.model, args.device, args.repeats, args.k, args.check_cpu)
    print(describe(figures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    if args.check_cpu and not figures["same_bytes_as_cpu"]:
        print(f"Error: the {args.device} encode's bytes differ from the CPU's", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
