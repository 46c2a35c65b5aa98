"""The convergence experiment, in one process: what DiLoCo's math gives against a lone peer and data-parallel.

At the same number of inner steps per peer, on the built-in model and corpus:

- ``alone``: one peer, its own shard, batch B;
- ``data_parallel``: one model, every step the mean gradient of one batch from each of the K shards (K x B);
- ``diloco``: K replicas, each on its own shard; every H steps the mean pseudo-gradient, rounded as the wire rounds
  it (each sender's parts through the codec, then the average through it again, as ``ExactAllReduceRunner`` does;
  int8 with error feedback), goes to an outer SGD with Nesterov momentum; every replica restarts from the result.

The optimizers and their settings are the swarm's (``DiLoCoConfig`` defaults), so a swarm of K real peers with the
same settings should land where ``diloco`` does (the swarm must not be worse than its own math).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES

from p2ptrain.averaging.compression import ERROR_FEEDBACK_BY_DEFAULT, get_compression
from p2ptrain.config import DiLoCoConfig
from p2ptrain.data import ShardedBatches, eval_batches, evaluate, load_corpus, split_train_val
from p2ptrain.model import build_model
from p2ptrain.fragments import FragmentPlan
from p2ptrain.outer import (add_error_feedback_, group_average, make_outer_optimizer, merge_, outer_step_,
                            pseudo_gradient_)


@dataclass(frozen=True)
class Setup:
    model: str = "tiny"
    peers: int = 4
    batch_size: int = 16
    steps: int = 600
    seed: int = 0
    eval_batches: int = 8  # held-out batches; the swarm's workers are given the same


def _inner(params, cfg: DiLoCoConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=cfg.inner_lr, weight_decay=cfg.inner_weight_decay,
                             betas=tuple(cfg.inner_betas))


def _data(setup: Setup):
    train, val = split_train_val(load_corpus(None))
    block = build_model(setup.model).config.block_size
    shards = [ShardedBatches(train, block_size=block, batch_size=setup.batch_size, shard_index=i,
                             num_shards=setup.peers, seed=setup.seed) for i in range(setup.peers)]
    return shards, eval_batches(val, block, setup.batch_size, setup.eval_batches)


def run_alone(setup: Setup, cfg: DiLoCoConfig = DiLoCoConfig()) -> float:
    shards, held_out = _data(setup)
    model = build_model(setup.model, seed=setup.seed)
    opt = _inner(model.parameters(), cfg)
    for _ in range(setup.steps):
        x, y = next(shards[0])
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    return evaluate(model, held_out)


def run_data_parallel(setup: Setup, cfg: DiLoCoConfig = DiLoCoConfig()) -> float:
    shards, held_out = _data(setup)
    model = build_model(setup.model, seed=setup.seed)
    opt = _inner(model.parameters(), cfg)
    for _ in range(setup.steps):
        for shard in shards:  # gradient accumulation: the mean over K batches
            x, y = next(shard)
            (model(x, y)[1] / len(shards)).backward()
        opt.step()
        opt.zero_grad()
    return evaluate(model, held_out)


def run_diloco(setup: Setup, local_steps: int, compression: str = "fp16",
               cfg: DiLoCoConfig = DiLoCoConfig(), fragments: int = 1, overlap_steps: int = 0,
               evaluate_mean: bool = False) -> float:
    """Every replica in this process; the round is p2ptrain.outer's, the one the swarm's optimizer runs. With
    ``fragments`` > 1 or ``overlap_steps`` > 0, Streaming DiLoCo as the swarm runs it (p2ptrain/fragments.py): each
    fragment's pseudo-gradients taken at its launch step, averaged and applied at its apply step, and merged into
    every replica with ``cfg.merge_alpha``; 1 and 0: plain DiLoCo. The loss is the first replica's, or with
    ``evaluate_mean`` the mean of the replicas' parameters' (for streaming, whose fragments other than the last end
    the run with local progress no round averaged: the blocking sync's last step leaves every replica equal)."""
    shards, held_out = _data(setup)
    codec = get_compression(compression)
    feedback = compression in ERROR_FEEDBACK_BY_DEFAULT
    models = [build_model(setup.model, seed=setup.seed) for _ in range(setup.peers)]
    inners = [_inner(m.parameters(), cfg) for m in models]
    global_params = [p.detach().clone().requires_grad_(True) for p in models[0].parameters()]
    outer = make_outer_optimizer(global_params, lr=cfg.outer_lr, momentum=cfg.outer_momentum)
    residuals = [[torch.zeros_like(g) for g in global_params] for _ in models] if feedback else None
    plan = FragmentPlan.build([g.numel() for g in global_params], local_steps, fragments, overlap_steps,
                              cfg.merge_alpha)
    alpha = plan.merge_alpha if plan.overlap_steps > 0 else 0.0
    pending: Dict[int, list] = {}  # fragment -> the replicas' pseudo-gradients of it, taken at its launch step
    for step in range(1, setup.steps + 1):
        for model, inner, shard in zip(models, inners, shards):
            x, y = next(shard)
            model(x, y)[1].backward()
            inner.step()
            inner.zero_grad()
        launch = plan.due(step, plan.launch_at)
        if launch is not None:
            indices = plan.tensors[launch]
            pending[launch] = []
            for i, model in enumerate(models):
                params = list(model.parameters())
                sent = [torch.empty_like(global_params[t]) for t in indices]
                pseudo_gradient_(sent, [global_params[t] for t in indices], [params[t] for t in indices])
                if residuals is not None:
                    add_error_feedback_(sent, [residuals[i][t] for t in indices], codec, DEFAULT_PART_SIZE_BYTES)
                pending[launch].append(sent)
        apply = plan.due(step, plan.apply_at)
        if apply is not None:
            indices = plan.tensors[apply]
            # every replica trained on the same number of samples since the last round: equal weights
            average = group_average(pending.pop(apply), [1.0] * len(models), codec, DEFAULT_PART_SIZE_BYTES)
            fragment = [global_params[t] for t in indices]
            outer_step_(outer, fragment, average)  # SGD steps only the tensors given a gradient
            for model in models:
                params = list(model.parameters())
                merge_([params[t] for t in indices], fragment, alpha)
    loss = evaluate(models[0], held_out)
    if evaluate_mean:
        with torch.no_grad():
            for values in zip(*(m.parameters() for m in models)):
                values[0].copy_(torch.stack(values).mean(0))
        loss = evaluate(models[0], held_out)
    return loss


def run_swarm(setup: Setup, local_steps: int, compression: str, out: Path, fragments: int = 1,
              overlap_steps: int = 0) -> float:
    """The same DiLoCo run by real `p2ptrain join` daemons on loopback (one per shard): peer 1's final eval loss."""
    from p2ptrain.bench.swarm import BenchConfig, run_config

    if setup.steps % local_steps:
        raise ValueError(f"{setup.steps} steps are not a whole number of rounds of H={local_steps}")
    cfg = BenchConfig(model=setup.model, peers=setup.peers, rate_mbit=None, local_steps=local_steps,
                      outer_steps=setup.steps // local_steps, compression=compression, batch_size=setup.batch_size,
                      eval_batches=setup.eval_batches, fragments=fragments, overlap_steps=overlap_steps)
    result = run_config(cfg, out / f"convergence-swarm-{setup.steps}-{cfg.name}", None, progress=lambda _: None)
    return result["peers"][0]["final_eval_loss"]


def experiment(lengths: List[int], local_steps: List[int], compressions: List[str], setup: Setup = Setup(),
               echo: Callable[[str], None] = print, swarm_out: Optional[Path] = None,
               streaming: Sequence[tuple] = ()) -> Dict:
    """Final eval losses of alone, data-parallel and DiLoCo (each H and codec), at each run length; with
    ``swarm_out``, also the real swarm for the largest H and the first codec (its logs go there). ``streaming``:
    (fragments, overlap steps or None for the most allowed) schedules, each a Streaming DiLoCo row for every H and
    codec, and (with ``swarm_out``) a real swarm row with it."""
    results: Dict = {"setup": setup.__dict__, "runs": []}
    for steps in lengths:
        s = Setup(**{**setup.__dict__, "steps": steps})
        runs = [("alone", None, None, lambda: run_alone(s)),
                ("data_parallel", None, None, lambda: run_data_parallel(s))]
        runs += [(f"diloco H={h} {c}", h, c, (lambda h=h, c=c: run_diloco(s, h, c)))
                 for h in local_steps for c in compressions]
        schedules = [(f, h // f - 1 if tau is None else tau, h) for f, tau in streaming for h in local_steps
                     if (f, tau) != (1, 0)]
        # streaming rows are judged on the mean of the replicas: at the end every fragment but the last holds local
        # progress no round averaged, which a blocking sync's last step leaves none of (one replica's own model
        # was 1-2% worse for that alone)
        runs += [(f"streaming H={h} {c} F={f} tau={tau}", h, c,
                  (lambda h=h, c=c, f=f, tau=tau: run_diloco(s, h, c, fragments=f, overlap_steps=tau,
                                                             evaluate_mean=True)))
                 for f, tau, h in schedules for c in compressions]
        if swarm_out is not None:
            h, c = max(local_steps), compressions[0]
            runs.append((f"swarm H={h} {c} ({s.peers} join daemons)", h, c, lambda h=h, c=c: run_swarm(s, h, c,
                                                                                                       swarm_out)))
            for f, tau, _ in [x for x in schedules if x[2] == h]:
                runs.append((f"swarm H={h} {c} F={f} tau={tau} ({s.peers} join daemons)", h, c,
                             lambda h=h, c=c, f=f, tau=tau: run_swarm(s, h, c, swarm_out, f, tau)))
        for name, h, c, fn in runs:
            started = time.perf_counter()
            loss = fn()
            results["runs"].append({"name": name, "steps": steps, "local_steps": h, "compression": c,
                                    "eval_loss": loss, "seconds": time.perf_counter() - started})
            echo(f"  {steps} steps, {name}: eval loss {loss:.4f} ({time.perf_counter() - started:.0f}s)")
    return results


def convergence_table(results: Dict) -> List[str]:
    """Final eval loss per run (rows) and length (columns); for DiLoCo and the swarm also the share of the gap
    between training alone and data-parallel training that they close (100%: as good as data-parallel)."""
    lengths = sorted({r["steps"] for r in results["runs"]})
    names = list(dict.fromkeys(r["name"] for r in results["runs"]))
    loss: Dict[tuple, Optional[float]] = {(r["name"], r["steps"]): r["eval_loss"] for r in results["runs"]}

    def cell(name: str, steps: int) -> str:
        value = loss.get((name, steps))
        if value is None:
            return "n/a"
        alone, dp = loss.get(("alone", steps)), loss.get(("data_parallel", steps))
        if name in ("alone", "data_parallel") or alone is None or dp is None or alone == dp:
            return f"{value:.5f}"
        return f"{value:.5f} ({(alone - value) / (alone - dp):.0%})"

    lines = ["| run | " + " | ".join(f"{n} steps" for n in lengths) + " |",
             "|---|" + "---:|" * len(lengths)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(cell(name, n) for n in lengths) + " |")
    lines += ["", "In brackets: the share of the gap from training alone to data-parallel training that the run "
                  "closes."]
    return lines


def write_convergence(lengths: List[int], local_steps: List[int], compressions: List[str], setup: Setup, out: Path,
                      echo: Callable[[str], None] = print, streaming: Sequence[tuple] = ()) -> Path:
    """Run the experiment (the swarm included) and write ``out/convergence.md`` and ``out/convergence.json``."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    results = experiment(lengths, local_steps, compressions, setup, echo=echo, swarm_out=out, streaming=streaming)
    (out / "convergence.json").write_text(json.dumps(results, indent=1))
    lines = ["# Convergence: alone, data-parallel and DiLoCo at the same inner steps per peer", "",
             f"Model {setup.model}, {setup.peers} peers (data-parallel: {setup.peers} x batch {setup.batch_size}), "
             "the swarm's default optimizer settings; final eval loss on the held-out batches.", "",
             *convergence_table(results), ""]
    (out / "convergence.md").write_text("\n".join(lines))
    return out / "convergence.md"
