"""How a sync finds its group: the matchmaking and all-reduce attempts that the round policy (``round_policy.decide``,
a pure function) asks for, over the merged view of the live peers' progress records (``swarm_view.SwarmView``).
``DiLoCoOptimizer`` holds one ``Rounds`` and asks it for an outcome; it knows the optimizer only through what each
call passes in."""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import replace
from typing import Callable, Collection, List, Optional

from hivemind.averaging.control import AveragingStage
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.utils import get_dht_time

from p2ptrain.averaging import RoundResult
from p2ptrain.diloco.records import RoundOutcome, RoundOutlook
from p2ptrain.diloco.round_policy import (Ask, Attempt, Attempted, Finish, Look, LookAgain, Memory, RoundSettings,
                                          Settle, Settled, behind, decide)
from p2ptrain.diloco.swarm_view import Position, SwarmView, may_mix_states

__all__ = ["BEHIND_POLL_S", "Rounds"]

logger = logging.getLogger(__package__)  # one logger name for the whole optimizer, as users grep for it

BEHIND_POLL_S = 0.5
"""while a peer looks for its group, how often it reads the records to see whether the swarm went on without it. A
round of the tiny model takes 0.1 s and a phase 0.6 s on 2 cores: a newcomer that waited out a 3-5 s matchmaking
window for a round that had already started fell 6-7 outer steps behind each time, and never averaged (CI); two
newcomers waiting for the same stale round formed a group of their own after it (a second model, CI)"""

_WENT_ON = object()  # an attempt stopped because the swarm moved past its round (Rounds._wait_for_round)


