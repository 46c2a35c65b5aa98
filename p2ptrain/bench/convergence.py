"""The convergence experiment, in one process: what DiLoCo's math gives against a lone peer and data-parallel.

At the same number of inner steps per peer, on the built-in model and corpus:

- ``alone``: one peer, its own shard, batch B;
- ``data_parallel``: one model, every step the mean gradient of one batch from each of the K shards (K x B);
- ``diloco``: K replicas, each on its own shard; every H steps the mean pseudo-gradient, rounded as the wire rounds
  it (each sender's parts through the codec, then the average through it again, as ``ExactAllReduceRunner`` does;
  int8 with error feedback), goes to an outer SGD with Nesterov momentum; every replica restarts from the result;
- ``diloco, groups of G (mixing)``: the same K replicas, each with global parameters and an outer optimizer of its
  own, averaging in Moshpit mixing groups of at most G (``p2ptrain.mixing``) as a swarm with ``--target-group-size``
  G below its size does: a group whose members hold the same global parameters runs the round above, one whose
  members come from different groups of the last round averages their stepped states (``outer.stepped_state_``).

The optimizers and their settings are the swarm's (``DiLoCoConfig`` defaults), so a swarm of K real peers with the
same settings should land where ``diloco`` does (the swarm must not be worse than its own math).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Union

import torch
from hivemind.averaging.partition import DEFAULT_PART_SIZE_BYTES

from p2ptrain.averaging.compression import ERROR_FEEDBACK_BY_DEFAULT, WireCodec, get_compression
from p2ptrain.bench.replicas import Setup, inner_optimizer, inner_step, replica_data
from p2ptrain.config import DiLoCoConfig
from p2ptrain.data import evaluate
from p2ptrain.model import build_model
from p2ptrain.fragments import FragmentPlan
from p2ptrain.mixing import groups_of
from p2ptrain.outer import (add_error_feedback_, group_average, load_stepped_state_, make_outer_optimizer, merge_,
                            momentum_buffers, outer_step_, pseudo_gradient_, stepped_state_)


def run_alone(setup: Setup, cfg: DiLoCoConfig = DiLoCoConfig()) -> float:
    shards, held_out = replica_data(setup)
    model = build_model(setup.model, seed=setup.seed)
    opt = inner_optimizer(model.parameters(), cfg)
    for _ in range(setup.steps):
        x, y = next(shards[0])
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()
    return evaluate(model, held_out)


def run_data_parallel(setup: Setup, cfg: DiLoCoConfig = DiLoCoConfig()) -> float:
    shards, held_out = replica_data(setup)
    model = build_model(setup.model, seed=setup.seed)
    opt = inner_optimizer(model.parameters(), cfg)
    for _ in range(setup.steps):
        for shard in shards:  # gradient accumulation: the mean over K batches
            x, y = next(shard)
            (model(x, y)[1] / len(shards)).backward()
        opt.step()
        opt.zero_grad()
    return evaluate(model, held_out)


def run_diloco(setup: Setup, local_steps: int, compression: str = "fp16",
               cfg: DiLoCoConfig = DiLoCoConfig(), fragments: int = 1, overlap_steps: int = 0,
               evaluate_mean: bool = False, aggregation: str = "mean",
               attacks: Optional[Dict[int, Callable[[List[torch.Tensor]], List[torch.Tensor]]]] = None,
               data_attacks: Optional[Dict[int, Callable[[Iterator], Iterator]]] = None,
               observe: Optional[Callable[[List[List[torch.Tensor]]], None]] = None,
               admit: Optional[Callable[[List[List[torch.Tensor]]], List[bool]]] = None,
               phase_start: Optional[Callable[[list, list, list], None]] = None) -> float:
    """Every replica in this process; the round is p2ptrain.outer's, the one the swarm's optimizer runs. With
    ``fragments`` > 1 or ``overlap_steps`` > 0, Streaming DiLoCo as the swarm runs it (p2ptrain/fragments.py): each
    fragment's pseudo-gradients taken at its launch step, averaged and applied at its apply step, and merged into
    every replica with ``cfg.merge_alpha``; 1 and 0: plain DiLoCo. The loss is the first replica's, or with
    ``evaluate_mean`` the mean of the replicas' parameters' (for streaming, whose fragments other than the last end
    the run with local progress no round averaged: the blocking sync's last step leaves every replica equal).
    ``aggregation``: the reducers' rule (``robust.py``); ``attacks``: replica index -> what that replica sends
    instead of its pseudo-gradient; ``data_attacks``: replica index -> what that replica makes of its shard's batches
    to train on (the others train honestly on theirs); the loss is the first replica's, an honest one. ``observe``:
    called with every round's pseudo-gradients as sent, one list of tensors per replica; ``admit``: with the same,
    which of them the round averages (a sender check, ``sender_check.py``; the others are left out); ``phase_start``:
    called with the models, inner optimizers and shards (unattacked) at the start of every phase (a replay audit)."""
    claimed, held_out = replica_data(setup)
    shards = [data_attacks[i](s) if data_attacks and i in data_attacks else s for i, s in enumerate(claimed)]
    codec = get_compression(compression)
    feedback = compression in ERROR_FEEDBACK_BY_DEFAULT
    models = [build_model(setup.model, seed=setup.seed) for _ in range(setup.peers)]
    inners = [inner_optimizer(m.parameters(), cfg) for m in models]
    global_params = [p.detach().clone().requires_grad_(True) for p in models[0].parameters()]
    outer = make_outer_optimizer(global_params, lr=cfg.outer_lr, momentum=cfg.outer_momentum)
    residuals = [[torch.zeros_like(g) for g in global_params] for _ in models] if feedback else None
    plan = FragmentPlan.build([g.numel() for g in global_params], local_steps, fragments, overlap_steps,
                              cfg.merge_alpha)
    alpha = plan.merge_alpha if plan.overlap_steps > 0 else 0.0
    pending: Dict[int, list] = {}  # fragment -> the replicas' pseudo-gradients of it, taken at its launch step
    if phase_start is not None:
        phase_start(models, inners, claimed)
    for step in range(1, setup.steps + 1):
        inner_step(models, inners, shards)
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
                if attacks and i in attacks:
                    sent = attacks[i](sent)
                pending[launch].append(sent)
        apply = plan.due(step, plan.apply_at)
        if apply is not None:
            indices = plan.tensors[apply]
            if observe is not None:
                observe(pending[apply])
            sent = pending.pop(apply)
            if admit is not None:
                sent = [tensors for tensors, kept in zip(sent, admit(sent)) if kept]
            # every replica trained on the same number of samples since the last round: equal weights
            average = group_average(sent, [1.0] * len(sent), codec, DEFAULT_PART_SIZE_BYTES, aggregation)
            fragment = [global_params[t] for t in indices]
            outer_step_(outer, fragment, average)  # steps only the fragment's tensors
            for model in models:
                params = list(model.parameters())
                merge_([params[t] for t in indices], fragment, alpha)
            if phase_start is not None:
                phase_start(models, inners, claimed)
    loss = evaluate(models[0], held_out)
    if evaluate_mean:
        with torch.no_grad():
            for values in zip(*(m.parameters() for m in models)):
                values[0].copy_(torch.stack(values).mean(0))
        loss = evaluate(models[0], held_out)
    return loss


def _spread(states: Sequence[Sequence[torch.Tensor]]) -> float:
    """max over replicas of ||theta_i - mean theta|| / ||mean theta||, all tensors of a replica as one vector."""
    with torch.no_grad():
        means = [torch.stack([t.double() for t in tensors]).mean(0) for tensors in zip(*states)]
        mean_norm = sum(float(m.square().sum()) for m in means) ** 0.5
        distance = max(sum(float((t.double() - m).square().sum()) for t, m in zip(tensors, means)) ** 0.5
                       for tensors in states)
    return distance / mean_norm if mean_norm else 0.0


def mixing_round_(groups: Sequence[Sequence[int]], global_params: Sequence[Sequence[torch.Tensor]],
                  outers: Sequence[torch.optim.Optimizer], sent: Sequence[Sequence[torch.Tensor]],
                  residuals: Optional[Sequence[Sequence[torch.Tensor]]], codec: WireCodec,
                  cfg: DiLoCoConfig) -> int:
    """One round of mixing groups over replicas that each keep global parameters and an outer optimizer of their own
    (``groups``: the replicas' indices, one list per group; ``sent[i]``: replica i's pseudo-gradient; ``residuals``:
    the error-feedback residuals, or None). A group whose members hold bit-identical global parameters averages the
    pseudo-gradients through the codec (``group_average``, equal weights) and every member takes the outer step
    with the average; any other group averages its members' stepped states (``stepped_state_`` with their own
    momenta and pseudo-gradients plus residuals, which are spent: nothing is rounded) in fp32 and every member
    loads the mean (``load_stepped_state_``). Returns how many groups averaged stepped states."""
    mixed = 0
    for members in groups:
        first = global_params[members[0]]
        if all(torch.equal(a, b) for i in members[1:] for a, b in zip(first, global_params[i], strict=True)):
            if residuals is not None:
                for i in members:
                    add_error_feedback_(sent[i], residuals[i], codec, DEFAULT_PART_SIZE_BYTES)
            # every replica trained on the same number of samples since the last round: equal weights
            average = group_average([sent[i] for i in members], [1.0] * len(members), codec, DEFAULT_PART_SIZE_BYTES)
            for i in members:
                outer_step_(outers[i], global_params[i], [a.clone() for a in average])
            continue
        mixed += 1
        stepped = []
        for i in members:
            if residuals is not None:
                for buffer, residual in zip(sent[i], residuals[i], strict=True):
                    buffer.add_(residual)
                    residual.zero_()
            out_params = [torch.empty_like(g) for g in global_params[i]]
            out_momenta = [torch.empty_like(g) for g in global_params[i]]
            stepped_state_(out_params, out_momenta, global_params[i], momentum_buffers(outers[i], global_params[i]),
                           sent[i], cfg.outer_lr, cfg.outer_momentum)
            stepped.append((out_params, out_momenta))
        with torch.no_grad():
            mean_params = [torch.stack(ts).mean(0) for ts in zip(*(p for p, _ in stepped))]
            mean_momenta = [torch.stack(ts).mean(0) for ts in zip(*(m for _, m in stepped))]
        for i in members:
            load_stepped_state_(outers[i], global_params[i], mean_params, mean_momenta)
    return mixed


def run_mixing(setup: Setup, local_steps: int, group_size: Optional[int], compression: str = "fp16",
               cfg: DiLoCoConfig = DiLoCoConfig()) -> Dict:
    """DiLoCo in mixing groups of at most ``group_size``, as a swarm of ``setup.peers`` runs it when its groups are
    smaller than the swarm: every replica keeps global parameters and an outer optimizer of its own; round t (the
    t-th sync, from 0) averages within ``mixing.groups_of`` of the peers ``peer000``, ``peer001``, ... A group whose
    members hold bit-identical global parameters runs ``run_diloco``'s round (the pseudo-gradients' ``group_average``
    through the codec, then the outer step); any other group takes every member's own outer step alone
    (``outer.stepped_state_``: its global parameters, outer momentum and pseudo-gradient, plus its error-feedback
    residual, which is then spent: nothing is rounded), averages the stepped parameters and momenta in fp32 with
    equal weights, and every member loads the mean (``outer.load_stepped_state_``). Inner training and data are
    ``run_diloco``'s; with ``group_size`` >= the peers (one group, always identical) the result is its loss, bit for
    bit.

    Returns ``eval_loss`` (replica 0's model), ``mean_eval_loss`` (the mean of the replicas' global parameters),
    ``spread`` per round (after it: max over replicas of ||theta_i - mean theta|| / ||mean theta||, theta the
    global parameters), ``mixed_groups`` per round (the groups that averaged stepped states) and ``groups`` per
    round (how many)."""
    shards, held_out = replica_data(setup)
    codec = get_compression(compression)
    feedback = compression in ERROR_FEEDBACK_BY_DEFAULT
    models = [build_model(setup.model, seed=setup.seed) for _ in range(setup.peers)]
    inners = [inner_optimizer(m.parameters(), cfg) for m in models]
    global_params = [[p.detach().clone().requires_grad_(True) for p in m.parameters()] for m in models]
    outers = [make_outer_optimizer(g, lr=cfg.outer_lr, momentum=cfg.outer_momentum) for g in global_params]
    residuals = [[torch.zeros_like(g) for g in globals_] for globals_ in global_params] if feedback else None
    peer_ids = [f"peer{i:03d}" for i in range(setup.peers)]
    index = {peer: i for i, peer in enumerate(peer_ids)}
    spread: List[float] = []
    mixed_groups: List[int] = []
    group_counts: List[int] = []
    for step in range(1, setup.steps + 1):
        inner_step(models, inners, shards)
        if step % local_steps:
            continue
        sent = []
        for i, model in enumerate(models):
            sent.append([torch.empty_like(g) for g in global_params[i]])
            pseudo_gradient_(sent[i], global_params[i], list(model.parameters()))
        groups = groups_of(peer_ids, group_size, len(spread))
        mixed = mixing_round_([[index[peer] for peer in group] for group in groups], global_params, outers, sent,
                              residuals, codec, cfg)
        for model, globals_ in zip(models, global_params):
            merge_(list(model.parameters()), globals_, 0.0)
        spread.append(_spread(global_params))
        mixed_groups.append(mixed)
        group_counts.append(len(groups))
    loss = evaluate(models[0], held_out)
    with torch.no_grad():
        for p, values in zip(models[0].parameters(), zip(*global_params)):
            p.copy_(torch.stack(values).mean(0))
    return {"eval_loss": loss, "mean_eval_loss": evaluate(models[0], held_out), "spread": spread,
            "mixed_groups": mixed_groups, "groups": group_counts}


def run_swarm(setup: Setup, local_steps: int, compression: str, out: Path, fragments: int = 1,
              overlap_steps: int = 0) -> float:
    """The same DiLoCo run by real `p2ptrain join` daemons on loopback (one per shard): peer 1's final eval loss."""
    from p2ptrain.bench.swarm import BenchConfig, run_config

    if setup.steps % local_steps:
        raise ValueError(f"{setup.steps} steps are not a whole number of rounds of H={local_steps}")
    cfg = BenchConfig(model=setup.model, peers=setup.peers, rate_mbit=None, local_steps=local_steps,
                      outer_steps=setup.steps // local_steps, compression=compression, batch_size=setup.batch_size,
                      eval_batches=setup.eval_batches, fragments=fragments, overlap_steps=overlap_steps,
                      # the simulation takes H inner steps per peer and phase; on a loaded host the pace had a peer
                      # read 1.21x slower twice and take 8 of 10, and the swarm ran other math (CI)
                      adaptive_steps=False)
    result = run_config(cfg, out / f"convergence-swarm-{setup.steps}-{cfg.name}", None, progress=lambda _: None)
    return result["peers"][0]["final_eval_loss"]


