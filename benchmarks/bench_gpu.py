"""Throughput, MFU and peak memory of one 1-GPU peer training the 124M model in bf16 (issue 4).

    python benchmarks/bench_gpu.py --model 124m --batch-size 16 --steps 60 --local-steps 20

A real peer (its own hivemind DHT and averager, alone in its run, so every sync applies its own pseudo-gradient)
trains the built-in model on the built-in corpus with bf16 autocast, as `p2ptrain join --device cuda` does.
Prints one line per phase and a summary:

- tokens/s of the inner steps alone (syncs excluded), after ``--warmup`` steps;
- MFU = 6 x parameters x tokens/s / the GPU's dense bf16 peak (attention FLOPs left out, as in the issue's
  formula); the peak comes from a table of known GPUs or ``--peak-tflops``;
- peak GPU memory (torch.cuda.max_memory_allocated and _reserved) against the start-up estimate (memory.py);
- seconds per sync (device -> host copy, outer step, host -> device), which a real swarm adds every H steps.

Needs CUDA; exits 2 with a one-line message without it.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

import hivemind
import torch

from p2ptrain import DiLoCoOptimizer
from p2ptrain.data import ShardedBatches, load_corpus, split_train_val
from p2ptrain.memory import GiB, estimate_memory
from p2ptrain.model import build_model, model_config

# dense bf16 tensor-core peaks (no sparsity), TFLOP/s, by a fragment of torch.cuda.get_device_name()
PEAK_BF16_TFLOPS = {"H200": 989.4, "H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "H100 PCIe": 756.0, "H100": 756.0,
                    "A100": 312.0, "L40S": 362.0, "A10G": 70.0, "RTX 4090": 165.2}


def peak_tflops(name: str) -> float | None:
    for fragment, tflops in PEAK_BF16_TFLOPS.items():
        if fragment in name:
            return tflops
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="124m")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=60, help="inner steps measured (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--local-steps", type=int, default=20, help="H: a sync every H inner steps")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak, if not known")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("Error: bench_gpu needs a CUDA GPU; run it on a GPU machine", file=sys.stderr)
        sys.exit(2)

    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    peak = args.peak_tflops or peak_tflops(name)
    torch.backends.cuda.matmul.allow_tf32 = True
    model = build_model(args.model, seed=0).to(device)
    model.activation_checkpointing = args.activation_checkpointing
    n_params = model.num_parameters()
    block = model.config.block_size
    train, _ = split_train_val(load_corpus(None))
    batches = ShardedBatches(train, block_size=block, batch_size=args.batch_size, shard_index=0, num_shards=1)
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    opt = DiLoCoOptimizer(model.parameters(), dht=dht, run_id="bench-gpu", local_steps=args.local_steps,
                          inner_optimizer=partial(torch.optim.AdamW, lr=4e-4, weight_decay=0.1, fused=True),
                          outer_optimizer=partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
                          no_group_policy="apply_local", matchmaking_time_s=1.0, batch_size=args.batch_size).start()
    step_s, sync_s = [], []
    try:
        for i in range(args.warmup + args.steps):
            x, y = next(batches)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                _, loss = model(x, y)
            loss.backward()
            will_sync = (opt.local_step + 1) % args.local_steps == 0
            opt.step()
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            elapsed = time.perf_counter() - started
            if will_sync:
                sync_s.append(opt.history[-1].seconds)
            if i >= args.warmup:
                # an inner step's own time: the sync's seconds (measured by the optimizer) taken out
                step_s.append(elapsed - (opt.history[-1].seconds if will_sync else 0.0))
            if i % 10 == 0:
                print(f"step {i:4d} loss {loss.item():.4f} {elapsed * 1000:.0f} ms", flush=True)
    finally:
        opt.close()
        dht.shutdown()

    tokens_per_s = args.batch_size * block / (sum(step_s) / len(step_s))
    mfu = 6 * n_params * tokens_per_s / (peak * 1e12) if peak else None
    estimate = estimate_memory(model_config(args.model), args.batch_size, 1, 1, "cuda", args.activation_checkpointing)
    print(f"gpu={name} model={args.model} params={n_params:,} batch={args.batch_size}x{block} tokens "
          f"activation_checkpointing={args.activation_checkpointing}")
    print(f"tokens_per_s={tokens_per_s:,.0f} step_ms={1000 * sum(step_s) / len(step_s):.1f} "
          f"mfu={'%.1f%%' % (100 * mfu) if mfu is not None else 'unknown (pass --peak-tflops)'} "
          f"(6*N*tokens/s over {peak} TFLOP/s bf16)")
    print(f"peak_memory_allocated={torch.cuda.max_memory_allocated(device) / GiB:.2f}GiB "
          f"peak_memory_reserved={torch.cuda.max_memory_reserved(device) / GiB:.2f}GiB "
          f"estimated_per_rank={estimate.rank_bytes / GiB:.2f}GiB")
    if sync_s:
        print(f"syncs={len(sync_s)} mean_sync_s={sum(sync_s) / len(sync_s):.2f} (alone: no network transfer)")


if __name__ == "__main__":
    main()
