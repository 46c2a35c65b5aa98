"""Throughput, MFU and peak memory of one 1-GPU peer training a model in bf16 (issues 4 and 37).

    python benchmarks/bench_gpu.py --model 124m --batch-size 16 --steps 60 --local-steps 20
    python benchmarks/bench_gpu.py --model path/to/hf_folder --compile --json mfu.json

A real peer (its own hivemind DHT and averager, alone in its run, so every sync applies its own pseudo-gradient)
trains ``--model`` (a built-in size, a Hugging Face folder with a config.json, or ``package.module:factory``) on the
built-in corpus with bf16 autocast, as ``p2ptrain join --device cuda`` does; ``--compile`` compiles the model first,
as ``p2ptrain join --compile`` does (``train_loop.compile_model``: ``nn.Module.compile``, in place). Prints one line
per phase and a summary:

- tokens/s of the inner steps alone (syncs excluded), after ``--warmup`` steps (with ``--compile``, the compile
  happens in the first of them);
- MFU = 6 x parameters x tokens/s / the GPU's dense bf16 peak (attention FLOPs left out, as in the issue's
  formula), and the same with attention's 12 x layers x width x sequence FLOPs per token added; the peak comes from
  a table of known GPUs or ``--peak-tflops``;
- peak GPU memory (torch.cuda.max_memory_allocated and _reserved) against the start-up estimate (memory.py);
- seconds per sync (device -> host copy, outer step, host -> device), which a real swarm adds every H steps.

Needs CUDA; exits 2 with a one-line message without it. ``--device cpu`` runs the same on the CPU, to check the
script itself (no MFU: the CPU has no peak in the table).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from functools import partial
from typing import Optional

import hivemind
import torch

from p2ptrain import DiLoCoOptimizer
from p2ptrain.data import ShardedBatches, load_corpus, split_train_val
from p2ptrain.memory import GiB, estimate_memory
from p2ptrain.model_source import build_from_spec, resolve_model

# dense bf16 tensor-core peaks (no sparsity), TFLOP/s, by a fragment of torch.cuda.get_device_name()
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H100": 756.0,
                    "A100": 312.0, "L40S": 362.0, "A10G": 70.0, "RTX 4090": 165.2}


def peak_tflops(name: str) -> float | None:
    for fragment, tflops in PEAK_BF16_TFLOPS.items():
        if fragment in name:
            return tflops
    return None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(model_source: str, device: str = "cuda", batch_size: int = 16, steps: int = 60, warmup: int = 10,
            local_steps: int = 20, compile_backend: Optional[str] = None, activation_checkpointing: bool = False,
            peak: Optional[float] = None, log=print) -> dict:
    """Train ``model_source`` for ``warmup + steps`` inner steps as a lone peer; the figures of the module's
    docstring, as a dict. ``compile_backend``: torch.compile the model first with this backend (None: not)."""
    dev = torch.device(device)
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    peak = peak or peak_tflops(name)
    torch.backends.cuda.matmul.allow_tf32 = True
    spec = resolve_model(model_source)
    model = build_from_spec(spec, seed=0).to(dev)
    model.activation_checkpointing = activation_checkpointing
    if compile_backend:  # train_loop.compile_model, with the backend named (the smoke test's is "eager")
        model.compile(backend=compile_backend)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    n_params = sum(p.numel() for p in model.parameters())
    block = spec.seq_len
    train, _ = split_train_val(load_corpus(None))
    batches = ShardedBatches(train, block_size=block, batch_size=batch_size, shard_index=0, num_shards=1)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    opt = DiLoCoOptimizer(model.parameters(), dht=dht, run_id="bench-gpu", local_steps=local_steps,
                          inner_optimizer=partial(torch.optim.AdamW, lr=4e-4, weight_decay=0.1, fused=True),
                          outer_optimizer=partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
                          no_group_policy="apply_local", matchmaking_time_s=1.0, batch_size=batch_size).start()
    step_s, sync_s, first_step_s = [], [], None
    try:
        for i in range(warmup + steps):
            x, y = next(batches)
            x, y = x.to(dev, non_blocking=True), y.to(dev, non_blocking=True)
            _sync(dev)
            started = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
            will_sync = (opt.local_step + 1) % local_steps == 0
            opt.step()
            opt.zero_grad(set_to_none=True)
            _sync(dev)
            elapsed = time.perf_counter() - started
            first_step_s = elapsed if first_step_s is None else first_step_s
            if will_sync:
                sync_s.append(opt.history[-1].seconds)
            if i >= warmup:
                # an inner step's own time: the sync's seconds (measured by the optimizer) taken out
                step_s.append(elapsed - (opt.history[-1].seconds if will_sync else 0.0))
            if i % 10 == 0:
                log(f"step {i:4d} loss {loss.item():.4f} {elapsed * 1000:.0f} ms")
    finally:
        opt.close()
        dht.shutdown()

    step = sum(step_s) / len(step_s)
    tokens_per_s = batch_size * block / step
    attention_flops = 12 * spec.n_layer * spec.n_embd * block  # per token, forward and backward (PaLM's appendix B)
    estimate = estimate_memory(spec, batch_size, 1, 1, dev.type, activation_checkpointing)
    return dict(
        gpu=name, model=model_source, params=n_params, batch_size=batch_size, seq_len=block,
        compile=compile_backend, activation_checkpointing=activation_checkpointing, steps=len(step_s),
        first_step_s=first_step_s, step_ms=1000 * step, tokens_per_s=tokens_per_s, peak_tflops=peak,
        mfu=6 * n_params * tokens_per_s / (peak * 1e12) if peak else None,
        mfu_with_attention=(6 * n_params + attention_flops) * tokens_per_s / (peak * 1e12) if peak else None,
        peak_memory_allocated_gib=torch.cuda.max_memory_allocated(dev) / GiB if dev.type == "cuda" else None,
        peak_memory_reserved_gib=torch.cuda.max_memory_reserved(dev) / GiB if dev.type == "cuda" else None,
        estimated_per_rank_gib=estimate.rank_bytes / GiB,
        syncs=len(sync_s), mean_sync_s=sum(sync_s) / len(sync_s) if sync_s else None,
    )


def describe(f: dict) -> str:
    mfu = f"{f['mfu']:.1%} ({f['mfu_with_attention']:.1%} with attention)" if f["mfu"] is not None else "unknown"
    memory = (f"peak memory {f['peak_memory_allocated_gib']:.2f} GiB allocated, "
              f"{f['peak_memory_reserved_gib']:.2f} reserved" if f["peak_memory_allocated_gib"] is not None else "")
    return (f"{f['model']} ({f['params'] / 1e6:.1f}M params) on {f['gpu']}, bf16, compile={f['compile'] or 'no'}, "
            f"batch {f['batch_size']}x{f['seq_len']}: {f['tokens_per_s']:,.0f} tokens/s, {f['step_ms']:.1f} ms a "
            f"step (first {f['first_step_s']:.1f} s), MFU {mfu} of {f['peak_tflops']} TFLOP/s; {memory} "
            f"(estimated {f['estimated_per_rank_gib']:.2f}); "
            + (f"{f['syncs']} syncs of {f['mean_sync_s']:.2f} s (alone: no network transfer)" if f["syncs"] else
               "no sync"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="124m", help="built-in size, Hugging Face folder or package.module:factory")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60, help="inner steps measured (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--local-steps", type=int, default=20, help="H: a sync every H inner steps")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model, as p2ptrain join --compile")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile's backend with --compile")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not known")
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to check the script")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("Error: bench_gpu needs a CUDA GPU; run it on a GPU machine", file=sys.stderr)
        sys.exit(2)
    figures = measure(args.model, args.device, args.batch_size, args.steps, args.warmup, args.local_steps,
                      args.compile_backend if args.compile else None, args.activation_checkpointing, args.peak_tflops,
                      log=lambda line: print(line, flush=True))
    print(describe(figures))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
