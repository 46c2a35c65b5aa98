"""One DiLoCo peer of test_chaos.py's split-round test: a model of one weight tensor on a plain hivemind DHT.

    python tests/swarm/mixed_round_peer.py --index I --dir DIR --outer-steps N [--initial-peers MADDR] [--split]

The model is one tensor of three 512 KiB fp16 parts, so that in a group of three every member reduces exactly one
part. A reducer answers every sender of a part at once (they all wait on the same average), so
``P2PTRAIN_FAULT=kill-mid-allreduce@S:<n>`` alone gives either everyone or nobody its range. With ``--split`` this
peer (the victim; the survivors run p2ptrain unchanged) withholds the average of the round the fault fires in from
all senders but the first, waits until that first sender has committed the round, and then dies as the
fault does (SIGKILL of its whole tree): one survivor holds every range, the other lacks this one. The peer writes DIR/maddrs-I (its addresses),
DIR/ready-I once its optimizer is up, waits for DIR/go (so that every peer is in the first round), then trains
with ``step()`` and rewrites DIR/peer-I.json (one entry per sync record) after every sync, until the swarm's outer
step reaches N.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
from functools import partial
from pathlib import Path

import hivemind
import torch

from p2ptrain import DiLoCoOptimizer
from p2ptrain.averaging import averager as averager_module
from p2ptrain.averaging.allreduce import ExactAllReduceRunner
from p2ptrain.faults import kill_this_peer

LOCAL_STEPS = 3
BATCH = 8


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def answer_one_sender_then_die(folder: Path, index: int) -> None:
    """Make this peer's reducer, in the round P2PTRAIN_FAULT names (the runner then has ``_die_after_parts`` set),
    answer only the first sender whose stream asks for the average, and die once that sender has committed the round
    (its DIR/peer-J.json shows the next outer step). Dying when the first sender's stream ended was too early: the
    last answer could still be in this peer's p2pd, and then neither survivor had it (1 run in 3)."""
    accumulate = ExactAllReduceRunner._accumulate_parts_streaming
    round_from = int(re.search(r"@(\d+)", os.environ["P2PTRAIN_FAULT"]).group(1))

    def records(path: Path) -> list:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return []

    def this_round() -> int:
        """The outer step the round starts from: the fault's, or later if this peer was left out of that one (the
        fault fires in the first round it takes part in from that step on)"""
        return max([round_from, *(r["outer_step"] for r in records(folder / f"peer-{index}.json"))])

    def someone_committed(round_start: int) -> bool:
        return any(r["outer_step"] == round_start + 1 for path in folder.glob("peer-*.json")
                   if path.name != f"peer-{index}.json" for r in records(path))

    async def split(self, stream, sender_index):
        if self._die_after_parts is None:
            async for message in accumulate(self, stream, sender_index):
                yield message
            return
        if not hasattr(self, "_first_sender"):
            self._first_sender, self._round_start = sender_index, this_round()
        async for message in accumulate(self, stream, sender_index):
            if sender_index != self._first_sender:
                deadline = time.monotonic() + 30
                while not someone_committed(self._round_start) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                print("split fault: the first sender has its averages; dying before answering the others",
                      flush=True)
                kill_this_peer()
            yield message

    ExactAllReduceRunner._accumulate_parts_streaming = split


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--index", type=int, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--outer-steps", type=int, required=True)
    parser.add_argument("--initial-peers", nargs="*", default=[])
    parser.add_argument("--split", action="store_true")
    args = parser.parse_args()
    if args.split:
        answer_one_sender_then_die(args.dir, args.index)
    # every range one part, as the model is sized for: hivemind's 512 KiB, not the size the group's link rates pick
    # (protocol 11; on a loaded host it picked 256 KiB, two parts a range, and the split never came: CI)
    averager_module.round_part_size = lambda members, default: default
    torch.set_num_threads(1)

    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=args.initial_peers)
    write_atomically(args.dir / f"maddrs-{args.index}", "\n".join(str(a) for a in dht.get_visible_maddrs()))
    torch.manual_seed(0)
    model = torch.nn.Linear(1024, 768, bias=False)  # 3 x 2**18 values: 3 fp16 parts of 512 KiB, one per range
    opt = DiLoCoOptimizer(model.parameters(), dht=dht, run_id="split", local_steps=LOCAL_STEPS,
                          inner_optimizer=partial(torch.optim.AdamW, lr=1e-2),
                          outer_optimizer=partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
                          compression="fp16", matchmaking_time_s=2.0, averaging_timeout_s=10.0, batch_size=BATCH,
                          no_group_policy="wait").start()
    try:
        (args.dir / f"ready-{args.index}").touch()
        while not (args.dir / "go").exists():
            time.sleep(0.05)
        gen = torch.Generator().manual_seed(100 + args.index)
        target = torch.randn(1024, 768, generator=gen) / 32
        while opt.outer_step < args.outer_steps:
            x = torch.randn(BATCH, 1024, generator=gen)
            torch.nn.functional.mse_loss(model(x), x @ target).backward()
            synced = len(opt.history)
            opt.step()
            opt.zero_grad()
            if len(opt.history) > synced:
                records = [dict(outer_step=r.outer_step, averaged=r.averaged, group_size=r.group_size,
                                caught_up=r.caught_up, repaired=r.repaired, attempts=r.attempts, digest=r.digest,
                                finished_at=r.finished_at) for r in opt.history]
                write_atomically(args.dir / f"peer-{args.index}.json", json.dumps(records))
    finally:
        opt.close()
        dht.shutdown()


if __name__ == "__main__":
    main()
