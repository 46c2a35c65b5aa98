"""``ReplayCheck``: the replay check in a swarm (``replay_check.py`` holds its arithmetic and what it can see).

A sender's pseudo-gradient is H inner steps from the global parameters, so it is a function of what it can name at
the start of its phase. Under ``replay_rate`` > 0 every member of a run does four things:

1. **Claims its work.** At the first inner step of a phase it hands its averager a copy of its inner optimizer's
   state then, with the data position its ``Replayer`` names (``claim``) and its local step, and gathers their digest
   in the round's join data, with the local steps it trained at (the inner LR schedule's clock). The claim is thus
   fixed before anyone draws; the averager serves it to the group (``replay_serving.py``).
2. **Draws.** After a round it applied, it replays each other sender of that round with probability ``rate``, with
   randomness no other peer can read (``random.SystemRandom``).
3. **Replays.** It fetches the sender's claim (checked against the gathered digest) and what the sender sent (every
   part, from its reducer, checked against the signed receipts), loads the global parameters of the round's start
   and the claimed inner state into a replica (the ``Replayer``'s), trains the claimed steps on the claimed data
   and compares the two pseudo-gradients (``replay_check.deviation``; convicting above ``TOLERANCE``). A sender that
   gathered no claim, or refuses to show it, is convicted; one whose parts a reducer does not show is not judged.
4. **Accuses, and convicts together.** A conviction found after round r is gathered in round r + 1's join data
   (``accuse``). Every member of round r + 1 that sees it and has not judged that sender's round r replays it
   itself; after round r + 1, each member excludes the senders it found guilty, for ``CONVICTION_S``. So a group's
   honest members exclude a sender at the same round boundary (none averages without the others), from round
   r + 2 on, whoever drew it; a false accusation costs each member one replay, and its accuser's later ones are
   ignored.

The cost: ``rate`` x (group size - 1) phases of compute per round on each member (the replays of a round run in a
thread of their own beside the next phase's training; the next sync's join data waits for them, so a round's
accusations and exclusions keep their boundaries), plus per replay the claim (the inner state: 8 bytes per
parameter for AdamW) and the sent parts (2 bytes per parameter in fp16); each member keeps the last two phase
starts' global parameters (8 bytes per parameter) and its averager its last three claims.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Callable, Dict, List, Optional, Protocol, Sequence, Set, Tuple

import torch

from p2ptrain.averaging import RoundResult
from p2ptrain.averaging.replay_serving import ask, claim_digest
from p2ptrain.averaging.sender_scores import CONVICTION_S
from p2ptrain.averaging.state_transfer import flatten_state, unflatten_state
from p2ptrain.diloco.context import PeerState
from p2ptrain.diloco.records import _digest_of
from p2ptrain.diloco.state import inner_state_layout, load_inner_state
from p2ptrain.outer import pseudo_gradient_
from p2ptrain.replay_check import TOLERANCE, deviation, verdict
from p2ptrain.schedules import scale_lrs

logger = logging.getLogger("p2ptrain.diloco")

CLAIM_KEY, ACCUSE_KEY = "replay", "accuse"
"""the join data's entries: this round's claim {"digest", "steps"}; the senders this peer convicted last round"""
FETCH_TIMEOUT_S = 120.0
"""how long a verifier waits for a sender's claim, or its parts, in all"""
UNANSWERED_LIMIT = 2
"""claims a sender may leave unanswered (no answer at all, as a peer that just died) before it is convicted for it"""


class NotReplayable(Exception):
    """A replayer's word that it cannot redo a claim that may be honest (its data is not all nameable): the sender
    is not judged for that round."""


