"""The convergence experiment's sparse rows: SparseLoCo's round (p2ptrain/averaging/sparse.py) in one process.

K replicas, each on its own shard with its own inner AdamW, as in ``convergence.run_diloco``; every H steps each
replica adds its pseudo-gradient to its decayed error-feedback accumulator, packs the top-k of each chunk of it in
2 bits (the very bytes a peer would send), keeps what the message did not carry, and the decoded messages,
averaged per entry over the replicas whose message carried it (as SparseLoCo's reference does: divided by all K,
an entry one replica sent moved the model by a K-th of it, and 4 replicas at H = 15 ended worse than one alone,
2.306 against 2.228), go to a plain outer SGD step on the shared global parameters; every replica restarts from
them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import torch

from p2ptrain.averaging.sparse import DEFAULT_DECAY, DEFAULT_K, DEFAULT_OUTER_LR, Layout, accumulate_, send_
from p2ptrain.bench.replicas import Setup, inner_optimizer, inner_step, replica_data
from p2ptrain.config import DiLoCoConfig
from p2ptrain.data import evaluate
from p2ptrain.model import build_model
from p2ptrain.outer import merge_, pseudo_gradient_


def sparse_name(local_steps: int, k: int) -> str:
    return f"sparse H={local_steps} k={k}"


def run_sparse(setup: Setup, local_steps: int, k: int = DEFAULT_K, decay: float = DEFAULT_DECAY,
               outer_lr: float = DEFAULT_OUTER_LR, cfg: DiLoCoConfig = DiLoCoConfig()) -> Dict:
    """Returns ``eval_loss`` (replica 0's model: every replica holds the global parameters after a round),
    ``message_bytes`` (one peer's message per sync, the mean over the peers and syncs: the places' code makes each
    message's size its own), ``twelve_bit_bytes`` (the same message with every place in 12 bits), ``fp16_bytes``
    (its pseudo-gradient in fp16, what the dense fp16 codec encodes), ``syncs``, ``kept`` (values in one message)
    and ``union`` (per n, the mean over the syncs of how many entries the first n replicas' messages cover together:
    how far their top-k sets overlap, which decides what a sparse all-reduce moves)."""
    shards, held_out = replica_data(setup)
    models = [build_model(setup.model, seed=setup.seed) for _ in range(setup.peers)]
    inners = [inner_optimizer(m.parameters(), cfg) for m in models]
    global_params = [p.detach().clone() for p in models[0].parameters()]
    layout = Layout(tuple(tuple(g.shape) for g in global_params), k=k)
    accumulators = [[torch.zeros_like(g) for g in global_params] for _ in models]
    sent = [torch.empty_like(g) for g in global_params]
    syncs, message_bytes = 0, 0
    union = [0.0] * len(models)  # entries kept by any of the first n replicas, summed over the syncs
    for step in range(1, setup.steps + 1):
        inner_step(models, inners, shards)
        if step % local_steps:
            continue
        total = [torch.zeros_like(g) for g in global_params]
        kept = [torch.zeros(g.shape, dtype=torch.bool) for g in global_params]
        senders = [torch.zeros_like(g) for g in global_params]
        for n, (model, accumulator) in enumerate(zip(models, accumulators)):
            pseudo_gradient_(sent, global_params, list(model.parameters()))
            accumulate_(accumulator, sent, decay)
            message, carried = send_(accumulator, layout)
            assert layout.min_message_bytes <= len(message) <= layout.max_message_bytes
            message_bytes += len(message)
            for t, c, mask, count in zip(total, carried, kept, senders):
                t.add_(c)
                mask |= c != 0
                count += c != 0
            union[n] += sum(int(mask.sum()) for mask in kept)
        with torch.no_grad():  # each entry's mean over the replicas whose message carried it
            for g, t, count in zip(global_params, total, senders):
                g.sub_(t / count.clamp(min=1), alpha=outer_lr)
            for model in models:
                merge_(list(model.parameters()), global_params, 0.0)
        syncs += 1
    kept = sum(layout.counts)
    return {"eval_loss": evaluate(models[0], held_out),
            "message_bytes": message_bytes / (syncs * len(models)) if syncs else layout.max_message_bytes,
            "twelve_bit_bytes": 4 * layout.num_chunks + 3 * -(-kept // 2) + -(-kept // 4),
            "fp16_bytes": layout.dense_fp16_bytes, "syncs": syncs, "kept": kept,
            "union": [u / max(syncs, 1) for u in union]}


DENSE_BYTES_PER_VALUE = {"none": 4.0, "fp16": 2.0, "bf16": 2.0, "int8": 1.0 + 4.0 / 1024}
"""what one peer's pseudo-gradient message costs per parameter with each dense codec (compression.py)"""


def _message_bytes(run: Dict, parameters: int) -> Optional[float]:
    if "message_bytes" in run:
        return float(run["message_bytes"])
    per_value = DENSE_BYTES_PER_VALUE.get(run.get("compression") or "")
    if per_value is None or not str(run["name"]).startswith("diloco H=") or "mixing" in run["name"]:
        return None
    return per_value * parameters


def byte_rows(results: Dict, setup: Setup) -> List[Dict]:
    """The DiLoCo and sparse rows with one peer's message per sync, its share of fp16's, and the run's total."""
    parameters = sum(p.numel() for p in build_model(setup.model).parameters())
    rows = []
    for run in results["runs"]:
        per_sync = _message_bytes(run, parameters)
        if per_sync is None or not run.get("local_steps"):
            continue
        syncs = run["steps"] // run["local_steps"]
        rows.append({"name": run["name"], "steps": run["steps"], "eval_loss": run["eval_loss"],
                     "per_sync": per_sync, "fp16_share": per_sync / (2.0 * parameters), "syncs": syncs,
                     "total": per_sync * syncs})
    return rows


def bytes_table(results: Dict, setup: Setup) -> List[str]:
    rows = byte_rows(results, setup)
    lines = ["| run | steps | eval loss | bytes per peer per sync | of fp16's | syncs | bytes in all |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['steps']} | {r['eval_loss']:.5f} | {r['per_sync'] / 1e3:,.1f} kB | "
                     f"{r['fp16_share']:.2%} | {r['syncs']} | {r['total'] / 1e6:,.2f} MB |")
    lines += ["", "Bytes: one peer's pseudo-gradient message as its codec encodes it (sparse: the packed top-k "
                  "message: two fp16 scales per chunk, 2-bit values, Rice-coded places; the mean over its syncs), "
                  "not what a round's all-reduce moves around it."]
    return lines


def plot_loss_per_byte(results: Dict, setup: Setup, out: Path) -> Path:
    """Eval loss against the bytes one peer's messages came to over the run, a point per run and length."""
    from p2ptrain.observe import require

    require("matplotlib", extra="bench", feature="p2ptrain bench --convergence's plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7.5, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    for r in byte_rows(results, setup):
        ax.scatter([r["total"] / 1e6], [r["eval_loss"]], marker="o" if r["name"].startswith("sparse") else "s")
        ax.annotate(f"{r['name']} ({r['steps']})", (r["total"] / 1e6, r["eval_loss"]), fontsize=7,
                    textcoords="offset points", xytext=(4, 3))
    ax.set_xscale("log")
    ax.set_xlabel("MB one peer sent over the run (its messages, log scale)")
    ax.set_ylabel("final eval loss")
    ax.grid(alpha=0.3)
    path = out / "loss_per_byte.png"
    figure.savefig(path, dpi=110)
    return path
