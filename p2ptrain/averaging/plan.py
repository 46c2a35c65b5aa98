"""A round's plan, set by the host before each step and read by the averager process when the step starts, and the
averager process's report of its rounds, which the host reads: both in shared memory, created before the fork."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
from typing import Iterable, List, Optional

from hivemind.averaging.allreduce import AveragingMode

from p2ptrain.averaging.round import MAX_PEER_LIST_BYTES, joined_ids, split_ids


class SharedRoundPlan:
    """The next step's target, window, expected peers, cap and fragment in shared memory (created in the host before
    the averager process forks). hivemind fixes a group's target and window when the averager is built; p2ptrain
    sets them per round from the swarm's progress records (diloco/round_policy.py: plan_round)."""

    def __init__(self, window_s: float) -> None:
        self._target = mp.Value(ctypes.c_int64, 0)  # 0: no target, wait out the window
        self._window_s = mp.Value(ctypes.c_double, window_s)
        # base58 ids of the peers the target counts, comma-separated, and the most a group may hold (0: no cap)
        self._expected = mp.Array(ctypes.c_char, MAX_PEER_LIST_BYTES)
        self._cap = mp.Value(ctypes.c_int64, 0)
        self._fragment = mp.Value(ctypes.c_int64, 0)
        self._follows_only = mp.Value(ctypes.c_bool, False)

    def set(self, target_group_size: Optional[int], window_s: float, expected: Iterable[str] = (),
            max_group_size: Optional[int] = None, fragment: int = 0, follows_only: bool = False) -> None:
        """For the next ``step``: start the group as soon as it has ``target_group_size`` members (None: only when
        the window ends), and look for peers for ``window_s`` seconds.

        ``expected`` names the peers (base58) that the target counts. A peer that joins our group without being one
        of them (its record was not stored yet when we read the records) raises the target by one, up to
        ``max_group_size``: otherwise it would take the place of an expected peer, and the group would start
        without that one. ``follows_only``: join a group, never lead one (a client, or a relayed peer while a public
        one is live: swarm/relays.py)."""
        self._target.value = target_group_size or 0
        self._window_s.value = window_s
        self._expected.value = joined_ids(expected)
        self._cap.value = max_group_size or 0
        self._fragment.value = fragment
        self._follows_only.value = follows_only

    def steer(self, steered) -> None:
        """Averager process, once per step before matchmaking: hand the plan to the step's ``SteeredMatchmaking``."""
        steered.plan(self._target.value or None, self._window_s.value, split_ids(self._expected.value),
                     self._cap.value, self._follows_only.value)

    @property
    def fragment(self) -> int:
        """The fragment this round averages (every member set the same: it is part of the group key)."""
        return self._fragment.value


class RoundReport:
    """What the averager process tells the host about its rounds."""

    def __init__(self) -> None:
        # rounds in which a group formed but the all-reduce did not complete: the host retries those with the
        # survivors instead of applying its own pseudo-gradient, so no survivor applies a half-averaged result
        self._incomplete = mp.Value(ctypes.c_int64, 0)
        # base58 ids of the members that failed the last incomplete round, comma-separated
        self._failed = mp.Array(ctypes.c_char, MAX_PEER_LIST_BYTES)
        self.group_lookups = mp.Value(ctypes.c_int64, 0)  # DHT lookups of the group key matchmaking made
        # the last butterfly round's bytes per second (part_size.link_rate): the next rounds' join data carry it
        self._link_bytes_s = mp.Value(ctypes.c_double, 0.0)

    def count_incomplete(self) -> None:
        with self._incomplete.get_lock():
            self._incomplete.value += 1

    def record_failed(self, failed: List[str]) -> None:
        """The base58 ids of the members that failed this incomplete round."""
        self._failed.value = joined_ids(failed)

    def record_link_rate(self, bytes_s: float) -> None:
        self._link_bytes_s.value = bytes_s

    @property
    def link_bytes_s(self) -> float:
        return float(self._link_bytes_s.value)

    @property
    def incomplete_rounds(self) -> int:
        return int(self._incomplete.value)

    @property
    def failed_members(self) -> set:
        return set(split_ids(self._failed.value))


def act_as(averager, follows_only: bool) -> None:
    """Host side, before a step: a relayed peer (swarm/relays.py) that ``follows_only`` says it is a client in its
    group's gathered data, so it gets no share to reduce, and serves no state; else it is a full member. A client
    stays one, an auxiliary peer one."""
    if averager.client_mode or averager.mode == AveragingMode.AUX:
        return
    averager.mode = AveragingMode.CLIENT if follows_only else AveragingMode.NODE
    averager.allow_state_sharing = not follows_only
