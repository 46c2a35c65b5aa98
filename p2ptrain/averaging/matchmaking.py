"""hivemind's matchmaking of one averager, steered per round by p2ptrain (``SteeredMatchmaking``): its hooks, set on
the ``Matchmaking`` object in the averager process. The hivemind names they reach are listed in hivemind_compat."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any, Callable, Collection, Optional

from hivemind.proto import averaging_pb2

from p2ptrain.lookup_pace import group_lookup_gaps


class SteeredMatchmaking:
    """hivemind's ``Matchmaking`` of one averager (averager process), steered per round by p2ptrain.

    hivemind fixes a group's target size and window when the averager is built; p2ptrain plans them per round from
    the progress records (``plan``). It also never asks a peer it refuses to lead its group, keeps the group bits it
    set (hivemind rewrote them after every group: a retry within one step then met peers one outer step ahead), and
    lets a follower it did not expect raise the target instead of taking an expected peer's place. It counts the
    join requests it has out, so that a part stream for a group this peer is not in is refused at once
    (``in_no_formed_group``)."""

    def __init__(self, matchmaking: Any, refuses_leader: Callable[[Any], bool], lookups: Any = None):
        self.matchmaking = matchmaking
        self.expected: set = set()  # base58 ids the target counts, and the unexpected followers accepted since
        self.cap = 0  # the most members a group may hold (0: no cap)
        self._gaps, self._gap, self._last_lookup = group_lookup_gaps(), 0.0, -math.inf  # lookups' pace, per step
        self.requests_out = 0  # join requests this averager has out (a leader may be counting it in)
        request_join_group = matchmaking._request_join_group

        async def guarded_request_join_group(leader):
            if refuses_leader(leader):
                return None
            self.requests_out += 1
            try:
                return await request_join_group(leader)
            finally:
                self.requests_out -= 1

        async def keep_group_bits(group_info) -> None:
            return None

        check_request = matchmaking._check_reasons_to_reject

        def check_request_counting_the_unexpected(request, context):
            target, peer = matchmaking.target_group_size, context.remote_id.to_base58()
            unexpected = target is not None and peer not in self.expected and (not self.cap or target < self.cap)
            if unexpected:
                matchmaking.target_group_size = target + 1
            reason = check_request(request, context)
            if reason is not None and reason.code == averaging_pb2.BAD_EXPIRATION_TIME and \
                    matchmaking.target_group_size is not None and \
                    len(matchmaking.current_followers) + 2 >= matchmaking.target_group_size:
                # hivemind refuses a follower whose search ends before this leader's window: it might be gone when
                # the group begins. One that completes the group is in it now, as the group begins at once: a peer
                # the others had waited for arrived with a window shorter than theirs and was refused until their
                # windows ran out (a sparse 10 Mbit run: 13-18 s of every round's matchmaking)
                relaxed = averaging_pb2.JoinRequest()
                relaxed.CopyFrom(request)
                relaxed.expiration = matchmaking.potential_leaders.declared_expiration_time
                reason = check_request(relaxed, context)
            if unexpected and reason is None:
                self.expected.add(peer)
            elif unexpected:
                matchmaking.target_group_size = target
            return reason

        key_manager = matchmaking.group_key_manager
        get_averagers = key_manager.get_averagers

        async def paced_get_averagers(*args, **kwargs):
            # hivemind asks again as soon as an answer with no leader in it comes back (PotentialLeaders.
            # pop_next_leader sets update_triggered while its queue is empty): a peer alone in matchmaking made
            # ~570 lookups a second. Paced by group_lookup_gaps (anew each step, in plan); a leader declared
            # meanwhile is found at the next one, well inside the round's window
            wait = self._last_lookup + self._gap - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            self._last_lookup, self._gap = time.monotonic(), next(self._gaps)
            if lookups is not None:  # a shared counter (multiprocessing.Value) the host process reads
                with lookups.get_lock():
                    lookups.value += 1
            return await get_averagers(*args, **kwargs)

        matchmaking._request_join_group = guarded_request_join_group
        key_manager.get_averagers = paced_get_averagers
        key_manager.update_key_on_group_assembled = keep_group_bits
        matchmaking._check_reasons_to_reject = check_request_counting_the_unexpected

    def plan(self, target: Optional[int], window_s: float, expected: Collection[str], cap: int,
             follows_only: bool = False) -> None:
        """For the step about to start: a leader starts its group once it holds ``target`` members (None: when the
        window ends), a declaration as a potential leader lasts ``window_s``. ``follows_only``: this step neither
        declares itself nor accepts followers, as in hivemind's client mode (a relayed peer: swarm/relays.py)."""
        self.matchmaking.client_mode = follows_only
        self.matchmaking.target_group_size = target
        self.matchmaking.min_matchmaking_time = self.matchmaking.potential_leaders.min_matchmaking_time = window_s
        self.expected, self.cap = set(expected), cap
        self._gaps, self._gap = group_lookup_gaps(), 0.0  # the step's first lookup goes at once

    def in_no_formed_group(self) -> bool:
        """Whether no group that has formed already can hold this peer: it looks for a group with no join request
        out and none assembled. A leader counts a follower in from its request; a request that has ended without
        the group (the follower gave up waiting for the leader's answer, or was turned away) never will, though
        the leader may have counted it in as it left: hivemind drops a follower only when it sees its stream close
        (CI, 8 workers on 2 cores: the others then waited 30 s for its parts). Between a group's assembly and its
        registration the group is assembled, or the step is not looking any more: False then."""
        matchmaking = self.matchmaking
        return matchmaking.is_looking_for_group and self.requests_out == 0 and not matchmaking.assembled_group.done()
