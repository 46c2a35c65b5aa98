"""``bench --convergence N --attack A --aggregation R``: insiders among the replicas, under each aggregation.

The convergence experiment's DiLoCo (``convergence.run_diloco``: K replicas in one process, the swarm's optimizers
and wire rounding) with its last replica (its last ``--attackers`` replicas, colluding) an attacker. It sends,
instead of its pseudo-gradient,

- ``x5``: its pseudo-gradient scaled x5 (within the 10x norm check, so the plain mean takes it);
- ``flip``: its pseudo-gradient sign-flipped;
- ``direction``: a fixed direction of its choosing (the same random unit vector every round, per tensor), at 5x its
  pseudo-gradient's norm;
- ``drift``: its pseudo-gradient plus a small bias, 20% of its norm along that fixed direction, every round;
- ``stale``: the pseudo-gradient of its previous round (its first round's is honest);
- ``wrong-data``: its honest pseudo-gradient of other data than it was given: it trains on its shard's text read
  backwards (the same characters, another language model).

Colluders share the fixed direction. Each aggregation (``robust.py``) runs with no attacker and with each attack; the
loss is an honest replica's. The reducers' rule is applied wire part by wire part, as in the swarm
(``outer.group_average``).

Each run also records what a direction check would see of each sender in each round (``sender_scores``): the cosine
of its pseudo-gradient with the coordinatewise median of the others', and its norm over the median of theirs. An
aggregation named ``R+check`` runs ``R`` with the sender check acting (``sender_check.SenderCheck``): a sender it
convicts is left out of every round after; ``convictions`` records who was convicted in which round. With
``replay_rate``, every run also has the replay check acting (``bench/replay_audit.py``): ``replays`` records whom
it convicted in which round, the honest replays' largest deviation and the replayed steps over the trained ones.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence

import torch

from p2ptrain.averaging.robust import checks_senders, rule_of
from p2ptrain.bench.convergence import Setup, run_diloco
from p2ptrain.bench.replay_audit import ReplayAudit
from p2ptrain.replay_check import TOLERANCE
from p2ptrain.sender_check import COSINE_FLOOR, NORM_BOUND, ROUNDS, SenderCheck, round_scores

DIRECTION_SCALE = 5.0
DRIFT_SCALE = 0.2

Sends = Callable[[List[torch.Tensor]], List[torch.Tensor]]


Admit = Callable[..., List[bool]]


def acting_check(check: Optional[SenderCheck], replay: Optional[ReplayAudit] = None) -> Optional[Admit]:
    """``run_diloco``'s ``admit``: scores the round's senders not convicted yet (by it or by ``replay``, which replays
    among the first), and averages those; one it convicts is left out from the next round on (in a swarm its scores
    come with the round's results). Without a check, ``replay`` alone."""
    if check is None:
        return replay.admit if replay is not None else None

    def admit(sent: List[List[torch.Tensor]]) -> List[bool]:
        senders = [str(i) for i in range(len(sent))]
        kept = check.admitted(senders)
        if replay is not None:
            kept = [ours and theirs for ours, theirs in zip(kept, replay.admit(sent, kept), strict=True)]
        members = [i for i, ok in enumerate(kept) if ok]
        check.observe(dict(zip([senders[i] for i in members], round_scores([sent[i] for i in members]))))
        return kept

    return admit


def _scaled(factor: float) -> Sends:
    return lambda sent: [t * factor for t in sent]


def _unit_direction(index: int, shape: torch.Size) -> torch.Tensor:
    """The attackers' fixed direction for tensor ``index``: the same for every attacker (they collude)."""
    d = torch.randn(shape, generator=torch.Generator().manual_seed(1234 + index))
    return d / torch.linalg.vector_norm(d).clamp(min=1e-30)


def _direction(scale: float, keep_honest: bool) -> Sends:
    """``scale`` x the pseudo-gradient's norm along the fixed direction, instead of it or (``keep_honest``) added."""
    def attack(sent: List[torch.Tensor]) -> List[torch.Tensor]:
        return [(t if keep_honest else 0) + _unit_direction(i, t.shape) * scale * torch.linalg.vector_norm(t)
                for i, t in enumerate(sent)]
    return attack


def _stale() -> Sends:
    previous: List[List[torch.Tensor]] = []

    def attack(sent: List[torch.Tensor]) -> List[torch.Tensor]:
        out = previous.pop() if previous else sent
        previous.append([t.clone() for t in sent])
        return out
    return attack


def _backwards(shard: Iterator) -> Iterator:
    """The shard's batches read backwards: inputs are the targets reversed, targets the inputs reversed."""
    for x, y in shard:
        yield y.flip(1), x.flip(1)


class Attack(NamedTuple):
    sends: Optional[Callable[[], Sends]]
    """a new attacker's rule for what it sends (None: its honest pseudo-gradient)"""
    data: Optional[Callable[[Iterator], Iterator]] = None
    """what it trains on instead of its shard's batches (None: those)"""


ATTACKS: Dict[str, Attack] = {
    "none": Attack(None),
    "x5": Attack(lambda: _scaled(5.0)),
    "flip": Attack(lambda: _scaled(-1.0)),
    "direction": Attack(lambda: _direction(DIRECTION_SCALE, keep_honest=False)),
    "drift": Attack(lambda: _direction(DRIFT_SCALE, keep_honest=True)),
    "stale": Attack(_stale),
    "wrong-data": Attack(None, _backwards),
}


class SenderScores:
    """Per round, each sender's cosine with the coordinatewise median of the others' pseudo-gradients and its norm
    over the median of their norms (all of its tensors as one vector): what a direction check would see."""

    def __init__(self) -> None:
        self.cosines: List[List[float]] = []
        self.norm_ratios: List[List[float]] = []

    def __call__(self, sent: List[List[torch.Tensor]]) -> None:
        scores = round_scores(sent)  # what the sender check scores, of every sender, convicted or not
        self.cosines.append([score.cosine for score in scores])
        self.norm_ratios.append([score.norm_ratio for score in scores])

    def _rounds_after(self, skip_rounds: int) -> range:
        """The rounds after the first ``skip_rounds``, or the last round alone if there are no more."""
        return range(min(skip_rounds, max(len(self.cosines) - 1, 0)), len(self.cosines))

    def separated(self, bad: Sequence[int], skip_rounds: int = 1) -> Dict[str, int]:
        """In how many of the rounds after the first ``skip_rounds`` every attacker in ``bad`` had a lower cosine
        than every other sender ("cosine"), and a norm ratio farther from 1 ("norm"): what a check that compares
        the senders of one round with each other would catch, whatever the round's honest spread."""
        rounds = self._rounds_after(skip_rounds)
        counts = {"rounds": len(rounds), "cosine": 0, "norm": 0}
        for r in rounds:
            cos, ratio = self.cosines[r], self.norm_ratios[r]
            good = [i for i in range(len(cos)) if i not in bad]
            counts["cosine"] += max(cos[i] for i in bad) < min(cos[i] for i in good)
            counts["norm"] += (min(abs(math.log(max(ratio[i], 1e-30))) for i in bad)
                               > max(abs(math.log(max(ratio[i], 1e-30))) for i in good))
        return counts

    def ranges(self, senders: Sequence[int], skip_rounds: int = 1) -> Dict[str, List[float]]:
        """[min, max] of the cosines and norm ratios of ``senders`` over the rounds after the first ``skip_rounds``
        (the first round's pseudo-gradients all start from the same parameters: they agree more than later ones)."""
        rounds = self._rounds_after(skip_rounds)
        cos = [self.cosines[r][i] for r in rounds for i in senders]
        ratio = [self.norm_ratios[r][i] for r in rounds for i in senders]
        return {"cosine": [min(cos), max(cos)] if cos else [], "norm_ratio": [min(ratio), max(ratio)] if ratio else []}


def run_robust(setup: Setup, local_steps: int, aggregations: Sequence[str], attacks: Sequence[str], out: Path,
               echo: Callable[[str], None] = print, attackers: int = 1, replay_rate: Optional[float] = None) -> Path:
    """Every aggregation x ("none" and each attack), the last ``attackers`` replicas attacking, with the replay check
    at ``replay_rate`` if given; writes robust.json and robust.md in ``out``."""
    if not 1 <= attackers < setup.peers:
        raise ValueError(f"{attackers} attackers among {setup.peers} replicas: give fewer than --peers")
    out.mkdir(parents=True, exist_ok=True)
    rows: Dict[str, Dict[str, float]] = {}
    scores: Dict[str, Dict[str, dict]] = {}
    convictions: Dict[str, Dict[str, dict]] = {}
    replays: Dict[str, Dict[str, dict]] = {}
    conditions = ["none", *[a for a in attacks if a != "none"]]
    bad = list(range(setup.peers - attackers, setup.peers))
    good = list(range(setup.peers - attackers))
    for aggregation in aggregations:
        rows[aggregation], scores[aggregation] = {}, {}
        for name in conditions:
            attack = ATTACKS[name]
            started = time.perf_counter()
            seen = SenderScores()
            sends = {i: attack.sends() for i in bad} if attack.sends is not None else {}
            data = {i: attack.data for i in bad} if attack.data is not None else {}
            check = SenderCheck() if checks_senders(aggregation) else None
            audit = ReplayAudit(setup, local_steps, replay_rate, seed=setup.seed) if replay_rate is not None else None
            loss = run_diloco(setup, local_steps, aggregation=rule_of(aggregation), attacks=sends, data_attacks=data,
                              observe=seen, admit=acting_check(check, audit),
                              phase_start=audit.phase_start if audit else None)
            rows[aggregation][name] = loss
            if audit is not None:
                replays.setdefault(aggregation, {})[name] = replay_record(audit, good if name != "none" else good + bad,
                                                                         bad if name != "none" else [])
            if check is not None:
                honest = {str(i) for i in good} if name != "none" else {str(i) for i in good + bad}
                convictions.setdefault(aggregation, {})[name] = {
                    "attackers": [check.first_conviction(str(i)) for i in bad] if name != "none" else [],
                    "honest": {s: c.round for s, c in check.convicted.items() if s in honest}, "flags": check.flags}
            scores[aggregation][name] = {"honest": seen.ranges(good), "attackers": seen.ranges(bad),
                                         "separated": seen.separated(bad), "cosines": seen.cosines,
                                         "norm_ratios": seen.norm_ratios}
            echo(f"robust: aggregation={aggregation} attack={name}: eval loss {loss:.4f} "
                 f"({time.perf_counter() - started:.0f}s)")
            (out / "robust.json").write_text(json.dumps(
                {"setup": setup.__dict__, "local_steps": local_steps, "attackers": attackers, "losses": rows,
                 "sender_scores": scores, "convictions": convictions, "replay_rate": replay_rate, "replays": replays},
                indent=1))
    path = out / "robust.md"
    path.write_text("\n".join(robust_table(rows, conditions, setup, local_steps, attackers)
                              + [""] + scores_table(scores, conditions)
                              + ([""] + convictions_table(convictions, conditions) if convictions else [])
                              + ([""] + replays_table(replays, conditions, replay_rate) if replays else [])) + "\n")
    return path


def replay_record(audit: ReplayAudit, honest: Sequence[int], bad: Sequence[int]) -> dict:
    """One run's replay check: the round each attacker was convicted in (None: never), honest senders convicted,
    the honest replays' largest deviation, the replays made and their steps over the trained ones."""
    return {"attackers": [audit.convicted.get(i) for i in bad],
            "honest": {str(i): audit.convicted[i] for i in honest if i in audit.convicted},
            "honest_deviation": max((d for i in honest for d in audit.deviations.get(i, [])), default=None),
            "replays": audit.audits.replayed, "overhead": audit.overhead()}


def replays_table(replays: Dict[str, Dict[str, dict]], conditions: List[str], rate: Optional[float]) -> List[str]:
    """Per aggregation and attack: the round the replay check convicted each attacker in, and what it cost."""
    lines = [f"The replay check acting (`replay_check.py`: each round each sender replayed with probability {rate:g} "
             "by another replica; convicted when its pseudo-gradient is more than "
             f"{TOLERANCE:g} of its norm from the replay, left out from the next round): the round each attacker was "
             "convicted in (- never), honest senders convicted, the honest replays' largest deviation, the replayed "
             "inner steps over the trained ones:", ""]

    def cell(run: dict) -> str:
        honest = "-" if run["honest_deviation"] is None else f"{run['honest_deviation']:.1e}"
        return f"{_caught(run)} (honest {honest}; {run['overhead']:.0%} replayed)"

    return lines + _grid(replays, conditions, cell)


def scores_table(scores: Dict[str, Dict[str, dict]], conditions: List[str]) -> List[str]:
    """What a direction check would see, from the plain mean's runs (or the first aggregation's): the ranges over
    rounds 2 on of the honest senders' and the attackers' cosines and norm ratios."""
    runs = scores.get("mean") or next(iter(scores.values()), {})

    def span(values: List[float]) -> str:
        return f"{values[0]:.2f} to {values[1]:.2f}" if values else "-"

    lines = ["Each sender's cosine with the coordinatewise median of the others' pseudo-gradients, and its norm over "
             "the median of theirs, rounds 2 on (plain mean); and the rounds in which the attackers had the lowest "
             "cosines of the round, or the norm ratios farthest from 1:", "",
             "| attack | honest cosine | attackers' cosine | honest norm ratio | attackers' norm ratio | "
             "rounds, attackers lowest cosine | rounds, attackers' norm farthest |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for name in conditions:
        if name in runs:
            honest, bad, apart = runs[name]["honest"], runs[name]["attackers"], runs[name]["separated"]
            lines.append(f"| {name} | {span(honest['cosine'])} | {span(bad['cosine'])} | "
                         f"{span(honest['norm_ratio'])} | {span(bad['norm_ratio'])} | "
                         f"{apart['cosine']} of {apart['rounds']} | {apart['norm']} of {apart['rounds']} |")
    return lines


def convictions_table(convictions: Dict[str, Dict[str, dict]], conditions: List[str]) -> List[str]:
    """Per checked aggregation and attack: the round each attacker was convicted in, and any honest sender convicted."""
    lines = [f"The sender check acting (`sender_check.py`: flagged when its cosine is below {COSINE_FLOOR} of the "
             f"others' median cosine or its norm beyond {NORM_BOUND:g}x theirs, convicted when flagged {ROUNDS} rounds "
             "in a row, left out after): the round each attacker was convicted in (- never), honest senders "
             "convicted, flags raised:", ""]

    return lines + _grid(convictions, conditions, lambda run: f"{_caught(run)} ({run['flags']} flags)")


def _caught(run: dict) -> str:
    """The round each attacker of a run was convicted in ("-" never), and the honest senders convicted, if any."""
    caught = ", ".join("-" if r is None else str(r) for r in run["attackers"]) or "n/a"
    return caught + (f"; honest convicted: {', '.join(run['honest'])}" if run["honest"] else "")


def _grid(runs: Dict[str, Dict[str, Any]], conditions: List[str], cell: Callable[[Any], str]) -> List[str]:
    """A markdown table: a row per aggregation, a column per attack, ``cell`` of each run ("-" where none ran)."""
    lines = ["| aggregation | " + " | ".join(conditions) + " |", "|---|" + "---:|" * len(conditions)]
    for aggregation, by_attack in runs.items():
        lines.append(f"| {aggregation} | " + " | ".join("-" if by_attack.get(name) is None else cell(by_attack[name])
                                                       for name in conditions) + " |")
    return lines


def robust_table(rows: Dict[str, Dict[str, float]], conditions: List[str], setup: Setup,
                 local_steps: int, attackers: int = 1) -> List[str]:
    """Eval loss per aggregation and attack, each with its change against nobody attacking under the plain mean (or,
    where it did not run, under the first aggregation)."""
    base_of = "mean" if "none" in rows.get("mean", {}) else next(iter(rows), "mean")
    base = rows.get(base_of, {}).get("none")
    who = "One attacker" if attackers == 1 else f"{attackers} colluding attackers"
    lines = [f"{who} among {setup.peers} replicas ({setup.model} model, {setup.steps} inner steps, H = "
             f"{local_steps}, batch {setup.batch_size}, seed {setup.seed}); eval loss of an honest replica, and its "
             f"change against {base_of} with nobody attacking.", ""]
    return lines + _grid(rows, conditions, lambda loss: f"{loss:.4f} ({(loss / base - 1) * 100:+.1f}%)" if base
                         else f"{loss:.4f}")
