"""p2ptrain's reducer run by hand on one part, as the unit tests of receipts, audits and sender sums need it."""

from __future__ import annotations

import asyncio
from typing import List, Sequence, Tuple

import torch

from p2ptrain.averaging.reducer import Reducer


def reduce_part(values: Sequence[torch.Tensor], weights: Sequence[float], aggregation: str, order: Sequence[int],
                cap: float = float("inf")) -> Tuple[List[torch.Tensor], Reducer]:
    """The answers of a reducer of one part to the senders in ``order`` (those not in it sent nothing: they failed),
    each sender's part arriving in that order, and the reducer after them (its sums, the senders it included)."""
    async def run():
        reducer = Reducer([values[0].shape], num_senders=len(values))
        reducer.aggregation, reducer.contributions, reducer.weight_cap = aggregation, {}, cap
        reducer.num_current_senders = len(order)
        answers = await asyncio.gather(*(reducer.accumulate_part(i, 0, values[i], weights[i]) for i in order))
        return list(answers), reducer

    return asyncio.run(run())