class Rounds:
    """Runs one sync's rounds over an averager and returns an outcome value; it holds no training state."""

    def __init__(self, averager, dht, run_id: str, progress, settings: RoundSettings,
                 interrupted: threading.Event, tag: Callable[[], str]):
        self.averager, self.dht, self.run_id, self.progress = averager, dht, run_id, progress
        self.settings = settings
        self.view = SwarmView(progress)
        self._interrupted = interrupted  # set: the peer is leaving, stop looking for peers
        self._tag = tag
        self._explained_no_group_at = -math.inf

    @property
    def peers_seen(self) -> List[int]:
        """the other live peers each look saw since the caller last emptied it (``SwarmView.peers_seen``)"""
        return self.view.peers_seen

    @peers_seen.setter
    def peers_seen(self, value: List[int]) -> None:
        self.view.peers_seen = value

    def run(self, weight: float, position: Position, *, single_attempt: bool = False,
            outlook: Optional[RoundOutlook] = None) -> RoundOutcome:
        """Run averaging attempts until a group averages, or this peer must go on without one.

        Each attempt is planned from the progress records (``round_policy.decide``): its group starts as soon as
        every live peer of this outer step is in, and waits a bounded time for those still in their inner steps.
        Under "apply_local", a peer goes on alone only when no other live peer is at its outer step: a solo outer
        step next to such a peer would throw all of that peer's inner steps away (it would have to take our state).
        Under "wait" it never goes on alone. ``outlook``: the records as the caller just read them (else read here).
        This loop only looks, does what ``decide`` says, and tells it the result.
        """
        ask = Ask(me=self._me(), position=position, weight=weight, single_attempt=single_attempt,
                  client_mode=self.follows_only())
        memory = Memory.start(ask, self.settings, time.monotonic())
        attempted: Optional[Attempted] = None
        while True:
            if attempted is None:
                look, outlook = self._look(position, outlook), None  # the caller's outlook serves the first look
            last, attempted = attempted, None
            action, memory = decide(look, last, memory, ask, self.settings)
            if isinstance(action, Finish):
                if action.reason:
                    logger.log(action.level, f"{self._tag()} {action.reason}")
                return action.outcome
            if isinstance(action, LookAgain):
                if action.explain:
                    self.explain_no_group()
                if action.reason:
                    logger.log(action.level, f"{self._tag()} {action.reason}")
                if action.sleep_s > 0:
                    time.sleep(action.sleep_s)
            elif isinstance(action, Settle):
                time.sleep(action.sleep_s)
                settled = Settled(outlook=self.outlook(position)) if action.read_records else \
                    Settled(swarm_outer_step=self.swarm_outer_step())
                attempted = replace(last, settled=settled, ended_at_s=time.monotonic())
            else:
                attempted = self._run_attempt(action, weight, position, memory.attempts)

    def _look(self, position: Position, outlook: Optional[RoundOutlook]) -> Look:
        """One look for ``decide``: the records (``outlook``: as the caller just read them), or none if leaving."""
        if self._interrupted.is_set():
            return Look(leaving=True)
        outlook = outlook if outlook is not None else self.outlook(position)
        return Look(outlook=outlook, now_s=time.monotonic(), others_seen_at_s=self.progress.others_seen_at,
                    record_period_s=self.progress.period_s, averager_alive=self.averager.is_alive())

    def _run_attempt(self, action: Attempt, weight: float, position: Position, attempt: int) -> Attempted:
        """Hand the averager the attempt's plan, run it, and say what came of it."""
        if action.reason:
            logger.info(f"{self._tag()} {action.reason}")
        self.averager.set_round_plan(action.target, action.window_s, expected=[*action.ready, *action.late],
                                     max_group_size=self.settings.target_group_size, fragment=position.fragment,
                                     follows_only=self.follows_only())
        logger.debug(f"{self._tag()} attempt {attempt}: ready {[p[-8:] for p in action.ready]}, late "
                     f"{ {p[-8:]: step for p, step in action.late.items()} } at local step {position.local_step}: "
                     f"target {action.target}, window {action.window_s:.1f}s")
        incomplete_before = self.averager.incomplete_rounds
        result = self._attempt(weight, position, action.target, action.search_window_s, attempt,
                               mixing_bits=action.bits)
        incomplete = result is None and self.averager.incomplete_rounds != incomplete_before
        return Attempted(action, ended_at_s=time.monotonic(),
                         result=result if isinstance(result, RoundResult) else None, went_on=result is _WENT_ON,
                         incomplete=incomplete,
                         failed_members=frozenset(self.averager.last_failed_members) if incomplete else frozenset())

    def follows_only(self) -> bool:
        """Whether this peer only joins groups: a client, or a relayed peer while a public one is live (relays.py)."""
        relayed = getattr(self.dht, "relayed", None)
        return bool(self.averager.client_mode) or (relayed is not None and relayed.follows_only)

    def may_mix_states(self, outlook: RoundOutlook, outer_step: int, last_group: Collection[str]) -> bool:
        """Whether this round's group may average stepped states (``swarm_view.may_mix_states``)."""
        return may_mix_states(outer_step, outlook, last_group, self.settings.target_group_size)

    def behind(self, outlook: RoundOutlook) -> bool:
        """Whether this round went on without this peer (``round_policy.behind``): then it takes the swarm's state."""
        return behind(outlook, self.settings)

    def _me(self) -> str:
        return self.dht.peer_id.to_base58()

    def _attempt(self, weight: float, position: Position, target: Optional[int], window_s: float,
                 attempt: int, mixing_bits: str = "") -> Optional[RoundResult] | object:
        """One matchmaking + all-reduce attempt; None if it formed no group or failed (logged at debug level: the
        caller decides what a failure means), ``_WENT_ON`` if the swarm finished the round without us meanwhile."""
        try:
            self.averager.set_group_bits(position.group_bits + mixing_bits)
            # the leader waits window_s for followers; allow a request timeout on top
            matchmaking_timeout_s = window_s + self.settings.request_timeout_s + 1.0
            control = self.averager.step(
                weight=weight,
                gather=position.gather,
                scheduled_time=get_dht_time() + window_s,
                timeout=matchmaking_timeout_s,
                allow_retries=True,
                wait=False,
            )
            # bounded even if the averager process dies mid-round: then this raises TimeoutError
            result = self._wait_for_round(control, position,
                                          matchmaking_timeout_s + self.settings.averaging_timeout_s + 10.0)
            if result is _WENT_ON or isinstance(result, RoundResult):
                return result
        except (AllreduceException, MatchmakingException, TimeoutError, RuntimeError) as e:
            logger.debug(f"{self._tag()} averaging attempt {attempt} failed: {e!r}")
        except Exception as e:  # a network failure is a value: log it, never let it kill training
            logger.warning(f"{self._tag()} averaging attempt {attempt} failed unexpectedly: {e!r}")
        return None

    def _wait_for_round(self, control, position: Position, timeout_s: float):
        """The step's result. While it is still looking for a group, the records are read every ``BEHIND_POLL_S``:
        once they show the swarm went on without this peer (``behind``), the step is cancelled (hivemind's leader
        disbands what it gathered) and ``_WENT_ON`` returned, instead of waiting out the matchmaking window for a
        round that is over. A peer that is leaving (``interrupted``) stops looking at once too (None). Never once the
        all-reduce began: the group would lose a member mid-round."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return control.result(timeout=min(BEHIND_POLL_S, max(deadline - time.monotonic(), 0.0)))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    raise
            if control.stage is not AveragingStage.LOOKING_FOR_GROUP:
                continue
            if self._interrupted.is_set():  # leaving: stop looking now, not at the end of the window
                control.cancel()
                return None
            if self.behind(self.outlook(position)) and control.stage is AveragingStage.LOOKING_FOR_GROUP:
                control.cancel()
                logger.debug(f"{self._tag()} the swarm went on past outer step {position.outer_step} while this "
                             "peer looked for its group: stopped looking")
                return _WENT_ON

    def outlook(self, position: Position) -> RoundOutlook:
        """Read the run's progress records: is the swarm ahead, and who at this outer step is ready or late."""
        return self.view.outlook(position, mixing=self.settings.mixing)

    def swarm_outer_step(self) -> int:
        """The highest outer step among the run's other live peers (from their progress records), or -1."""
        return self.view.swarm_outer_step()

    def explain_no_group(self) -> None:
        """If no group can form because no live peer can lead one (all behind NAT, in client mode), say so: at
        most once a minute, instead of waiting in silence."""
        if not self.averager.client_mode or time.monotonic() - self._explained_no_group_at < 60.0:
            return
        others = self.progress.others(5.0)
        if any(not r.client_mode for r in others):
            return
        self._explained_no_group_at = time.monotonic()
        who = (f"so are all {len(others)} other live peer(s) of run {self.run_id!r}" if others else
               f"no other peer of run {self.run_id!r} is live")
        logger.error(
            f"{self._tag()} no group can form: this peer is behind NAT (client mode) and {who}; only a peer that "
            "others can dial can lead a group and reduce its parts: start at least one worker on a host with a "
            "public IP or a forwarded port (README, 'Behind NAT')"
        )

