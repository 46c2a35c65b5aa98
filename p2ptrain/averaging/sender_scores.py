"""The sender check in the swarm: every member scores every sender of its group from the sums its reducers signed.

Under an aggregation named with ``+check`` (``robust.CHECKED``, e.g. "trim+check"), each reducer signs, with every
part's receipt, each sender's sums over that part (``reducer.Reducer._sender_sums``: its dot product with the
coordinatewise median of the others' parts, its squared norm, the median's). Every member checks them with the rest
of the receipt (``audit.check_receipt``) and adds them up over every part of the round (``RoundSums``): the sums of
the whole vectors, so the same scores as ``sender_check.round_scores`` of the senders' whole pseudo-gradients. Once
the round is applied, ``SenderChecks`` scores every sender that sent every part with a weight above 0 and feeds one
``SenderCheck`` per averager: a sender flagged in ``ROUNDS`` of its rounds in a row is convicted, and excluded from
this peer's groups for ``CONVICTION_S`` (its records stop counting, as any excluded peer's).

The members of a group read the same signed sums and, having shared the same rounds, keep the same record: they
convict together, in the same round. A reducer that signs false sums (to frame a sender, or to hide itself over its
own range) is caught by the audits like a false average (``audit.sums_verdict``). What this does not do yet: carry
a conviction to peers that were not in those groups (a newcomer, another mixing group), as evidence does for a
reducer's proven lies; the scores are a judgement of three rounds' signed sums, not yet stored as a proof.

A sender's norm is compared after scaling by its ``norm_scale`` (H / its inner steps since its last sync, which it
sends in its gathered data) to the power ``STEPS_POWER``: a slower peer with adaptive inner steps, or a newcomer
that joined mid-phase, takes fewer steps and sends a smaller pseudo-gradient (between linear and square-root in the
steps); the power puts both ends within 2x for a peer with 1/16 of the steps or more. The scale is the sender's own
claim, and claiming fewer steps only makes its scaled norm larger. The group's leader relays every member's claim;
each member leaves a group in which its own is not what it sent (``Admission.check_members``), so a rogue leader
cannot raise an honest member's claim to frame it.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, Sequence

from hivemind.p2p import PeerID
from hivemind.utils import get_logger

from p2ptrain.averaging.robust import checks_senders
from p2ptrain.averaging.round import own_norm_scale
from p2ptrain.proto import p2ptrain_pb2
from p2ptrain.sender_check import RangeSums, Score, SenderCheck, scores_of

logger = get_logger(__name__)

CONVICTION_S = 24 * 3600.0
"""how long a convicted sender stays excluded from this peer's groups (extended whenever it comes back)"""
STEPS_POWER = 0.75
"""a sender's norm is scored times its norm_scale (H / its steps) to this power (module docstring)"""


class RoundSums:
    """One round's sums of every sender, added up from every part's receipt: the other reducers' (checked in the
    event loop) and ours (signed in the runner's executor threads), hence the lock."""

    def __init__(self, senders: int) -> None:
        self.sums = RangeSums([0.0] * senders, [0.0] * senders, [0.0] * senders)
        self.parts_in = [0] * senders  # parts whose receipt counts the sender's part in, with a weight above 0
        self.parts = 0
        self._lock = threading.Lock()

    def add(self, receipt: p2ptrain_pb2.Receipt) -> None:
        """One part's receipt (checked: one sum per sender, finite)."""
        part = RangeSums(list(receipt.dots), list(receipt.squares), list(receipt.median_squares))
        with self._lock:
            self.parts += 1
            for i, (committed, weight) in enumerate(zip(receipt.commitments, receipt.weights)):
                if committed and weight > 0:
                    self.parts_in[i] += 1
            self.sums = self.sums + part

    def scores(self, senders: Sequence[str], norm_scales: Sequence[float], total_parts: int) -> Dict[str, Score]:
        """The scores of the senders in every one of the round's ``total_parts`` parts (none if some part's sums
        are missing), each norm scaled by its sender's ``norm_scale`` ** ``STEPS_POWER``."""
        if self.parts != total_parts:
            return {}
        scored = [i for i, count in enumerate(self.parts_in) if count == total_parts]
        scale = [norm_scales[i] ** STEPS_POWER for i in scored]
        sums = RangeSums([self.sums.dots[i] * s for i, s in zip(scored, scale)],
                         [self.sums.squares[i] * s * s for i, s in zip(scored, scale)],
                         [self.sums.median_squares[i] for i in scored])
        return dict(zip([senders[i] for i in scored], scores_of(sums)))


class SenderChecks:
    """The averager's sender check (averager process): one ``SenderCheck`` over every round this peer averages."""

    def __init__(self, aggregation: str, ban: Callable[[PeerID, str, float], None]) -> None:
        self.active = checks_senders(aggregation)
        self.check = SenderCheck()
        self._ban = ban

    def judge(self, sums: RoundSums, senders: Sequence[PeerID], gathered: Dict[str, object], total_parts: int,
              me: PeerID) -> Dict[str, Score]:
        """Score a round this peer (``me``) applied; convict and exclude whoever the check convicts. Returns the
        scores."""
        ids = [peer.to_base58() for peer in senders]
        scales = [own_norm_scale(gathered.get(peer, {})) for peer in ids]
        scores = sums.scores(ids, scales, total_parts)
        for peer in scores:
            if peer in self.check.convicted and peer != me.to_base58():  # back after its exclusion: excluded again
                self._ban(PeerID.from_base58(peer), "the sender check convicted it earlier", CONVICTION_S)
        for conviction in self.check.observe({peer: s for peer, s in scores.items() if peer not in self.check.convicted}):
            flagged = ", ".join(f"cosine {s.relative:.2f} of the others', norm {s.norm_ratio:.2f}x"
                                for _, s in conviction.evidence)
            why = f"flagged in {len(conviction.evidence)} rounds in a row ({flagged})"
            if conviction.sender == me.to_base58():  # the other members see the same sums: they convict us
                logger.warning(f"the sender check convicts this peer's own pseudo-gradients: {why}; the other "
                               "members exclude it")
            else:
                self._ban(PeerID.from_base58(conviction.sender), f"the sender check convicted it: {why}",
                          CONVICTION_S)
        logger.debug("sender check (relative cosine/norm ratio): "
                     + "; ".join(f"{peer[-6:]} {s.relative:.2f}/{s.norm_ratio:.2f}" for peer, s in scores.items()))
        return scores
