"""`p2ptrain status`: what the live peers of a run publish (progress, settings, data shards), read from the DHT as
a client, then a table or one JSON object."""

from __future__ import annotations

import time
from typing import Any, Dict

import click

from p2ptrain.cli.options import BadInput


def fetch_status(config: Any) -> Dict[str, Any]:
    """{"run_id", "peers": [one dict per live peer], "public_peers", "coverage"} of the run ``config`` names (a
    RunConfig; its swarm settings are changed to those of a short-lived client)."""
    from p2ptrain.swarm.dht import SwarmError, start_dht, stop_dht

    swarm = config.swarm
    swarm.reachability, swarm.host_maddrs = "client", ["/ip4/0.0.0.0/tcp/0"]
    try:
        dht = start_dht(swarm, role="status reads the records as a short-lived client", reader=True)
    except SwarmError as e:
        raise BadInput(str(e)) from None
    try:
        return read_status(dht, config.run_id)
    finally:
        stop_dht(dht)


def read_status(dht: Any, run_id: str, *, strict: bool = False) -> Dict[str, Any]:
    """``fetch_status``'s answer, read through a running DHT (the dashboard keeps one); ``strict``: a failed read of
    the progress records raises (see ``fetch_progress``)."""
    from p2ptrain.swarm.progress import fetch_progress
    from p2ptrain.swarm.relays import peer_mode
    from p2ptrain.swarm.shards import coverage, cursor_progress, fetch_cursors

    records = fetch_progress(dht, run_id, strict=strict)
    cursors = fetch_cursors(dht, run_id)
    peers = [
        dict(peer_id=r.peer_id, outer_step=r.outer_step, local_step=r.local_step,
             samples_per_s=round(r.samples_per_s, 2), last_seen=round(r.timestamp, 3),
             mode=peer_mode(r), reachability=r.reachability,
             # what the run agrees on, and each worker's own settings (which may differ between workers)
             model=r.model, num_parameters=r.num_parameters, local_steps=r.local_steps, compression=r.compression,
             data=r.data, batch_size=r.batch_size, block_size=r.block_size, threads=r.threads)
        for r in records
    ]
    public = sum(p["mode"] == "public" for p in peers)
    relayed = sum(p["mode"] == "relayed" for p in peers)
    # the data: which shard each worker is on, how far the swarm got through it (passes), and through the corpus;
    # cursors from a later outer step than any live peer's are an earlier run's under this run id
    data_seen = coverage(cursors.values(), max_outer_step=max((r.outer_step for r in records), default=None))
    for p, r in zip(peers, records):
        cursor = cursors.get(r.shard_index) if r.HasField("shard_index") else None
        p["shard"] = r.shard_index if r.HasField("shard_index") else None
        p["shard_passes"] = round(cursor_progress(cursor), 3) if cursor is not None else 0.0
    return {"run_id": run_id, "peers": peers, "public_peers": public, "relayed_peers": relayed, "coverage": data_seen}


def print_status(status: Dict[str, Any]) -> None:
    """The table ``fetch_status``'s answer makes, with what an operator should know about it."""
    peers, public, data_seen = status["peers"], status["public_peers"], status["coverage"]
    relayed = status.get("relayed_peers", 0)
    click.echo(f"run {status['run_id']}: {len(peers)} peer(s), {public} public (can lead groups and reduce), "
               f"{relayed} relayed (behind NAT; lead and reduce through the bootstrap's relays while no peer is "
               f"public), {len(peers) - public - relayed} in client mode (behind NAT)")
    if peers:
        click.echo(f"{'peer_id':<54} {'mode':>7} {'outer':>6} {'local':>8} {'samples/s':>10} {'last seen':>10} "
                   f"{'shard':>6} {'passes':>6}")
        for p in peers:
            age = max(0.0, time.time() - p["last_seen"])
            shard = "-" if p["shard"] is None else p["shard"]
            click.echo(f"{p['peer_id']:<54} {p['mode']:>7} {p['outer_step']:>6} {p['local_step']:>8} "
                       f"{p['samples_per_s']:>10.1f} {age:>8.0f}s ago {shard:>6} {p['shard_passes']:>6.2f}")
        for p in peers:
            if p["reachability"]:
                click.echo(f"  {p['peer_id'][-8:]} {p['reachability']}")
        for p in peers:
            if p["num_parameters"]:
                click.echo(f"  {p['peer_id'][-8:]} model {p['model'] or '(unnamed)'} ({p['num_parameters']:,} "
                           f"parameters), H={p['local_steps']}, {p['compression']}; batch size {p['batch_size']}, "
                           f"{p['threads']} thread(s), data: {p['data'] or '-'}")
    if data_seen:
        click.echo(f"data: {data_seen['fraction_seen']:.1%} of the corpus seen at least once; "
                   f"{data_seen['shards_complete']} of {data_seen['num_shards']} shards complete, "
                   f"{data_seen['passes']} full pass(es) over all of them")
    elif peers:
        click.echo("data: no shard cursor published yet (they come after each committed round)")
    if peers and not public and not relayed:
        click.echo("no peer can lead a group: every peer is behind NAT; rounds cannot form until a worker with a "
                   "public address (or a forwarded port) joins, or the bootstrap peer offers relays (--relays)")
