"""A butterfly round's end on one peer: every average collected first, the tensors written after, and only when the
whole vector came back averaged and finite (a failed round leaves them as they were, so a retry never averages a
half-averaged vector)."""

from __future__ import annotations

from typing import Callable, List, Sequence

import torch
from hivemind.averaging.partition import AllreduceException
from hivemind.utils import get_logger
from hivemind.utils.asyncio import as_aiter, azip

from p2ptrain.averaging.allreduce import ExactAllReduceRunner
from p2ptrain.averaging.round import SERVE_SENDERS_TIMEOUT_S, IncompleteRoundError, RoundResult
from p2ptrain.finite import all_finite

logger = get_logger(__name__)


async def average_into(runner: ExactAllReduceRunner, tensors: Sequence[torch.Tensor],
                       record_failed: Callable[[List[str]], None]) -> None:
    """Run ``runner`` and write its averages into ``tensors``. Raises ``IncompleteRoundError`` (after handing the
    failed members' ids to ``record_failed``) if a reducer's range did not come back, ``AllreduceException`` if an
    average is not finite; the tensors are untouched then."""
    averaged = [averaged_tensor async for _, averaged_tensor in azip(as_aiter(*tensors), runner)]
    failed_size = runner.tensor_part_container.failed_size
    if failed_size:
        # a reducer died or timed out: its range holds our own values, which differ from peer to peer.
        # Applying that would split the survivors; fail the round so that they run it again together.
        record_failed([peer.to_base58() for peer in runner.failed_reducers])
        raise IncompleteRoundError(
            f"{failed_size} of {runner.tensor_part_container.total_size} values were not averaged "
            "(a group member failed mid-round); nothing applied"
        )
    if not all(all_finite(averaged_tensor) for averaged_tensor in averaged):
        # a reducer averaged a non-finite part of its own in; keep ours rather than take the poison
        raise AllreduceException("the averaged result has NaN/inf values; keeping the local tensors")
    if not await runner.wait_until_senders_served(SERVE_SENDERS_TIMEOUT_S):
        logger.warning(f"a sender had not taken all of its averages {SERVE_SENDERS_TIMEOUT_S:.0f}s after "
                       "this peer had its own; going on without waiting for it")
    with runner.clock("write"):
        for tensor, averaged_tensor in zip(tensors, averaged):
            tensor.copy_(averaged_tensor)


def round_result(runner: ExactAllReduceRunner, group_size: int) -> RoundResult:
    """What the round did on this peer, as far as the runner counted it."""
    container = runner.tensor_part_container
    return RoundResult(
        group_size=group_size,
        bytes_sent=runner.bytes_sent,
        bytes_received=runner.bytes_received,
        failed_fraction=container.failed_size / max(container.total_size, 1),
        phases=dict(runner.clock.seconds),
    )
