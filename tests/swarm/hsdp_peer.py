"""One DiLoCo peer made of the ranks of a torchrun job: the tiny model sharded with FSDP2 on an HSDP mesh (gloo).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/swarm/hsdp_peer.py \
        --initial-peers MADDR --out DIR --syncs 3 --local-steps 5

Rank r trains on rows [r*B/W, (r+1)*B/W) of each batch of data shard 0, so the peer as a whole sees the same
batches as a single-rank peer on shard 0 (tests/swarm/test_hsdp.py). The leader writes DIR/digests.json (the
global parameters' digest after every sync) and DIR/global.pt (the final global parameters).
"""

from __future__ import annotations

import argparse
import json
from functools import partial
from pathlib import Path

import hivemind
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from p2ptrain.data import ShardedBatches, load_corpus, split_train_val
from p2ptrain.diloco import DiLoCoOptimizer
from p2ptrain.hsdp import ShardedDiLoCo
from p2ptrain.model import build_model

BATCH = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--initial-peers", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--syncs", type=int, default=3)
    parser.add_argument("--local-steps", type=int, default=5)
    parser.add_argument("--compression", default="none")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("replicate", "shard"))
    model = build_model("tiny", seed=0)
    for block in model.transformer.h:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

    dht = None
    diloco = None
    if rank == 0:
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[args.initial_peers])
        diloco = partial(DiLoCoOptimizer, dht=dht, run_id="hsdp", local_steps=args.local_steps,
                         outer_optimizer=partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
                         compression=args.compression, target_group_size=2, no_group_policy="wait",
                         matchmaking_time_s=5.0, batch_size=BATCH)
    opt = ShardedDiLoCo(model, inner_optimizer=partial(torch.optim.AdamW, lr=1e-3), local_steps=args.local_steps,
                        diloco=(lambda params, inner: diloco(params, inner_optimizer=inner)) if diloco else None)
    train, _ = split_train_val(load_corpus(None))
    batches = ShardedBatches(train, block_size=model.config.block_size, batch_size=BATCH, shard_index=0, num_shards=2)
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    digests = []
    try:
        while opt.outer_step < args.syncs:
            x, y = next(batches)
            _, loss = model(x[rows], y[rows])
            loss.backward()
            opt.step(batch_size=BATCH)
            opt.zero_grad()
            if rank == 0 and opt.local_step % args.local_steps == 0:
                digests.append(opt.diloco.history[-1].digest)
        if rank == 0:
            out = Path(args.out)
            (out / "digests.json").write_text(json.dumps(digests))
            torch.save(opt.global_state()["global_params"], out / "global.pt")
    finally:
        opt.close()
        if dht is not None:
            dht.shutdown()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
