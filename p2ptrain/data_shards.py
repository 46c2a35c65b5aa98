"""Which data shard this peer trains on, and the cursors it leaves for the swarm.

A peer starts on the data shard it claimed (``swarm/shards.py``) where the swarm's training of it got to, moves on
to the least seen unclaimed data shard after each pass over its own (or when another live peer trains on the same
one), and after every committed round publishes a cursor for each data shard it trained on: only then did those
samples reach the swarm's parameters. The leader of a multi-rank peer decides and broadcasts; every rank iterates
the same batches.
"""

from __future__ import annotations

import logging
import time
from typing import Dict, Optional

from p2ptrain.data import ShardedBatches
from p2ptrain.ranks import PeerRanks
from p2ptrain.swarm.progress import ProgressPublisher, fetch_progress
from p2ptrain.swarm.shards import (
    cursor_state,
    fetch_cursor,
    fetch_cursors,
    pick_next_shard,
    publish_cursor,
    shard_progress,
)
from p2ptrain.worker_report import WorkerReport

logger = logging.getLogger(__name__)


class DataShardTracker:
    """Keeps ``batches`` on this peer's data shard, and ``report`` and the progress record told which it is.

    :param pinned: the peer was given ``--shard-index``: it trains on that data shard only
    :param dht, publisher: the leader's (None on the other ranks)
    """

    def __init__(self, run_id: str, ranks: PeerRanks, report: WorkerReport, *, pinned: bool, dht,
                 publisher: Optional[ProgressPublisher]):
        self.run_id, self.ranks, self.report, self.pinned = run_id, ranks, report, pinned
        self.dht, self.publisher = dht, publisher
        self.batches: Optional[ShardedBatches] = None  # set by the worker once made (with on_epoch_end below)
        # data shard -> the furthest state of it this peer knows of (left or published)
        self._seen: Dict[int, dict] = {}
        self._stores: list = []  # futures of the cursor stores of the last commit (flush)

    @property
    def _outer_step(self) -> int:
        return self.ranks.optimizer.outer_step

    def continue_from_cursor(self) -> None:
        """Continue this data shard where the swarm's training of it got to, if that is ahead of us: its previous
        owner left or died (or we resumed from an older checkpoint). Cursors from a later outer step than ours are
        from an earlier run under the same run id, and are ignored."""
        state = self.ranks.broadcast(self._take_cursor() if self.ranks.leader else None)
        if state is not None and not self.ranks.leader:  # the leader's batches moved already
            self.batches.load_state_dict(state)

    def _take_cursor(self) -> Optional[dict]:
        """Move ``batches`` to the data shard's published cursor if it applies; returns that position (a
        ``ShardedBatches`` state) for the other ranks, or None."""
        batches, peer = self.batches, self.report.peer_id
        cursor = fetch_cursor(self.dht, self.run_id, batches.shard_index)
        if cursor is None or (cursor.epoch, cursor.position) <= (batches.epoch, batches.position):
            return None
        if cursor.outer_step > self._outer_step:
            logger.warning(f"[{peer}] ignoring the data cursor of shard {batches.shard_index} from outer step "
                           f"{cursor.outer_step}: this run is at {self._outer_step} (an earlier run with this run id?)")
            return None
        state = cursor_state(cursor)
        try:
            batches.load_state_dict(state)  # refuses a position from another data layout
        except ValueError as e:
            logger.warning(f"[{peer}] ignoring the data cursor of shard {batches.shard_index}: {e}")
            return None
        self.report.data_cursor = {"from_peer": cursor.peer_id, "outer_step": cursor.outer_step,
                                   "epoch": cursor.epoch, "position": cursor.position}
        logger.info(f"[{peer}] continuing shard {batches.shard_index} at epoch {cursor.epoch}, sample "
                    f"{cursor.position}, where {cursor.peer_id[-8:]} left it at outer step {cursor.outer_step}")
        return state

    def note(self, why: str) -> None:
        """Record (report, progress record) that this peer now trains on ``batches``' current data shard."""
        batches, opt = self.batches, self.ranks.optimizer
        self.report.shard_index = batches.shard_index
        self.report.shard_history.append({
            "shard": batches.shard_index, "epoch": batches.epoch, "position": batches.position,
            "outer_step": opt.outer_step, "local_step": opt.local_step, "why": why,
        })
        if self.publisher is not None and self.publisher.shard_index != batches.shard_index:
            self.publisher.shard_index = batches.shard_index
            # and the ones left since the last commit: no cursor tells the others of them yet (after_commit)
            self.publisher.left_shards = tuple(sorted(set(batches.left_shards) - {batches.shard_index}))
            diloco = self.ranks.diloco  # at once: other peers choosing a data shard now must see this claim
            self.publisher.publish(outer_step=diloco.outer_step, local_step=diloco.local_step,
                                   samples_per_s=diloco.samples_per_s, samples_since_sync=diloco.samples_since_sync)

    def on_epoch_end(self, finished: dict) -> Optional[dict]:
        """``ShardedBatches.on_epoch_end``: a pass over the current data shard is complete; where to go on. Called on
        every rank at the same batch (the ranks iterate the same batches): the leader chooses and broadcasts."""
        self._seen[finished["shard_index"]] = finished
        choice = self.ranks.broadcast(self._choose(finished, conflict=False) if self.ranks.leader else None)
        if choice is not None:
            self.batches.load_state_dict(choice)
            self.note(f"finished {finished['shard_index']}")
        return choice

    def _choose(self, current: dict, conflict: bool) -> Optional[dict]:
        """On the leader: the state to go on from when leaving the data shard of ``current`` (its pass is complete,
        or ``conflict``: another live peer with a smaller peer id trains on it too), or None to stay. The least seen
        data shard that no other live peer claims, where the swarm's training of it got to."""
        batches = self.batches
        me, mine = self.report.peer_id, current["shard_index"]
        records = fetch_progress(self.dht, self.run_id)
        others = [r for r in records if r.peer_id != me and r.HasField("shard_index")]
        if conflict and not any(r.shard_index == mine and r.peer_id < me for r in others):
            return None
        # a data shard another peer left within this round is no less taken: its samples come with that peer's
        # next commit (without this, a peer saw it unseen and trained on it again: CI once ended at 98% seen)
        claimed = {r.shard_index for r in others}.union(*(r.left_shards for r in others))
        cursors = fetch_cursors(self.dht, self.run_id)
        progress = shard_progress(cursors.values(), batches.num_shards, self._outer_step, layout=current)
        starts: Dict[int, dict] = {}
        for index, cursor in cursors.items():
            state = cursor_state(cursor)
            if index in progress and state == {**batches.state_for(index), "epoch": state["epoch"],
                                               "position": state["position"]}:
                starts[index] = state
        for index, state in {**self._seen, mine: current}.items():
            passes = state["epoch"] + state["position"] / state["samples_per_epoch"]
            progress[index] = max(progress.get(index, 0.0), passes)
            if index not in starts or (state["epoch"], state["position"]) > (starts[index]["epoch"],
                                                                                starts[index]["position"]):
                starts[index] = state
        pick = pick_next_shard(batches.num_shards, progress, claimed, me)
        if pick is None or pick == mine:
            if not conflict:
                logger.info(f"[{me}] shard {mine} done ({current['epoch']} pass(es)); every other shard is claimed "
                            f"by a live peer or seen as often: pass {current['epoch'] + 1} of shard {mine}")
            return None
        state = starts.get(pick, batches.state_for(pick))
        if state["position"] >= state["samples_per_epoch"]:  # defensive: a cursor at the very end is a pass done
            state = {**state, "epoch": state["epoch"] + 1, "position": 0}
        seen = progress.get(pick, 0.0)
        why = (f"another live peer ({min(r.peer_id for r in others if r.shard_index == mine)[-8:]}) trains on "
               f"shard {mine} too" if conflict else f"shard {mine} done ({current['epoch']} pass(es))")
        logger.info(f"[{me}] {why}; moving on to shard {pick} ({'unseen' if seen == 0 else f'{seen:.2f} passes seen'}"
                    f"), at epoch {state['epoch']}, sample {state['position']}")
        return state

    def flush(self, timeout_s: float = 5.0) -> None:
        """Wait (at most ``timeout_s`` in all) for the cursor stores still in flight: a peer that leaves right after
        its last commit shuts its DHT down next, which dropped them (CI: a data shard finished in the last phase
        showed at 97 of 105 samples, the cursor of the round before)."""
        deadline = time.monotonic() + timeout_s
        for store in self._stores:
            try:
                store.result(timeout=max(deadline - time.monotonic(), 0.0))
            except Exception as e:
                logger.warning(f"a data cursor may not have reached the swarm before leaving: {e!r}")
        self._stores = []

    def after_commit(self) -> None:
        """After a committed round, on every rank: move off a data shard another live peer took too (one with a
        smaller peer id stays), then (leader) publish the cursors: of each data shard left since the previous round,
        where it was left, and of the current one. Only now did those samples reach the swarm's parameters."""
        batches = self.batches
        if not self.pinned:
            move = self._choose(batches.state_dict(), conflict=True) if self.ranks.leader else None
            move = self.ranks.broadcast(move)
            if move is not None:
                batches.load_state_dict(move)
                self.note("conflict")
        left, batches.left_shards = batches.left_shards, {}
        if not self.ranks.leader:
            return
        states = {index: state for index, state in left.items() if index != batches.shard_index}
        states[batches.shard_index] = batches.state_dict()
        # a cursor only moves forward: another peer that trained on the same data shard (two picked it at once) may
        # have published a position further through its order already; samples up to there did reach the swarm
        published = fetch_cursors(self.dht, self.run_id) if not self.pinned else {}
        self._stores = [store for store in self._stores if not store.done()]
        for index, state in states.items():
            cursor = published.get(index)
            if cursor is not None and cursor.outer_step <= self._outer_step:
                theirs = cursor_state(cursor)
                if theirs == {**state, "epoch": theirs["epoch"], "position": theirs["position"]} and \
                        (theirs["epoch"], theirs["position"]) > (state["epoch"], state["position"]):
                    self._seen[index] = theirs
                    continue
            self._stores.append(publish_cursor(self.dht, self.run_id, state, self._outer_step))
            if index != batches.shard_index:
                self._seen[index] = max(state, self._seen.get(index, state),
                                        key=lambda st: (st["epoch"], st["position"]))
        if self.publisher is not None:
            self.publisher.left_shards = ()  # their cursors are out: the next record claims the current shard only