class Replayer(Protocol):
    """What a verifier needs of the user's training to redo a sender's steps: a replica of the model and the data."""

    def claim(self) -> dict:
        """Where the data of the inner step being taken comes from, and of the phase's steps after it (small,
        msgpack-able: a shard and a cursor); asked at a phase's first inner step, its gradients computed."""

    def parameters(self) -> Sequence[torch.Tensor]:
        """A replica's parameters, in the optimizer's order (leaf tensors that require grad)."""

    def step(self, claim: dict, step: int, optimizer) -> None:
        """Inner step ``step`` (0 for the phase's first) of a phase whose data ``claim`` names, on the replica, as
        the trainer takes one: forward, backward, clipping, then ``optimizer.step()`` (which takes ``batch_size=``
        as ``DiLoCoOptimizer.step`` does) and ``optimizer.zero_grad()``."""


def step_runs(steps: Sequence[int]) -> List[List[int]]:
    """Local steps as [first, count] runs of consecutive ones (a phase's: one run, unless a slow peer strode)."""
    runs: List[List[int]] = []
    for step in steps:
        if runs and runs[-1][0] + runs[-1][1] == step:
            runs[-1][1] += 1
        else:
            runs.append([step, 1])
    return runs


def steps_of(runs) -> Optional[List[int]]:
    """``step_runs`` undone; None if ``runs`` is not a list of [first >= 0, count >= 1] pairs."""
    if not isinstance(runs, list):
        return None
    steps: List[int] = []
    for run in runs:
        if not (isinstance(run, list) and len(run) == 2 and all(type(v) is int for v in run) and run[0] >= 0
                and run[1] >= 1):
            return None
        steps += range(run[0], run[0] + run[1])
    return steps


