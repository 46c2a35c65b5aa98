"""``bench --convergence N --attack A --aggregation R``: one insider among the replicas, under each aggregation.

The convergence experiment's DiLoCo (``convergence.run_diloco``: K replicas in one process, the swarm's optimizers
and wire rounding) with its last replica an attacker: it trains honestly but sends, instead of its pseudo-gradient,

- ``x5``: its pseudo-gradient scaled x5 (within the 10x norm check, so the plain mean takes it);
- ``flip``: its pseudo-gradient sign-flipped;
- ``direction``: a fixed direction of its choosing (the same random unit vector every round, per tensor), at 5x its
  pseudo-gradient's norm.

Each aggregation (``robust.py``) runs with no attacker and with each attack; the loss is an honest replica's. The
reducers' rule is applied wire part by wire part, as in the swarm (``outer.group_average``).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import torch

from p2ptrain.bench.convergence import Setup, run_diloco

DIRECTION_SCALE = 5.0


def _scaled(factor: float) -> Callable[[List[torch.Tensor]], List[torch.Tensor]]:
    return lambda sent: [t * factor for t in sent]


def _direction() -> Callable[[List[torch.Tensor]], List[torch.Tensor]]:
    directions: Dict[int, torch.Tensor] = {}

    def attack(sent: List[torch.Tensor]) -> List[torch.Tensor]:
        out = []
        for i, t in enumerate(sent):
            if i not in directions:
                d = torch.randn(t.shape, generator=torch.Generator().manual_seed(1234 + i))
                directions[i] = d / torch.linalg.vector_norm(d).clamp(min=1e-30)
            out.append(directions[i] * DIRECTION_SCALE * torch.linalg.vector_norm(t))
        return out
    return attack


ATTACKS: Dict[str, Callable[[], Optional[Callable]]] = {
    "none": lambda: None,
    "x5": lambda: _scaled(5.0),
    "flip": lambda: _scaled(-1.0),
    "direction": _direction,
}


def run_robust(setup: Setup, local_steps: int, aggregations: Sequence[str], attacks: Sequence[str], out: Path,
               echo: Callable[[str], None] = print) -> Path:
    """Every aggregation x ("none" and each attack); writes robust.json and robust.md in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    rows: Dict[str, Dict[str, float]] = {}
    conditions = ["none", *[a for a in attacks if a != "none"]]
    for aggregation in aggregations:
        rows[aggregation] = {}
        for attack in conditions:
            started = time.perf_counter()
            loss = run_diloco(setup, local_steps, aggregation=aggregation, attack=ATTACKS[attack]())
            rows[aggregation][attack] = loss
            echo(f"robust: aggregation={aggregation} attack={attack}: eval loss {loss:.4f} "
                 f"({time.perf_counter() - started:.0f}s)")
            (out / "robust.json").write_text(json.dumps(
                {"setup": setup.__dict__, "local_steps": local_steps, "losses": rows}, indent=1))
    path = out / "robust.md"
    path.write_text("\n".join(robust_table(rows, conditions, setup, local_steps)) + "\n")
    return path


def robust_table(rows: Dict[str, Dict[str, float]], conditions: List[str], setup: Setup,
                 local_steps: int) -> List[str]:
    """Eval loss per aggregation and attack, each with its change against the plain mean without an attacker."""
    base = rows.get("mean", {}).get("none")
    lines = [f"One attacker among {setup.peers} replicas ({setup.model} model, {setup.steps} inner steps, H = "
             f"{local_steps}, batch {setup.batch_size}, seed {setup.seed}); eval loss of an honest replica, and its "
             "change against the plain mean with nobody attacking.", "",
             "| aggregation | " + " | ".join(conditions) + " |", "|---|" + "---:|" * len(conditions)]
    for aggregation, losses in rows.items():
        cells = []
        for attack in conditions:
            loss = losses.get(attack)
            if loss is None:
                cells.append("-")
            elif base:
                cells.append(f"{loss:.4f} ({(loss / base - 1) * 100:+.1f}%)")
            else:
                cells.append(f"{loss:.4f}")
        lines.append(f"| {aggregation} | " + " | ".join(cells) + " |")
    return lines
