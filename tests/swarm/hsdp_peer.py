"""One DiLoCo peer made of the ranks of a torchrun job: the tiny model sharded with FSDP2 on an HSDP mesh (gloo).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/swarm/hsdp_peer.py \
        --initial-peers MADDR --out DIR --syncs 3 --local-steps 5

Rank r trains on rows [r*B/W, (r+1)*B/W) of each batch of data shard 0, so the peer as a whole sees the same
batches as a single-rank peer on shard 0 (tests/swarm/test_hsdp.py). The leader writes DIR/digests.json ([outer step,
digest of the global parameters, caught up?] of every sync) and DIR/global.pt (the final global parameters). With --save CKPT it
then writes a sharded checkpoint and DIR/saved.pt (full model, AdamW moments, counters, global parameters); with
--load CKPT it starts from the checkpoint and writes the same for what it loaded to DIR/loaded.pt. With --catch-up
it first takes the swarm's state (catch_up_if_behind) and writes what it took to DIR/caught.pt; with --serve it
writes DIR/served.pt after training and stays in the swarm (a donor, not stepping) until DIR/done exists.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from functools import partial
from pathlib import Path

import hivemind
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from p2ptrain.data import ShardedBatches, load_corpus, split_train_val
from p2ptrain.diloco import DiLoCoOptimizer
from p2ptrain.hsdp import ShardedDiLoCo, exit_rank, shard_model
from p2ptrain.model import build_model

BATCH = 4


def dump(opt: ShardedDiLoCo, model: torch.nn.Module, path: Path) -> None:
    """The peer's full model, AdamW moments, counters and global parameters, written by rank 0 (a collective)."""
    with torch.no_grad():
        params = [p.full_tensor() for p in model.parameters()]
        moments = [opt.inner.state[p]["exp_avg"].full_tensor() for p in model.parameters()]
        second = [opt.inner.state[p]["exp_avg_sq"].full_tensor() for p in model.parameters()]
        step = float(opt.inner.state[next(model.parameters())]["step"])
    if dist.get_rank() == 0:  # written whole, then renamed: the test polls for the file and reads it at once
        unfinished = path.with_name(path.name + ".partial")
        torch.save({"model": params, "exp_avg": moments, "exp_avg_sq": second, "step": step,
                    "counters": [opt.local_step, opt.outer_step], "global": opt.global_state()["global_params"]},
                   unfinished)
        os.replace(unfinished, path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", default=None, help="a live peer to join (default: a swarm of its own)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--compression", default="none")
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--no-group-policy", default=None, help="default: wait with --initial-peers, else apply_local")
    parser.add_argument("--catch-up", action="store_true")
    parser.add_argument("--serve", action="store_true")
    parser.add_argument("--save", default=None, help="after training, write a sharded checkpoint here")
    parser.add_argument("--load", default=None, help="before training, load the sharded checkpoint from here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    model = build_model("tiny", seed=0)
    model.activation_checkpointing = args.activation_checkpointing
    shard_model(model, mesh)

    dht = None
    diloco = None
    policy = args.no_group_policy or ("wait" if args.initial_peers else "apply_local")
    if rank == 0:
        initial_peers = [args.initial_peers] if args.initial_peers else []
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial_peers)
        diloco = partial(DiLoCoOptimizer, dht=dht, run_id="hsdp", local_steps=args.local_steps,
                         outer_optimizer=partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
                         compression=args.compression, target_group_size=2, batch_size=BATCH,
                         catch_up_mid_phase=False,  # the ranks catch up together, at a sync
                         # alone (no --initial-peers), every round applies the peer's own pseudo-gradient, quickly
                         no_group_policy=policy, matchmaking_time_s=5.0 if policy == "wait" else 1.0)
    opt = ShardedDiLoCo(model, inner_optimizer=partial(torch.optim.AdamW, lr=1e-3), local_steps=args.local_steps,
                        diloco=(lambda params, inner: diloco(params, inner_optimizer=inner)) if diloco else None)
    train, _ = split_train_val(load_corpus(None))
    batches = ShardedBatches(train, block_size=model.config.block_size, batch_size=BATCH, shard_index=0, num_shards=2)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    try:
        if args.load:
            opt.load_checkpoint(args.load, model)
            dump(opt, model, Path(args.out) / "loaded.pt")
        if args.catch_up:
            assert opt.catch_up_if_behind(), "took no state from the swarm"
            dump(opt, model, Path(args.out) / "caught.pt")
        while opt.outer_step < args.syncs:
            x, y = next(batches)
            _, loss = model(x[rows], y[rows])
            loss.backward()
            opt.step(batch_size=BATCH)
            opt.zero_grad()
        if rank == 0:
            out = Path(args.out)
            # every sync's record, a caught-up one included (after a catch-up the counters may sit mid-phase)
            syncs = [[record.outer_step, record.digest, record.caught_up] for record in opt.diloco.history]
            (out / "digests.json").write_text(json.dumps(syncs))
            torch.save(opt.global_state()["global_params"], out / "global.pt")
        if args.save:
            opt.save_checkpoint(args.save, model)
            dump(opt, model, Path(args.out) / "saved.pt")
        if args.serve:
            dump(opt, model, Path(args.out) / "served.pt")
            deadline = time.monotonic() + 120
            while not (Path(args.out) / "done").exists() and time.monotonic() < deadline:
                time.sleep(0.2)
    finally:
        opt.close()
        if dht is not None:
            dht.shutdown()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_rank(0)  # as `p2ptrain join` ranks do: no interpreter finalization racing gloo's worker threads