class ReplayCheck:
    """The replay check of one DiLoCo peer (training process). ``inner_factory`` builds an inner optimizer as the
    peer's own was built; ``serializer`` packs a claim's metadata (the averager's)."""

    def __init__(self, state: PeerState, replayer: Replayer, rate: float,
                 inner_factory: Callable[..., torch.optim.Optimizer], serializer, max_steps: int) -> None:
        if not 0.0 < rate <= 1.0:
            raise ValueError(f"a replay rate must be in (0, 1], got {rate}")
        self.state, self.replayer, self.rate = state, replayer, rate
        self._inner_factory, self._serializer, self._max_steps = inner_factory, serializer, max_steps
        self._random = random.SystemRandom()
        self._phase: Optional[Tuple[int, str]] = None  # (outer step, claim digest) of the phase in progress
        self._steps: List[int] = []  # the local steps of this phase's inner steps
        self._starts: Dict[int, List[torch.Tensor]] = {}  # outer step -> the global parameters it started from
        self._rounds: Dict[int, RoundResult] = {}  # outer step -> the round of it this peer applied
        self._accusing: Dict[str, int] = {}  # sender -> the outer step of its round this peer found guilty
        self._judged: Set[Tuple[str, int]] = set()
        self._ignored: Set[str] = set()  # accusers whose accusation our replay found false
        self._unanswered: Dict[str, int] = {}
        self._job: Optional[threading.Thread] = None  # the last round's replays, beside the phase's training
        self._stopping = False
        self.replays, self.replayed_steps, self.seconds = 0, 0, 0.0
        """replays made, their inner steps and their seconds (the check's compute)"""
        self.fetched_bytes, self.fetch_s = 0, 0.0
        """bytes of claims and sent parts fetched for them (the parts counted at the wire's 2 bytes a value), and the
        seconds the fetches took"""
        self.deviations: Dict[str, List[float]] = {}
        """sender -> the deviation of each of its replays"""
        self.convicted: Dict[str, str] = {}
        """sender -> why this peer excluded it"""

    # ---------------------------------------------------------------------------------- this peer's own claims

    def before_inner_step(self) -> None:
        """Call under the state lock before each inner step: a phase's first makes its claim."""
        s = self.state
        if self._phase is None or self._phase[0] != s.outer_step or s.steps_since_sync == 0 and self._steps:
            self._claim()
        self._steps.append(s.local_step)

    def _claim(self) -> None:
        s = self.state
        tensors, layout = inner_state_layout(s.params, s.inner_optimizer)
        flat = flatten_state(tensors)
        metadata = self._serializer.dumps({"inner": layout, "shapes": [list(t.shape) for t in tensors],
                                           "data": self.replayer.claim()})
        digest = claim_digest(flat, metadata)
        ask(s.averager, "keep_claim", outer_step=s.outer_step, flat=flat, metadata=metadata, digest=digest)
        self._phase, self._steps = (s.outer_step, digest), []
        self._starts[s.outer_step] = [g.detach().clone() for g in s.global_params]
        for old in [step for step in self._starts if step < s.outer_step - 1]:
            del self._starts[old]

    def gather(self) -> dict:
        """What this peer's join data carries: its claim for the round, and its accusations of the last one (once
        the last round's replays are done: they ran during the phase)."""
        self.settle()
        if self._phase is None or self._phase[0] != self.state.outer_step:
            return {ACCUSE_KEY: sorted([peer, step] for peer, step in self._accusing.items())}
        return {CLAIM_KEY: {"digest": self._phase[1], "steps": step_runs(self._steps)},
                ACCUSE_KEY: sorted([peer, step] for peer, step in self._accusing.items())}

    # -------------------------------------------------------------------------------------- judging the others

    def after_round(self, result: RoundResult, outer_step: int) -> None:
        """After this peer applied ``result``, the round from ``outer_step`` (round ``outer_step`` + 1, as the sync
        records count): convict what was accused in it and what this peer found after the round before, then draw
        and replay this round's senders."""
        if not result.group_id:
            return
        self.settle()
        self._rounds[outer_step] = result
        for old in [step for step in self._rounds if step < outer_step - 1]:
            del self._rounds[old]
        # the replays run beside the next phase's training; the next sync's join data waits for them (gather)
        self._job = threading.Thread(target=self._judge_round, name="replay-check", daemon=True,
                                     args=(result, outer_step, dict(self._rounds), dict(self._starts)))
        self._job.start()

    def settle(self, stop: bool = False) -> None:
        """Wait for the last round's replays (``stop``: only for the one in progress; used when leaving)."""
        self._stopping = stop
        job, self._job = self._job, None
        if job is not None:
            job.join()

    def _judge_round(self, result: RoundResult, outer_step: int, rounds: Dict[int, RoundResult],
                     starts: Dict[int, List[torch.Tensor]]) -> None:
        try:
            self._judge_round_of(result, outer_step, rounds, starts)
        except Exception as e:  # the averager gone under a leaving peer, or a bug: never the training's end
            logger.warning(f"{self.state.tag()} the replay check of round {outer_step + 1} stopped: {e!r}")

    def _judge_round_of(self, result: RoundResult, outer_step: int, rounds: Dict[int, RoundResult],
                        starts: Dict[int, List[torch.Tensor]]) -> None:
        me = self.state.peer_id
        judge = (lambda sender, step: None if self._stopping else self._judge(sender, step, rounds, starts))
        found, self._accusing = self._accusing, {}
        guilty = {peer: step for peer, step in found.items() if step == outer_step - 1}
        for accuser, entry in result.gathered.items():
            accused = entry.get(ACCUSE_KEY) if isinstance(entry, dict) else None
            if accuser == me or accuser in self._ignored or not isinstance(accused, list):
                continue
            for item in accused[:len(result.gathered)]:
                if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str)
                        and item[1] == outer_step - 1 and item[0] != me):
                    continue
                sender = item[0]
                if (sender, outer_step - 1) not in self._judged:
                    why = judge(sender, outer_step - 1)
                    if why:
                        guilty[sender] = outer_step - 1
                    elif why == "":
                        logger.warning(f"{self.state.tag()} peer {accuser} accused {sender} of a false pseudo-"
                                       f"gradient in round {outer_step}, but its replay here agrees with what it "
                                       "sent; its accusations are ignored from now on")
                        self._ignored.add(accuser)
        for sender in guilty:
            self._convict(sender)
        senders = [peer for peer, entry in result.gathered.items()
                   if peer != me and isinstance(entry, dict) and entry.get("weight", 1.0) != 0
                   and peer not in self.convicted]
        for sender in senders:
            if self._random.random() < self.rate and judge(sender, outer_step):
                self._accusing[sender] = outer_step

    def _judge(self, sender: str, outer_step: int, rounds: Dict[int, RoundResult],
               starts: Dict[int, List[torch.Tensor]]) -> Optional[str]:
        """Replay ``sender``'s work in the round of ``outer_step``: why it is guilty; "" if it is not; None if it
        could not be judged (then it is not counted as judged)."""
        result = rounds.get(outer_step)
        entry = result.gathered.get(sender) if result is not None else None
        if not isinstance(entry, dict) or outer_step not in starts:
            return None
        if entry.get("digest") != _digest_of(starts[outer_step]):
            return None  # it started from other parameters (the group repaired it): nothing to replay from
        self._judged.add((sender, outer_step))
        claim = entry.get(CLAIM_KEY)
        steps = steps_of(claim.get("steps")) if isinstance(claim, dict) else None
        if steps is None or not isinstance(claim.get("digest"), str) or len(steps) > self._max_steps:
            return self._found(sender, outer_step, "it gathered no claim of its work (or one it could not have made)")
        fetch_started = time.perf_counter()
        fetched = ask(self.state.averager, "fetch_claim", FETCH_TIMEOUT_S, peer=sender, outer_step=outer_step,
                      digest=claim["digest"])
        self.fetch_s += time.perf_counter() - fetch_started
        if fetched is None or isinstance(fetched[0], str):
            why, refused = fetched if fetched is not None else ("no answer", False)
            self._unanswered[sender] = self._unanswered.get(sender, 0) + (not refused)
            if not refused and self._unanswered[sender] < UNANSWERED_LIMIT:
                self._judged.discard((sender, outer_step))
                logger.warning(f"{self.state.tag()} could not replay {sender}'s round {outer_step + 1}: {why}")
                return None
            return self._found(sender, outer_step, f"asked for the claim of its round {outer_step + 1}: {why}")
        fetch_started = time.perf_counter()
        sent = ask(self.state.averager, "fetch_sent", FETCH_TIMEOUT_S, group_id=result.group_id, peer=sender)
        self.fetch_s += time.perf_counter() - fetch_started
        self.fetched_bytes += len(fetched[0]) + 4 * fetched[1].numel()
        if not isinstance(sent, torch.Tensor):
            self._judged.discard((sender, outer_step))
            logger.warning(f"{self.state.tag()} could not replay {sender}'s round {outer_step + 1}: {sent}")
            return None
        self.fetched_bytes += 2 * sent.numel()
        started = time.perf_counter()
        try:
            replayed = self._replay(starts[outer_step], *fetched, steps)
        except NotReplayable as e:
            self._judged.discard((sender, outer_step))
            logger.info(f"{self.state.tag()} did not replay {sender}'s round {outer_step + 1}: {e}")
            return None
        except Exception as e:  # anything in a claim that does not replay is the claimant's: it names its work
            return self._found(sender, outer_step, f"its claim cannot be replayed on this model ({e!r})"[:300])
        finally:
            self.replays, self.replayed_steps = self.replays + 1, self.replayed_steps + len(steps)
            self.seconds += time.perf_counter() - started
        away = deviation([sent], [replayed])
        self.deviations.setdefault(sender, []).append(away)
        why = verdict(away, TOLERANCE)
        logger.info(f"{self.state.tag()} replayed {sender}'s round {outer_step + 1} ({len(steps)} steps): "
                    f"{away:.3g} of its norm apart" + (" - guilty" if why else ""))
        return self._found(sender, outer_step, why) if why else ""

    def figures(self) -> dict:
        """What the check did so far (the worker's report): replays, their steps and seconds, fetches, verdicts."""
        deviations = [d for ds in list(self.deviations.values()) for d in list(ds)]  # beside the replays' thread
        return {"replays": self.replays, "replayed_steps": self.replayed_steps, "replay_s": round(self.seconds, 3),
                "fetched_bytes": self.fetched_bytes, "fetch_s": round(self.fetch_s, 3),
                "max_deviation": max(deviations, default=None), "convicted": dict(self.convicted)}

    def _found(self, sender: str, outer_step: int, why: str) -> str:
        logger.warning(f"{self.state.tag()} the replay check finds {sender} guilty in round {outer_step + 1}: {why}")
        self.convicted.setdefault(sender, f"round {outer_step + 1}: {why}")
        return why

    def _replay(self, start: List[torch.Tensor], metadata: bytes, flat: torch.Tensor, steps: List[int]) -> torch.Tensor:
        """The pseudo-gradient (flat) that a claim gives: the replica from ``start`` with the claimed inner state,
        trained the claimed steps."""
        claim = self._serializer.loads(metadata)
        params = list(self.replayer.parameters())
        if len(params) != len(start) or any(p.shape != g.shape for p, g in zip(params, start)):
            raise ValueError("the replayer's replica does not have this model's parameters")
        tensors = unflatten_state(flat, claim["shapes"])
        layout = claim["inner"]
        if len(layout) != len(params) or sum(len(spec["tensors"]) for spec in layout) != len(tensors):
            raise ValueError("the claimed inner state does not fit this model's parameters")
        with torch.no_grad():
            for p, g in zip(params, start):
                p.copy_(g)
        inner = self._inner_factory(params)
        load_inner_state(params, inner, layout, tensors)
        schedule = self.state.inner_lr_schedule
        stepper = _Stepper(inner)
        with torch.enable_grad():  # the sync runs without
            for k, local_step in enumerate(steps):
                if schedule is not None:
                    scale_lrs(inner.param_groups, schedule(local_step))
                inner.zero_grad(set_to_none=True)
                self.replayer.step(claim["data"], k, stepper)
                if stepper.steps != k + 1:
                    raise RuntimeError(f"the replayer took {stepper.steps} optimizer steps for {k + 1} inner steps")
        replayed = [torch.empty_like(g) for g in start]
        pseudo_gradient_(replayed, start, [p.detach().to("cpu", torch.float32) for p in params])
        return flatten_state(replayed)

    def _convict(self, sender: str) -> None:
        why = self.convicted.get(sender, "accused, and found guilty by its replay here")
        ask(self.state.averager, "exclude", peer=sender, reason=f"the replay check convicted it: {why}",
            for_s=CONVICTION_S)