def mixing_name(local_steps: int, compression: str, group_size: int) -> str:
    """The row of ``run_mixing`` with groups of at most ``group_size`` (next to ``diloco H=.. codec``)."""
    return f"diloco H={local_steps} {compression}, groups of {group_size} (mixing)"


def experiment(lengths: List[int], local_steps: List[int], compressions: List[str], setup: Setup = Setup(),
               echo: Callable[[str], None] = print, swarm_out: Optional[Path] = None,
               streaming: Sequence[tuple] = (), mixing: Sequence[int] = (), sparse: Sequence[int] = ()) -> Dict:
    """Final eval losses of alone, data-parallel and DiLoCo (each H and codec), at each run length; with
    ``swarm_out``, also the real swarm for the largest H and the first codec (its logs go there), and with k = 128
    among ``sparse``, the real swarm's ``--compression sparse`` at the smallest H. ``streaming``:
    (fragments, overlap steps or None for the most allowed) schedules, each a Streaming DiLoCo row for every H and
    codec, and (with ``swarm_out``) a real swarm row with it. ``mixing``: group sizes G, each a row of DiLoCo in
    mixing groups of at most G (``run_mixing``) after every H and codec's one-group row, with the replicas' spread
    per round and the loss of their mean in the report. ``sparse``: values kept per chunk k, each a row of
    SparseLoCo's round (``convergence_sparse.run_sparse``) after every H's one-group rows."""
    from p2ptrain.averaging.sparse import DEFAULT_K
    from p2ptrain.bench.convergence_sparse import run_sparse, sparse_name

    results: Dict = {"setup": setup.__dict__, "runs": []}
    for steps in lengths:
        s = Setup(**{**setup.__dict__, "steps": steps})
        runs: List[tuple] = [("alone", None, None, lambda: run_alone(s)),
                             ("data_parallel", None, None, lambda: run_data_parallel(s))]
        for h in local_steps:
            for c in compressions:
                runs.append((f"diloco H={h} {c}", h, c, (lambda h=h, c=c: run_diloco(s, h, c))))
                runs += [(mixing_name(h, c, g), h, c, (lambda h=h, c=c, g=g: run_mixing(s, h, g, c)))
                         for g in mixing]
            runs += [(sparse_name(h, k), h, "sparse", (lambda h=h, k=k: run_sparse(s, h, k))) for k in sparse]
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
            if DEFAULT_K in sparse:  # the swarm's --compression sparse (its default k) where the sparse rows pay
                h = min(local_steps)
                runs.append((f"swarm H={h} sparse k={DEFAULT_K} ({s.peers} join daemons)", h, "sparse",
                             lambda h=h: run_swarm(s, h, "sparse", swarm_out)))
        for name, h, c, fn in runs:
            started = time.perf_counter()
            outcome: Union[float, Dict] = fn()
            extra = outcome if isinstance(outcome, dict) else {"eval_loss": outcome}
            loss = extra["eval_loss"]
            results["runs"].append({"name": name, "steps": steps, "local_steps": h, "compression": c, **extra,
                                    "seconds": time.perf_counter() - started})
            mean = f", mean of the replicas {extra['mean_eval_loss']:.4f}" if "mean_eval_loss" in extra else ""
            echo(f"  {steps} steps, {name}: eval loss {loss:.4f}{mean} ({time.perf_counter() - started:.0f}s)")
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


