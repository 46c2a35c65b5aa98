"""Inner-step overhead of p2ptrain's training path against a plain PyTorch loop on the same model (issue: "<= 1%").

    python benchmarks/bench_step_overhead.py [--model hf-llama|small|tiny|FOLDER] [--batch-size 8] [--seq-len 256]
        [--steps 20] [--warmup 3] [--repeats 3] [--threads 2] [--grad-clip 1.0]

Two identically seeded copies of one model, built through p2ptrain's own path (``resolve_model`` and
``build_from_spec``, as a worker builds its model), train on the same fixed list of random token batches with the
same torch threads:

- plain: ``torch.optim.AdamW(lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95))``; per step ``_, loss = model(x, y);
  loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)``;
- p2ptrain: a ``DiLoCoOptimizer`` alone in a swarm of its own (a DHT on 127.0.0.1, a fresh run id) over an inner
  AdamW of the same hyperparameters, the optimizer a worker builds by default (fp16 compression, min group 2,
  apply_local), each step made by ``train_loop.train_step`` exactly as ``TrainLoop.run`` calls it (one
  micro-batch, no scaler, fp32, ``--grad-clip``). ``local_steps`` is far above the steps taken, so no sync falls in
  the measurement: this is the inner step alone (bench_sync.py measures syncs).

``--model hf-llama`` (default) is a small Hugging Face Llama (hidden 256, 4 layers, 4 heads, 2 KV heads,
intermediate 688, vocabulary 8192, context 256) whose config.json is written to a temporary folder here (no hub);
``small`` and ``tiny`` are the built-in GPTs; any other value goes to ``resolve_model`` as ``--model`` would.

The two loops alternate over ``--repeats`` rounds (the first loop of a round alternates too), each round
``--warmup`` untimed steps then ``--steps`` timed ones, so that drift on a shared CPU hits both alike. The swarm
(DHT and averager processes, the progress heartbeat thread) is up for the whole run, during the plain loop's rounds
too: the overhead is what the training thread pays; the CPU seconds the swarm's own processes used during the timed
windows are printed beside it. With ``--grad-clip`` the plain loop clips too (``clip_grad_norm_``), so that both do
the same arithmetic.

Prints progress to stderr; a markdown table and a one-line JSON summary to stdout: tokens/s per loop (median over
rounds), overhead % = (plain - p2ptrain) / plain x 100, and "CPU FLOP/s (6N)" = 6 x N x tokens/s, where N is the
parameters less the input embedding tables (an output layer tied to the embedding counts: its matmul is real work;
attention's sequence-length term is left out). The two models should take bit-identical steps (same arithmetic,
with or without clipping); the table says whether their final parameters are equal.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Callable, List, Tuple

import psutil
import torch

LLAMA_SHAPE = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                   intermediate_size=688, vocab_size=8192, max_position_embeddings=256, tie_word_embeddings=False)
INNER_ADAMW = dict(lr=4e-4, weight_decay=0.1, betas=(0.9, 0.95))  # DiLoCoConfig's defaults
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
NEVER_SYNC = 10**9
"""local_steps: no sync within any run of this benchmark"""


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def write_llama(folder: Path) -> str:
    """A fresh small Llama's config.json (no weights, no tokenizer) in ``folder``; returns the folder."""
    from transformers import LlamaConfig

    LlamaConfig(**LLAMA_SHAPE).save_pretrained(folder)
    return str(folder)


def flop_parameters(model: torch.nn.Module) -> int:
    """N of 6N: every parameter but the input embedding tables (an embedding tied to a Linear stays in)."""
    linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Linear)}
    tables = {id(m.weight): m.weight.numel() for m in model.modules()
              if isinstance(m, torch.nn.Embedding) and id(m.weight) not in linear_weights}
    return sum(p.numel() for p in model.parameters()) - sum(tables.values())


def make_batches(count: int, batch_size: int, seq_len: int, vocab_size: int, seed: int
                 ) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``count`` fixed (x, y) batches of random tokens, y being x shifted by one as the data pipeline makes them."""
    generator = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(count):
        seq = torch.randint(vocab_size, (batch_size, seq_len + 1), generator=generator)
        batches.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return batches


def swarm_cpu_s(processes: List[psutil.Process]) -> float:
    """CPU seconds used so far by this process's children (the DHT, its p2pd, the averager) and their children."""
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def settle(processes: List[psutil.Process], quiet_s: float = 0.02, poll_s: float = 0.5, limit_s: float = 20.0
           ) -> float:
    """Wait until the swarm's processes are done starting (under ``quiet_s`` CPU seconds per ``poll_s``, at most
    ``limit_s``), so that their start-up does not land in the first loop measured; returns the seconds waited."""
    started = time.perf_counter()
    last = swarm_cpu_s(processes)
    while time.perf_counter() - started < limit_s:
        time.sleep(poll_s)
        now = swarm_cpu_s(processes)
        if now - last < quiet_s:
            break
        last = now
    return time.perf_counter() - started


