"""The reducer's side of one part of the butterfly: hivemind's ``TensorPartReducer`` with zeros for an all-zero-weight
part, claimed weights capped, and robust aggregation (``robust.py``). ``ExactAllReduceRunner`` swaps its reducer's
class for this one."""

from __future__ import annotations

import asyncio
import math

import torch
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer

from p2ptrain.averaging.robust import checks_senders, robust_aggregate, rule_of
from p2ptrain.sender_check import RangeSums, weighed_partial


class Reducer(TensorPartReducer):
    """hivemind's reducer, with two changes.

    A part whose senders all weigh 0 averages to zeros, not to 0/0 = NaN. Peers send weight 0 with zeros when they
    have nothing to add (a newcomer joining a round in progress, a peer whose local training diverged). Once the only
    contributor to a range has failed, the rest of that range is theirs alone; every member then gets the same zeros,
    and no honest reducer looks like a poisoner.

    With a rule other than "mean" (``robust.py``) it keeps every sender's part of the current part instead of a
    running sum, and answers their robust aggregate once all have come, in the senders' order in the group (the same
    order whatever order they arrive in). Under the sender check ("mean+check") it adds them as they come and keeps
    them too, for their sums.

    It records which senders' parts went into each part's average (``included_by_part``), for the receipt the
    runner signs with it (audit.py), and under an aggregation that checks senders each sender's sums over the part
    (``sums_by_part``, sender_check.py: 0 for a sender left out or of weight 0)."""

    aggregation = "mean"
    weight_cap = math.inf

    @classmethod
    def adopt(cls, reducer: TensorPartReducer, aggregation: str, weight_cap: float) -> "Reducer":
        """Make hivemind's ``reducer`` (its runner built it) this class: same state, its methods changed."""
        reducer.__class__ = cls
        reducer.aggregation = aggregation
        reducer.weight_cap = weight_cap  # robust.weight_cap of the group's gathered weights
        reducer.contributions = {}
        reducer.current_included = []
        reducer.included_by_part = {}
        reducer.sums_by_part = {}
        return reducer

    def reset_accumulators(self):
        self.contributions = {}  # sender index -> (part, weight) of the current part (robust aggregation)
        self.current_included = []  # senders whose part is in the current part's average, as they came
        self.__dict__.setdefault("included_by_part", {})  # part index -> those senders, in group order
        self.__dict__.setdefault("sums_by_part", {})  # part index -> every sender's RangeSums of it (sender check)
        super().reset_accumulators()

    async def accumulate_part(self, sender_index: int, part_index: int, tensor_part: torch.Tensor,
                              weight: float = 1.0) -> torch.Tensor:
        """hivemind's (1.1.12), with the weight capped, the part kept instead of added for a robust aggregation,
        and the senders counted into each part recorded (``included_by_part``: the reducer's receipts, audit.py)."""
        weight = min(weight, self.weight_cap)  # a sender's weight is its own claim: capped (robust.weight_cap)
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait({self.current_part_future, asyncio.create_task(self.finished.wait())},
                               return_when=asyncio.FIRST_COMPLETED)
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
        if self.sender_failed_after[sender_index] != float("inf"):
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        if part_index < self.sender_failed_after[sender_index]:
            if rule_of(self.aggregation) == "mean":  # added as it comes (the sender check keeps it for its sums)
                self.accumulator.add_(tensor_part, alpha=weight)
                self.denominator += weight
            if self.aggregation != "mean":
                self.contributions[sender_index] = (tensor_part, weight)
            self.current_included.append(sender_index)
            self.current_part_accumulated_from += 1
            self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self):
        if self.current_part_accumulated_from == self.num_current_senders:
            self.included_by_part[self.current_part_index] = sorted(self.current_included)
        if checks_senders(self.aggregation) and self.current_part_accumulated_from == self.num_current_senders:
            self.sums_by_part[self.current_part_index] = self._sender_sums()
        if rule_of(self.aggregation) != "mean" and self.current_part_accumulated_from == self.num_current_senders:
            ordered = [self.contributions[i] for i in sorted(self.contributions)]
            if ordered:
                self.accumulator = robust_aggregate([part for part, _ in ordered], [w for _, w in ordered],
                                                    self.aggregation)
            self.denominator = 1.0
        elif self.current_part_accumulated_from == self.num_current_senders and self.denominator == 0:
            self.denominator = 1.0  # the accumulator holds zeros: 0 x each part
        super().check_current_part_finished()

    def _sender_sums(self) -> RangeSums:
        """Every sender's sums over the current part (sender_check.weighed_partial of the parts it holds)."""
        held = [self.contributions.get(i, (None, 0.0)) for i in range(self.num_senders)]
        return weighed_partial([part for part, _ in held], [weight for _, weight in held])

    def part_problem(self, part_index: int, tensor_part: torch.Tensor, weight: float) -> str:
        """Why a sender's part cannot enter this reducer's sums (its index, shape or weight), or an empty string."""
        if part_index >= self.num_parts:
            return f"part #{part_index}, beyond the {self.num_parts} parts of this reducer"
        expected_shape = self.part_shapes[part_index]
        if tensor_part.shape != expected_shape:
            return f"part #{part_index} of shape {tuple(tensor_part.shape)}, expected {tuple(expected_shape)}"
        if not (math.isfinite(weight) and weight >= 0):
            return f"a weight of {weight}, not a finite non-negative number"
        return ""
