"""``bench --convergence --attack A --replay-rate P``: the replay check (``replay_check.py``) among the replicas.

At the start of each phase every replica's claim is recorded as a swarm's sender would make it: the parameters it
starts from, its inner optimizer's state and its shard's cursor (the shard it was given, whatever it trains on). When
a round's pseudo-gradients are sent, ``replay_check.Audits`` draws who replays whom; a replay trains a fresh replica
from the claim for the phase's steps and compares the pseudo-gradient it gets with the one sent. A sender convicted
by a replay of round r is left out from round r + 1 on: in a swarm the replay takes the next phase's time. Plain
DiLoCo only (one fragment, no overlap).
"""

from __future__ import annotations

import copy
from typing import Dict, List, Optional

import torch

from p2ptrain.bench.replicas import Setup, inner_optimizer, inner_step, replica_data
from p2ptrain.config import DiLoCoConfig
from p2ptrain.model import build_model
from p2ptrain.outer import pseudo_gradient_
from p2ptrain.replay_check import Audits, deviation, verdict


class ReplayAudit:
    """``run_diloco``'s ``phase_start`` and ``admit``: records the claims, replays the drawn senders, convicts."""

    def __init__(self, setup: Setup, local_steps: int, rate: float, cfg: DiLoCoConfig = DiLoCoConfig(),
                 seed: int = 0):
        self.setup, self.local_steps, self.cfg = setup, local_steps, cfg
        self.audits = Audits(rate, seed)
        self.round = 0
        self.convicted: Dict[int, int] = {}
        """replica -> the round whose replayed pseudo-gradient convicted it"""
        self.deviations: Dict[int, List[float]] = {}
        """replica -> the deviations of its replays, convicting or not"""
        self._claims: list = []
        self._shards = None

    def phase_start(self, models: list, inners: list, shards: list) -> None:
        self._claims = [([p.detach().clone() for p in model.parameters()], copy.deepcopy(inner.state_dict()),
                         shard.state_dict()) for model, inner, shard in zip(models, inners, shards)]

    def admit(self, sent: List[List[torch.Tensor]], eligible: Optional[List[bool]] = None) -> List[bool]:
        """The round's senders not convicted yet; replays this round's drawn ones among those (and among
        ``eligible``: not left out by another check), convicting from the next round."""
        self.round += 1
        kept = [i not in self.convicted for i in range(len(sent))]
        averaged = [ok and (eligible is None or eligible[i]) for i, ok in enumerate(kept)]
        for _verifier, sender in self.audits.draw([i for i, ok in enumerate(averaged) if ok]):
            away = deviation(sent[sender], self.replay(sender))
            self.deviations.setdefault(sender, []).append(away)
            if verdict(away) is not None:
                self.convicted[sender] = self.round
        return kept

    def replay(self, sender: int) -> List[torch.Tensor]:
        """The pseudo-gradient ``sender``'s claim for this phase gives: its steps, trained afresh."""
        start, inner_state, data_state = self._claims[sender]
        model = build_model(self.setup.model, seed=self.setup.seed)
        with torch.no_grad():
            for param, value in zip(model.parameters(), start, strict=True):
                param.copy_(value)
        inner = inner_optimizer(model.parameters(), self.cfg)
        inner.load_state_dict(copy.deepcopy(inner_state))
        if self._shards is None:
            self._shards = replica_data(self.setup)[0]
        shard = self._shards[sender]
        shard.load_state_dict(data_state)
        for _ in range(self.local_steps):
            inner_step([model], [inner], [shard])
        replayed = [torch.empty_like(value) for value in start]
        pseudo_gradient_(replayed, start, list(model.parameters()))
        return replayed

    def overhead(self) -> float:
        """Replayed inner steps over the replicas' trained ones."""
        trained = self.round * self.local_steps * self.setup.peers
        return self.audits.replayed * self.local_steps / trained if trained else 0.0