def timed_round(step: Callable[[torch.Tensor, torch.Tensor], None], batches, warmup: int
                ) -> List[float]:
    """Seconds of each step after the first ``warmup`` of ``batches``."""
    seconds = []
    for i, (x, y) in enumerate(batches):
        started = time.perf_counter()
        step(x, y)
        if i >= warmup:
            seconds.append(time.perf_counter() - started)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="hf-llama",
                        help="hf-llama (a small Llama built here), a built-in size (tiny, small, 124m), a Hugging "
                             "Face folder or a package.module:factory")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=None,
                        help="tokens per sequence (default: 256, or the model's context if shorter)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per loop and round")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per loop and round, before the timed")
    parser.add_argument("--repeats", type=int, default=3, help="rounds, each running both loops")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--grad-clip", type=float, default=None,
                        help="clip gradients to this global norm (both loops); default: no clipping")
    parser.add_argument("--seed", type=int, default=0, help="the models' init and the batches")
    args = parser.parse_args()
    if min(args.batch_size, args.steps, args.repeats, args.threads) < 1 or args.warmup < 0:
        parser.error("--batch-size, --steps, --repeats and --threads must be at least 1, --warmup at least 0")

    torch.set_num_threads(args.threads)
    from p2ptrain.diloco.optimizer import DiLoCoOptimizer
    from p2ptrain.model_source import build_from_spec, resolve_model
    from p2ptrain.outer import make_outer_optimizer
    from p2ptrain.swarm.dht import SwarmConfig, start_dht, stop_dht
    from p2ptrain.train_loop import train_step

    workdir = Path(tempfile.mkdtemp(prefix="p2ptrain-bench-step-"))
    dht = opt = None
    try:
        source = write_llama(workdir / "llama") if args.model == "hf-llama" else args.model
        seq_len = args.seq_len or min(256, resolve_model(source).seq_len)
        spec = resolve_model(source, seq_len)
        models = {name: build_from_spec(spec, seed=args.seed) for name in ("plain", "p2ptrain")}
        for model in models.values():
            model.train()  # as TrainLoop.run does
        n_params = sum(p.numel() for p in models["plain"].parameters())
        n_flop = flop_parameters(models["plain"])
        batches = make_batches(args.warmup + args.steps, args.batch_size, seq_len, spec.vocab_size, args.seed)
        tokens_per_step = args.batch_size * seq_len
        log(f"model={args.model} ({spec.identity}) params={n_params:,} N(6N)={n_flop:,} "
            f"batch={args.batch_size}x{seq_len} threads={torch.get_num_threads()} grad_clip={args.grad_clip}")

        plain_model = models["plain"]
        plain_opt = torch.optim.AdamW(plain_model.parameters(), **INNER_ADAMW)

        def plain_step(x: torch.Tensor, y: torch.Tensor) -> None:
            _, loss = plain_model(x, y)
            loss.backward()
            if args.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(plain_model.parameters(), args.grad_clip)
            plain_opt.step()
            plain_opt.zero_grad(set_to_none=True)

        started = time.perf_counter()
        dht = start_dht(SwarmConfig(host_maddrs=[LOOPBACK]))
        p2p_model = models["p2ptrain"]
        opt = DiLoCoOptimizer(p2p_model.parameters(), dht=dht, run_id=f"bench-step-{os.getpid()}-{secrets.token_hex(4)}",
                              local_steps=NEVER_SYNC, inner_optimizer=partial(torch.optim.AdamW, **INNER_ADAMW),
                              outer_optimizer=partial(make_outer_optimizer, lr=0.7, momentum=0.9),
                              batch_size=args.batch_size).start()
        children = psutil.Process().children(recursive=True)
        log(f"swarm of one up in {time.perf_counter() - started:.1f} s ({len(children)} child processes); quiet "
            f"after {settle(children):.1f} s more")
        device = torch.device("cpu")

        def p2ptrain_step(x: torch.Tensor, y: torch.Tensor) -> None:
            # TrainLoop.run's call for a one-process peer (rows: the whole batch; .to(cpu) a no-op)
            train_step(p2p_model, opt, x.to(device), y.to(device), micro_batches=1, scaler=None,
                       grad_clip=args.grad_clip, device=device, precision="fp32", batch_size=args.batch_size)

        loops = {"plain": plain_step, "p2ptrain": p2ptrain_step}
        step_s = {name: [] for name in loops}
        tokens_per_s = {name: [] for name in loops}
        swarm_cpu = {name: 0.0 for name in loops}
        timed_wall = {name: 0.0 for name in loops}
        for round_index in range(args.repeats):
            order = list(loops) if round_index % 2 == 0 else list(reversed(loops))
            for name in order:
                cpu_before, wall_before = swarm_cpu_s(children), time.perf_counter()
                seconds = timed_round(loops[name], batches, args.warmup)
                round_cpu, round_wall = swarm_cpu_s(children) - cpu_before, time.perf_counter() - wall_before
                swarm_cpu[name] += round_cpu
                timed_wall[name] += round_wall
                step_s[name] += seconds
                tokens_per_s[name].append(tokens_per_step * len(seconds) / sum(seconds))
                log(f"round {round_index + 1}/{args.repeats} {name:<8} {tokens_per_s[name][-1]:>10,.0f} tokens/s "
                    f"median step {1000 * statistics.median(seconds):.1f} ms, swarm processes "
                    f"{100 * round_cpu / round_wall:.1f}% of a core")
        if opt.outer_step != 0 or opt.history:
            raise RuntimeError("a sync happened during the measurement; raise NEVER_SYNC")
        max_diff = max((a - b).abs().max().item() for a, b in
                       zip(plain_model.parameters(), p2p_model.parameters(), strict=True))
    finally:
        if opt is not None:
            opt.close()
        if dht is not None:
            stop_dht(dht)
        shutil.rmtree(workdir, ignore_errors=True)

    median_tps = {name: statistics.median(values) for name, values in tokens_per_s.items()}
    overhead = (median_tps["plain"] - median_tps["p2ptrain"]) / median_tps["plain"] * 100
    median_step = {name: statistics.median(values) for name, values in step_s.items()}
    step_overhead = (median_step["p2ptrain"] - median_step["plain"]) / median_step["plain"] * 100
    # each round runs both loops back to back: the median of the rounds' own overheads cancels the drift between
    # rounds (a shared CPU's speed moves by 10% from minute to minute here), which the overall medians keep
    paired = statistics.median((plain - p2p) / plain * 100
                               for plain, p2p in zip(tokens_per_s["plain"], tokens_per_s["p2ptrain"]))
    flops = {name: 6 * n_flop * tps for name, tps in median_tps.items()}
    swarm_pct = {name: 100 * swarm_cpu[name] / timed_wall[name] for name in loops}

    print(f"\nmodel {args.model} ({spec.identity}): {n_params:,} parameters, N = {n_flop:,} without the input "
          f"embedding tables; batch {args.batch_size} x {seq_len} tokens; {torch.get_num_threads()} threads; "
          f"{args.repeats} rounds of {args.warmup} warm-up + {args.steps} timed steps per loop; "
          f"grad_clip {args.grad_clip}\n")
    print("| loop | tokens/s (median of rounds) | per round | median step ms | CPU FLOP/s (6N) | "
          "swarm processes' CPU |")
    print("|---|---:|---|---:|---:|---:|")
    for name in loops:
        rounds = ", ".join(f"{v:,.0f}" for v in tokens_per_s[name])
        print(f"| {name} | {median_tps[name]:,.0f} | {rounds} | {1000 * median_step[name]:.1f} | "
              f"{flops[name] / 1e9:.2f} GFLOP/s | {swarm_pct[name]:.1f}% of a core |")
    print(f"\noverhead (plain - p2ptrain) / plain: {overhead:+.2f}% of tokens/s "
          f"({step_overhead:+.2f}% by median step time; {paired:+.2f}% as the median of each round's own); "
          "target <= 1%")
    print(f"final parameters of the two models: {'identical' if max_diff == 0 else f'max |diff| {max_diff:.3g}'}")
    print(json.dumps({
        "bench": "step_overhead", "model": args.model, "identity": spec.identity, "params": n_params,
        "flop_params": n_flop, "batch_size": args.batch_size, "seq_len": seq_len, "threads": torch.get_num_threads(),
        "grad_clip": args.grad_clip, "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
        "plain_tokens_per_s": round(median_tps["plain"], 1), "p2ptrain_tokens_per_s": round(median_tps["p2ptrain"], 1),
        "overhead_pct": round(overhead, 3), "step_time_overhead_pct": round(step_overhead, 3),
        "paired_overhead_pct": round(paired, 3),
        "plain_flops_6n": round(flops["plain"]), "p2ptrain_flops_6n": round(flops["p2ptrain"]),
        "swarm_cpu_pct_of_core": {name: round(v, 2) for name, v in swarm_pct.items()},
        "params_identical": max_diff == 0, "max_param_diff": max_diff,
    }))


if __name__ == "__main__":
    main()
