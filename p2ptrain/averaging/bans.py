"""The peers an averager excludes for misbehaving: kept in the averager process, listed for the host."""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import time
from typing import Dict, List, Optional

from hivemind.p2p import PeerID

from p2ptrain.averaging.evidence import BAN_S
from p2ptrain.averaging.round import MAX_PEER_LIST_BYTES, joined_ids, split_ids


class Bans:
    """peer -> (monotonic end of its exclusion, why), in the averager process; the host reads the live ids and the
    count from shared memory. Created in the host before the averager process forks (the shared values with it)."""

    def __init__(self) -> None:
        self._banned: Dict[PeerID, tuple] = {}  # averager process
        # for metrics and the dashboard (host reads): exclusions made so far, and the ids excluded now
        self._total = mp.Value(ctypes.c_int64, 0)
        self._ids = mp.Array(ctypes.c_char, MAX_PEER_LIST_BYTES)

    def add(self, peer: PeerID, reason: str, for_s: Optional[float] = None) -> bool:
        """Exclude ``peer`` for ``for_s`` (``BAN_S``) from now (averager process); True if it was not excluded yet (an
        exclusion extended keeps its first reason and counts once; it never ends sooner than it would have)."""
        new = not self.is_banned(peer)
        if new:
            self._total.value += 1
        else:
            reason = self._banned[peer][1]
        until = time.monotonic() + (BAN_S if for_s is None else for_s)
        self._banned[peer] = (max(until, self._banned.get(peer, (until,))[0]), reason)
        live = [p for p in list(self._banned) if self.is_banned(p)]
        ends = time.time() - time.monotonic()  # the host compares wall-clock ends: its monotonic clock is its own
        self._ids.value = joined_ids([f"{p.to_base58()}@{self._banned[p][0] + ends:.0f}" for p in live])
        return new

    def is_banned(self, peer: PeerID) -> bool:
        until, _ = self._banned.get(peer, (None, ""))
        if until is not None and until < time.monotonic():
            del self._banned[peer]
            return False
        return until is not None

    def reason(self, peer: PeerID) -> str:
        """Why ``peer`` is excluded (it must be)."""
        return self._banned[peer][1]

    @property
    def total(self) -> int:
        return int(self._total.value)

    def live_ids(self) -> List[str]:
        """Base58 ids of the peers excluded now (host side: each entry with the wall-clock time its exclusion ends)."""
        now, live = time.time(), []
        for entry in split_ids(self._ids.value):
            peer, _, until = entry.partition("@")
            try:
                if float(until) > now:
                    live.append(peer)
            except ValueError:
                continue
        return live
