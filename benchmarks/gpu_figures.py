"""Issue 37's GPU figures in one command: MFU of two ~125M models with and without torch.compile, the sync split of
the 124M model on the device, and the sparse top-k encode on the device.

    python benchmarks/gpu_figures.py --out docs/bench/DATE-gpu          # on a machine with one CUDA GPU, ~6-8 min
    python benchmarks/gpu_figures.py --smoke --out /tmp/gpu-smoke       # on the CPU at tiny sizes, to check it

Each piece runs in this process, one after the other, within its own time limit and the whole run's ``--budget-s``
(the pieces are ordered cheapest first; what does not fit is skipped, and said so). A piece that cannot run prints
one line (``FAILED <piece>: <why>``) and the others go on; the exit status is 1 if any failed. Each piece writes
``<out>/<piece>.json``; ``<out>/figures.json`` holds them all, and the table is printed at the end.

- ``encode``: ``bench_sparse_encode.measure`` of the 124M model's shapes on the GPU, and on the CPU to check the
  bytes are the same (averaging/sparse.py, "Devices");
- ``mfu-124m``, ``mfu-llama``, ``mfu-124m-compile``, ``mfu-llama-compile``: ``bench_gpu.measure``, a lone peer
  training in bf16, of the built-in 124m and of a Llama built from ``<out>/llama-125m/config.json`` (written here
  from transformers' LlamaConfig: hidden 768, 12 layers of 12 heads, intermediate 2048, vocabulary 32000, untied;
  134M parameters; no hub access), with and without ``torch.compile`` (inductor);
- ``sync-1``, ``sync-2``: ``bench_sync``'s peers (one process each, loopback), fp16, the 124M model on the GPU, 1 then
  2 peers: each sync's phases (the outer step where the optimizer keeps it); ``sync-sparse-2``: the same with
  ``--compression sparse`` (the accumulator's top-k where the optimizer keeps the accumulator);
- ``cpu-gate-small``, ``cpu-gate-124m``: issue 37's loopback gate on the machine's CPUs (2 peers, fp16, the 25M and
  124M models): the all-reduce's MB/s against raw P2P streams measured just before, and the sync's split.

The device machine has no network: carry a wheelhouse for Python 3.11 with ``pip download -d wheelhouse`` of
``torch`` (a CUDA build; it pulls ``triton`` and the ``nvidia-*`` CUDA wheels), ``hivemind==1.1.12`` (its
dependencies: base58, configargparse, cryptography, grpcio-tools, idna, msgpack, netaddr, numpy, packaging,
prefetch_generator, protobuf, py-cid, py-multihash, pydantic, PyYAML, scipy, sortedcontainers, uvloop, varint),
``transformers`` (huggingface-hub, regex, safetensors, tokenizers, tqdm, typer), and p2ptrain's own requirements
(setup.cfg: click, tqdm, psutil, cryptography, xxhash, blake3, protobuf>=7.35.1); install with ``pip install
--no-index --find-links wheelhouse`` and ``pip install --no-deps -e .``. ``--compile`` needs a C compiler (Triton
builds its launcher with one) and hivemind's ``p2pd`` binary (shipped in its wheel).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import bench_sync  # light at import: torch, hivemind and p2ptrain come in inside its functions

# torch, bench_gpu and bench_sparse_encode are imported inside the functions: bench_sync's peers and its manager are
# spawned processes, which import this module first, and need none of them from here

LLAMA_125M = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                  intermediate_size=2048, vocab_size=32000, max_position_embeddings=1024, tie_word_embeddings=False)
LLAMA_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  intermediate_size=128, vocab_size=512, max_position_embeddings=64, tie_word_embeddings=False)


class PieceTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float):
    """Raise PieceTimeout in this (the main) thread after ``seconds``; the piece's ``finally`` blocks still run. An
    alarm set before (pytest-timeout's) is put back, less the time spent here."""
    def expire(signum, frame):
        raise PieceTimeout(f"past its {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    started = time.monotonic()
    outer_s = signal.alarm(max(1, round(seconds)))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        if outer_s:
            signal.alarm(max(1, round(outer_s - (time.monotonic() - started))))


def write_llama_config(folder: Path, shape: dict) -> str:
    """A Hugging Face Llama folder with only a config.json: p2ptrain builds it from the seed (model_source.py)."""
    from transformers import LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    LlamaConfig(**shape).save_pretrained(folder)
    return str(folder)


def end_children() -> None:
    """A timed-out sync leaves its peer processes, with their DHT, averager and p2pd: end them, each by its handle
    (all are this process's descendants)."""
    import psutil

    for child in mp.active_children():
        try:
            tree = [*psutil.Process(child.pid).children(recursive=True), psutil.Process(child.pid)]
        except psutil.NoSuchProcess:
            continue
        for proc in tree:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(tree, timeout=10)


def sync_piece(model: str, device: str, peers: int, syncs: int, compression: str, ceiling=None) -> dict:
    """bench_sync's peers, as ``bench_sync.py --model M --device D --peers N --syncs S --no-ceiling`` runs them (the
    all-reduce's share of ``ceiling``, raw P2P streams' MB/s, where one is given)."""
    args = dict(model=model, device=device, peers=peers, syncs=syncs, compression=compression, threads=1, mlp=None,
                defaults=False)
    try:
        results = bench_sync.run_syncs(args)
    except BaseException:
        end_children()
        raise
    row = bench_sync.summarize(results, ceiling, skip_first=syncs > 1)
    row.update(model=model, compression=compression, device=device)
    return row


def cpu_gate_piece(model: str, syncs: int) -> dict:
    """Issue 37's loopback gate on the device machine's CPUs, where each peer and its p2pd have cores of their own
    (on a 2-core machine the all-reduce is bound by the CPU): ``bench_sync.py --model M --peers 2 --syncs S``, its
    transport ceiling measured first, fp16, on the CPU."""
    try:
        ceiling = bench_sync.transport_ceiling(2, 512)
    except BaseException:
        end_children()
        raise
    return sync_piece(model, "cpu", 2, syncs, "fp16", ceiling)


def plan(args, out: Path) -> List[Tuple[str, int, Callable[[], dict]]]:
    """(name, time limit in seconds, what measures it), cheapest first."""
    import bench_gpu
    import bench_sparse_encode

    smoke = args.smoke
    device = "cpu" if smoke else "cuda"
    builtin = "tiny" if smoke else "124m"
    def llama() -> str:  # in the pieces: without transformers they fail, and the others run
        return write_llama_config(out / ("llama-tiny" if smoke else "llama-125m"), LLAMA_TINY if smoke else LLAMA_125M)

    backend = "eager" if smoke else "inductor"  # the smoke test checks the path, not inductor's codegen
    train = dict(device=device, batch_size=2 if smoke else args.batch_size, steps=1 if smoke else args.steps,
                 warmup=0 if smoke else 5, local_steps=1000 if smoke else 15)  # one sync on the GPU, none in smoke
    syncs = 1 if smoke else 3

    def mfu(model: Callable[[], str], compile_backend=None):
        return lambda: bench_gpu.measure(model(), compile_backend=compile_backend, **train)

    pieces = [
        ("encode", 120, lambda: bench_sparse_encode.measure(builtin, device, repeats=1 if smoke else 3,
                                                            check_cpu=True)),
        ("mfu-124m", 120, mfu(lambda: builtin)),
        ("mfu-llama", 120, mfu(llama)),
        ("sync-1", 120, lambda: sync_piece(builtin, device, 1, syncs, "fp16")),
        ("sync-2", 150, lambda: sync_piece(builtin, device, 2, syncs, "fp16")),
        ("mfu-124m-compile", 240, mfu(lambda: builtin, backend)),
        ("mfu-llama-compile", 240, mfu(llama, backend)),
        ("sync-sparse-2", 150, lambda: sync_piece(builtin, device, 2, syncs, "sparse")),
        ("cpu-gate-small", 120, lambda: cpu_gate_piece("tiny" if smoke else "small", 2 if smoke else 8)),
        ("cpu-gate-124m", 200, lambda: cpu_gate_piece(builtin, 2 if smoke else 6)),
    ]
    if smoke:  # one of each kind: the pieces a smoke run leaves out only differ from these in their arguments
        pieces = [p for p in pieces if p[0] in ("encode", "mfu-124m", "mfu-llama-compile", "sync-2", "cpu-gate-small")]
    return pieces


def summary(name: str, f: dict) -> str:
    if name == "encode":
        return (f"{f['params'] / 1e6:.1f}M values: encode {f['encode_s'] * 1000:.1f} ms, send_ "
                f"{f['send_s'] * 1000:.1f} ms on {f['device_name']}; the CPU's encode "
                f"{f['cpu_encode_s'] * 1000:.0f} ms; same bytes: {f['same_bytes_as_cpu']}")
    if name.startswith("mfu"):
        mfu = f"MFU {f['mfu']:.1%} ({f['mfu_with_attention']:.1%} w/ attn)" if f["mfu"] is not None else "MFU -"
        memory = f", peak {f['peak_memory_allocated_gib']:.1f} GiB" if f["peak_memory_allocated_gib"] else ""
        return (f"{f['params'] / 1e6:.1f}M params, {f['batch_size']}x{f['seq_len']}: {f['tokens_per_s']:,.0f} "
                f"tokens/s, {f['step_ms']:.1f} ms/step (first {f['first_step_s']:.1f} s), {mfu}{memory}")
    gate = (f"; all-reduce {f['allreduce_mb_s']:.0f} MB/s = {f['of_ceiling']:.0%} of the {f['ceiling_mb_s']:.0f} MB/s "
            f"ceiling" if f.get("of_ceiling") is not None else "")
    split = ", ".join(f"{phase} {f['split'][phase]:.3f}" for phase in bench_sync.PHASES if f["split"][phase] >= 0.0005)
    return f"{f['peers']} peer(s), {f['compression']}: sync {f['seconds']:.3f} s = {split}{gate}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the JSON files (made if missing)")
    parser.add_argument("--smoke", action="store_true", help="on the CPU at tiny sizes: checks the script, no figures")
    parser.add_argument("--budget-s", type=int, default=480, help="the whole run's seconds; pieces past it are skipped")
    parser.add_argument("--batch-size", type=int, default=16, help="MFU: sequences per inner step")
    parser.add_argument("--steps", type=int, default=20, help="MFU: inner steps measured, after 5 of warm-up")
    args = parser.parse_args(argv)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("Error: gpu_figures needs a CUDA GPU (or --smoke, on the CPU)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    figures: Dict[str, dict] = {}
    rows = []
    for name, limit_s, measure in plan(args, out):
        left_s = max(0.0, args.budget_s - (time.perf_counter() - started))
        if left_s < min(limit_s, 30):
            rows.append((name, 0.0, f"SKIPPED: {left_s:.0f} s of --budget-s left"))
            print(f"SKIPPED {name}: {left_s:.0f} s of --budget-s left", flush=True)
            continue
        print(f"--- {name}", flush=True)
        piece_started = time.perf_counter()
        try:
            with time_limit(min(limit_s, left_s)):
                result = measure()
        except Exception as e:  # PieceTimeout too
            why = (str(e).strip().splitlines() or [""])[0][:200]
            rows.append((name, time.perf_counter() - piece_started, f"FAILED: {type(e).__name__}: {why}"))
            print(f"FAILED {name}: {type(e).__name__}: {why}", flush=True)
            continue
        finally:
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        seconds = time.perf_counter() - piece_started
        figures[name] = dict(result, piece_s=seconds)
        (out / f"{name}.json").write_text(json.dumps(figures[name], indent=1))
        rows.append((name, seconds, summary(name, result)))
        print(f"{name}: {rows[-1][2]}", flush=True)
    (out / "figures.json").write_text(json.dumps(dict(smoke=args.smoke, torch=torch.__version__, pieces=figures,
                                                      total_s=time.perf_counter() - started), indent=1))
    print(f"\n{'piece':<18} {'s':>6}  result")
    for name, seconds, text in rows:
        print(f"{name:<18} {seconds:6.1f}  {text}")
    print(f"wrote {out}/figures.json in {time.perf_counter() - started:.0f} s")
    return 0 if len(figures) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