def mixing_table(results: Dict) -> List[str]:
    """The mixing rows (``run_mixing``): the first replica's loss and the loss of the replicas' mean, and how far
    apart the replicas' global parameters are after the rounds (max ||theta_i - mean|| / ||mean||); empty without
    mixing rows."""
    rows = [r for r in results["runs"] if "spread" in r]
    if not rows:
        return []
    lines = ["| run | steps | rounds | eval loss (replica 0) | eval loss (mean of replicas) | spread: max | "
             "spread: last 4 rounds, mean | spread: last round | rounds averaging stepped states |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        spread, tail = r["spread"], r["spread"][-4:]
        stepped = sum(1 for m in r["mixed_groups"] if m)
        lines.append(f"| {r['name']} | {r['steps']} | {len(spread)} | {r['eval_loss']:.5f} | "
                     f"{r['mean_eval_loss']:.5f} | {max(spread, default=0.0):.2e} | "
                     f"{(sum(tail) / len(tail) if tail else 0.0):.2e} | {(spread[-1] if spread else 0.0):.2e} | "
                     f"{stepped} |")
    lines += ["", "Spread: max over the replicas of ||theta_i - mean theta|| / ||mean theta||, theta the global "
                  "parameters after a round (0: one model). Per round in the JSON report (`spread`)."]
    return lines


def write_convergence(lengths: List[int], local_steps: List[int], compressions: List[str], setup: Setup, out: Path,
                      echo: Callable[[str], None] = print, streaming: Sequence[tuple] = (),
                      mixing: Sequence[int] = (), swarm: bool = True, sparse: Sequence[int] = ()) -> Path:
    """Run the experiment (the swarm included unless not ``swarm``) and write ``out/convergence.md`` and
    ``out/convergence.json``."""
    import json

    out.mkdir(parents=True, exist_ok=True)
    results = experiment(lengths, local_steps, compressions, setup, echo=echo, swarm_out=out if swarm else None,
                         streaming=streaming, mixing=mixing, sparse=sparse)
    (out / "convergence.json").write_text(json.dumps(results, indent=1))
    lines = ["# Convergence: alone, data-parallel and DiLoCo at the same inner steps per peer", "",
             f"Model {setup.model}, {setup.peers} peers (data-parallel: {setup.peers} x batch {setup.batch_size}), "
             "the swarm's default optimizer settings; final eval loss on the held-out batches.", "",
             *convergence_table(results), ""]
    mixing_lines = mixing_table(results)
    if mixing_lines:
        lines += ["## Mixing groups", "", *mixing_lines, ""]
    if sparse:
        from p2ptrain.bench.convergence_sparse import bytes_table, plot_loss_per_byte

        lines += ["## Bytes: sparse against dense", "", *bytes_table(results, setup), "",
                  f"![eval loss against bytes sent]({plot_loss_per_byte(results, setup, out).name})", ""]
    (out / "convergence.md").write_text("\n".join(lines))
    return out / "convergence.md"
