"""``bench --convergence N --straggler-misses M``: what a peer that misses a round should do with its work.

The convergence experiment's blocking DiLoCo (every replica in one process, the swarm's optimizers and fp16 wire
rounding), with the last replica a straggler: its pseudo-gradient misses every M-th round (it reaches the sync
point after the others averaged). It then takes the swarm's state, as ``DiLoCoOptimizer`` does: the new global
parameters and a live peer's AdamW moments. What it does with the pseudo-gradient that missed the round:

- ``discard``: throws it away (what ``DiLoCoOptimizer`` does);
- ``fold``: adds it to its pseudo-gradient of the next round, weighted by the samples of both phases (error
  feedback's way of keeping what a round dropped);
- ``fold-1``: the same, weighted as one phase's samples;
- ``fold-mean``: the mean of the two phases' pseudo-gradients, weighted by the samples of both (each phase then
  counts as one member's would).

``none`` is the reference: nobody misses a round. Every policy runs on the same seeds; the loss is replica 0's eval
loss after the last round (which nobody misses, so every replica then holds the global parameters).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES

from p2ptrain.averaging.compression import get_compression
from p2ptrain.bench.replicas import Setup, inner_optimizer, inner_step, replica_data
from p2ptrain.config import DiLoCoConfig
from p2ptrain.data import evaluate
from p2ptrain.model import build_model
from p2ptrain.outer import group_average, make_outer_optimizer, merge_, outer_step_, pseudo_gradient_

POLICIES = ("none", "discard", "fold", "fold-1", "fold-mean")


def run_straggler(setup: Setup, local_steps: int, miss_every: int, policy: str,
                  cfg: DiLoCoConfig = DiLoCoConfig()) -> float:
    """Blocking DiLoCo over ``setup.steps`` inner steps in rounds of ``local_steps``; the last replica's
    pseudo-gradient misses every ``miss_every``-th round but the last, and is handled by ``policy``."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r}: one of {', '.join(POLICIES)}")
    if miss_every < 2:
        raise ValueError(f"miss_every {miss_every}: at least 2 (a straggler that misses every round never averages)")
    shards, held_out = replica_data(setup)
    codec = get_compression("fp16")
    models = [build_model(setup.model, seed=setup.seed) for _ in range(setup.peers)]
    inners = [inner_optimizer(m.parameters(), cfg) for m in models]
    global_params = [p.detach().clone().requires_grad_(True) for p in models[0].parameters()]
    outer = make_outer_optimizer(global_params, lr=cfg.outer_lr, momentum=cfg.outer_momentum)
    rounds = setup.steps // local_steps
    carried: Optional[List[torch.Tensor]] = None
    for r in range(1, rounds + 1):
        for _ in range(local_steps):
            inner_step(models, inners, shards)
        sent = []
        for model in models:
            pseudo_gradient = [torch.empty_like(g) for g in global_params]
            pseudo_gradient_(pseudo_gradient, global_params, list(model.parameters()))
            sent.append(pseudo_gradient)
        weights = [1.0] * len(models)
        if carried is not None:
            for mine, late in zip(sent[-1], carried):
                mine.add_(late)
            if policy == "fold-mean":
                for mine in sent[-1]:
                    mine.mul_(0.5)
            weights[-1] = 1.0 if policy == "fold-1" else 2.0
            carried = None
        missed = policy != "none" and r % miss_every == 0 and r < rounds
        if missed:
            carried = sent[-1] if policy != "discard" else None
            sent, weights = sent[:-1], weights[:-1]
        outer_step_(outer, global_params, group_average(sent, weights, codec, DEFAULT_PART_SIZE_BYTES))
        with torch.no_grad():
            for model in models:
                merge_(list(model.parameters()), global_params, 0.0)
        if missed:  # the state it takes carries a live peer's AdamW moments
            inners[-1].load_state_dict(inners[0].state_dict())
    return evaluate(models[0], held_out)


def run_stragglers(setup: Setup, local_steps: int, miss_every: int, seeds: Sequence[int], out: Path,
                   echo: Callable[[str], None] = print) -> Path:
    """Every policy on every seed; writes straggler.json and straggler.md in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    losses: Dict[str, Dict[int, float]] = {policy: {} for policy in POLICIES}
    for seed in seeds:
        for policy in POLICIES:
            started = time.perf_counter()
            loss = run_straggler(Setup(**{**setup.__dict__, "seed": seed}), local_steps, miss_every, policy)
            losses[policy][seed] = loss
            echo(f"straggler: seed {seed}, {policy}: eval loss {loss:.4f} ({time.perf_counter() - started:.0f}s)")
            (out / "straggler.json").write_text(json.dumps(
                {"setup": setup.__dict__, "local_steps": local_steps, "miss_every": miss_every,
                 "losses": losses}, indent=1))
    path = out / "straggler.md"
    path.write_text("\n".join(straggler_table(losses, setup, local_steps, miss_every)) + "\n")
    return path


def straggler_table(losses: Dict[str, Dict[int, float]], setup: Setup, local_steps: int,
                    miss_every: int) -> List[str]:
    """Eval loss per policy and seed, with the mean and the mean change against ``none`` (nobody misses)."""
    seeds = sorted({seed for row in losses.values() for seed in row})
    lines = [f"The last of {setup.peers} replicas misses one round in every {miss_every} ({setup.model} model, "
             f"{setup.steps} inner steps, H = {local_steps}, fp16); eval loss of replica 0:", "",
             "| policy | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | vs none |",
             "|---|" + "---:|" * (len(seeds) + 2)]
    base = losses.get("none", {})
    for policy, row in losses.items():
        if not row:
            continue
        changes = [row[s] / base[s] - 1 for s in seeds if s in row and s in base]
        change = f"{100 * statistics.fmean(changes):+.2f}%" if changes else "-"
        lines.append(f"| {policy} | " + " | ".join(f"{row[s]:.4f}" if s in row else "-" for s in seeds)
                     + f" | {statistics.fmean(row.values()):.4f} | {change} |")
    return lines