class _Stepper:
    """The replica's inner optimizer as a replayer steps it (the trainer's ``DiLoCoOptimizer`` API: ``step`` with
    ``batch_size``), counting the steps."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner, self.steps = inner, 0

    def step(self, closure=None, batch_size: Optional[int] = None):
        self.steps += 1
        return self.inner.step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)


def replay_check_of(settings, options, state: PeerState, inner_factory: Callable[..., torch.optim.Optimizer],
                    serializer) -> Optional[ReplayCheck]:
    """The replay check a DiLoCoOptimizer of these settings (``config.DiLoCoConfig``) and options runs: None where
    ``replay_rate`` is 0. Its claim and accusations go into the peer's join data."""
    if settings.replay_rate == 0:
        return None
    if options.replayer is None:
        raise ValueError(f"replay_rate {settings.replay_rate} needs a replica of the model and the data to replay "
                         "others' steps with: pass DiLoCoOptions(replayer=...) (p2ptrain.diloco.replay.Replayer)")
    if settings.fragments != 1 or settings.overlap_steps != 0 or settings.compression == "sparse":
        raise ValueError("replay_rate replays a blocking sync's pseudo-gradients: use it with fragments=1, "
                         "overlap_steps=0 and a butterfly codec (not compression='sparse')")
    if state.averager.evidence.signer is None:
        raise ValueError("replay_rate needs reducers that sign their receipts (a sender's parts are fetched against "
                         "them): start the DHT with p2ptrain.swarm.dht.start_dht, which gives each peer its identity")
    check = ReplayCheck(state, options.replayer, settings.replay_rate, inner_factory, serializer,
                        max_steps=2 * settings.local_steps)
    state.more_to_gather = check.gather
    return check
