"""A butterfly round on one peer: its runner made and registered for the part streams, every average collected first,
the tensors written after, and only when the whole vector came back averaged and finite (a failed round leaves them as
they were, so a retry never averages a half-averaged vector)."""

from __future__ import annotations

import time
from functools import partial
from typing import Callable, List, Optional, Sequence

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException
from hivemind.utils import get_logger
from hivemind.utils.asyncio import as_aiter, azip

from p2ptrain.averaging.allreduce import ExactAllReduceRunner
from p2ptrain.averaging.part_size import link_rate
from p2ptrain.averaging.round import SERVE_SENDERS_TIMEOUT_S, IncompleteRoundError, RoundResult, read_gathered
from p2ptrain.finite import all_finite
from p2ptrain.hivemind_compat import p2p_of, register_runner

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
        group_id=runner.group_id,
    )


async def run_butterfly(averager, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: Optional[bytes],
                        norm_scale: float, **kwargs) -> RoundResult:
    """One butterfly round of ``averager`` (a ``PseudoGradientAverager``, averager process) over ``tensors``: its
    runner, registered for the part streams, with the averager's checks, signer and audits."""
    group_id = group_info.group_id if group_id is None else group_id
    started = time.perf_counter()
    runner = averager.runner_type(
        p2p=p2p_of(averager), servicer_type=type(averager), prefix=averager.prefix, tensors=tensors,
        group_id=group_id, ordered_peer_ids=group_info.peer_ids,
        max_norm_ratio=None if averager.max_norm_ratio is None else averager.max_norm_ratio * norm_scale,
        on_bad_peer=averager.ban, aggregation=averager.aggregation, signer=averager.evidence.signer,
        on_bad_average=partial(averager.evidence.report_bad_average, group_id),
        # a private swarm's reducers all sign receipts (start_dht gives each an identity): one that does not
        # could not be audited. Mixing groups (deviation_scale) average states in fp32: not audited
        require_receipts=averager.evidence.signer is not None and averager.auth.private,
        output_buffer=averager.output_buffer.take(sum(tensor.numel() for tensor in tensors)),
        audit_parts=0 if averager.evidence.signer is None or "deviation_scale" in kwargs else averager.auditor.parts,
        **kwargs,
    )
    register_runner(averager, group_id, runner)
    if averager.evidence.signer is not None:
        averager.auditor.keep(group_id, group_info.peer_ids, runner.kept_inputs)
    averager.evidence.own_rms_last = runner._own_rms or averager.evidence.own_rms_last  # evidence is judged by it

    try:
        if runner.modes[group_info.peer_ids.index(averager.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
        else:
            # collect first, write after: a round that fails half-way must leave the local tensors as they were
            await average_into(runner, tensors, averager.report.record_failed)
            averager.output_buffer.keep(runner.tensor_part_container.buffer)  # a round that failed keeps none
            averager.report.record_link_rate(link_rate(runner.bytes_sent, runner.bytes_received,
                                                       time.perf_counter() - started))
            averager.last_updated = time.time()
            averager.auditor.start(group_id, runner.audit_targets, runner._codec)
            if averager.replay is not None and "deviation_scale" not in kwargs:  # a verifier may fetch a sender's parts
                container = runner.tensor_part_container
                averager.replay.record_round(group_id, group_info.peer_ids, runner.sender_peer_ids, container._slices,
                                             runner._receipts.commitments, runner._codec, container.total_size)
            if runner.sender_sums is not None and "deviation_scale" not in kwargs:  # pseudo-gradients, not states
                with runner.clock("checks"):
                    averager.sender_checks.judge(runner.sender_sums, runner.sender_peer_ids,
                                                 read_gathered(averager.serializer, group_info)[0],
                                                 sum(runner.tensor_part_container.num_parts_by_peer),
                                                 averager.peer_id)
    finally:
        averager.auditor.set_aside(group_id)  # the inputs we signed for wait for their auditors in a file
    return round_result(runner, len(group_info.peer_ids))
