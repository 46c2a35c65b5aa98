"""Where one DiLoCo sync's seconds go, against what hivemind's P2P streams can carry on the same machine.

    python benchmarks/bench_sync.py --model small --peers 1 2 4 --syncs 5
    python benchmarks/bench_sync.py --model 124m --peers 1 2 4 --json sync.json --png sync.png
    python benchmarks/bench_sync.py --model path/to/hf_folder --device cuda

Each peer is its own process with its own DHT (and p2pd), a model (a built-in size, a Hugging Face folder with a
config.json, or ``package.module:factory``) and a ``DiLoCoOptimizer``, on 127.0.0.1. Between syncs every peer nudges
its parameters with fresh noise (a pseudo-gradient of realistic bits and size, no training: one direction the peers
share that sync plus each one's own, as peers learning one task have), then all peers sync at
once (a barrier), so each sync's seconds are the sync alone. ``--peers 1`` times a lone peer's sync: no all-reduce,
only the fixed costs around it. Each sync's time is split into its phases (see
``SyncRecord.phases``): publish, plan, pseudo_gradient, matchmaking, allreduce, outer_step, digest, record, and
inside the all-reduce the CPU seconds of encode, decode, checks and the result's write (these overlap the wire).

``--rate-mbit R`` puts each peer in a network namespace of its own with an R Mbit/s link both ways (``tc tbf``,
``p2ptrain.bench.netns``; root), as the swarm benchmark does, and adds each sync against the bandwidth bound: the
butterfly's bytes per peer over the link rate. ``--mlp M`` averages a plain MLP of about M million parameters instead
of a language model (the shape the anchors' side by side used); ``--defaults`` leaves the group settings at the
optimizer's defaults, as a user's peer has them.

    python benchmarks/bench_sync.py --mlp 10 --peers 3 --rate-mbit 100 --defaults --syncs 5 --no-ceiling

``--aggregation mean mean+check`` compares reducers' rules, here the sender check's cost (its sums at the reducers,
the scores at every member) against the plain mean.

The transport ceiling is measured first with the same number of processes: each opens a raw hivemind P2P stream to
every other peer (p2pd to p2pd, as the all-reduce's streams go) and writes 1 MiB chunks while it reads the streams
the others opened. Its MB/s, and the all-reduce's, are bytes sent plus received per peer per second.

Prints a table; ``--json FILE`` writes every figure, ``--png FILE`` a bar chart of the split (needs matplotlib).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import signal
import statistics
import sys
import threading
import time
from functools import partial
from typing import List, Optional

MiB = 2 ** 20
PHASES = ("publish", "plan", "pseudo_gradient", "matchmaking", "allreduce", "outer_step", "digest", "record")
ALLREDUCE_WORK = ("encode", "decode", "checks", "write")
BYTES_PER_VALUE = {"none": 4, "fp16": 2, "bf16": 2, "int8": 1 + 4 / 1024}


# ------------------------------------------------------------------------------------------- transport ceiling

def _enter_namespace(net: dict, index: int) -> None:
    """Move this process (before it opens any socket) into peer ``index``'s namespace, a ``p2ptrain.bench.netns``
    host, if ``net`` names namespaces; the p2pd it starts inherits it. Python 3.11 has no ``os.setns``: libc's,
    through ctypes."""
    if not net.get("namespaces"):
        return
    import ctypes

    namespace = net["namespaces"][index]
    clone_newnet = 0x40000000
    fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, clone_newnet) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
    finally:
        os.close(fd)


def _host(args: dict, index: int) -> str:
    """The address peer ``index`` listens on: its namespace's, or loopback."""
    return args["addresses"][index] if args.get("addresses") else "127.0.0.1"


def _ceiling_peer(index: int, peers: int, megabytes: int, maddrs, barrier, results, net: dict) -> None:
    _enter_namespace(net, index)
    from hivemind.p2p import P2P, PeerID

    async def main() -> None:
        while len(maddrs) < index:  # peer k dials peers 0..k-1 as it starts: every pair is connected
            await asyncio.sleep(0.05)
        earlier = [a for j in range(index) for a in maddrs[j]]
        p2p = await P2P.create(host_maddrs=[f"/ip4/{_host(net, index)}/tcp/0"], initial_peers=earlier)
        maddrs[index] = [str(m) for m in await p2p.get_visible_maddrs()]
        received = {"bytes": 0}
        done_reading = asyncio.Event()
        expected = (peers - 1) * megabytes * MiB

        async def handle(_info, reader, writer):
            while True:
                chunk = await reader.read(4 * MiB)
                if not chunk:
                    break
                received["bytes"] += len(chunk)
                if received["bytes"] >= expected:
                    done_reading.set()
            writer.close()

        await p2p.add_binary_stream_handler("bench_ceiling", handle)
        await asyncio.get_event_loop().run_in_executor(None, barrier.wait)
        others = [PeerID.from_base58(maddrs[j][0].rsplit("/p2p/", 1)[1]) for j in range(peers) if j != index]
        chunk = os.urandom(MiB)

        async def send(peer_id) -> None:
            _, _, writer = await p2p.call_binary_stream_handler(peer_id, "bench_ceiling")
            for _ in range(megabytes):
                writer.write(chunk)
                await writer.drain()
            writer.close()

        started = time.perf_counter()
        await asyncio.gather(*(send(peer) for peer in others), done_reading.wait())
        elapsed = time.perf_counter() - started
        results[index] = (2 * expected) / elapsed / 1e6  # sent + received per second, as the all-reduce's MB/s
        await asyncio.get_event_loop().run_in_executor(None, barrier.wait)
        await p2p.shutdown()

    asyncio.run(main())


def transport_ceiling(peers: int, megabytes: int = 256, net: Optional[dict] = None) -> float:
    """MB/s (sent + received) per peer through raw hivemind P2P streams, every peer to every other at once."""
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        maddrs, results = manager.dict(), manager.dict()
        barrier = ctx.Barrier(peers)
        procs = [ctx.Process(target=_ceiling_peer, args=(i, peers, megabytes // max(peers - 1, 1), maddrs, barrier,
                                                          results, net or {})) for i in range(peers)]
        for p in procs:
            p.start()
        join_peers(procs, barrier, timeout_s=300)
        if len(results) != peers:
            raise RuntimeError("the transport ceiling measurement failed (a peer process died)")
        return statistics.mean(results.values())


# ----------------------------------------------------------------------------------------------- sync peers

class _PeakMemory:
    """Samples the RSS of this process and its averager (not p2pd: its buffers are the transport's) every 50 ms;
    ``peak`` is the largest sum. The processes are listed once: walking /proc at every sample costs a core."""

    def __init__(self):
        import psutil

        me = psutil.Process()
        self._processes = [me, *(p for p in me.children(recursive=True) if p.name() != "p2pd")]
        self.peak, self._stop = 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def now(self) -> int:
        total = 0
        for proc in self._processes:
            try:
                total += proc.memory_info().rss
            except Exception:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.now())
            time.sleep(0.05)

    def cpu_seconds(self) -> float:
        """CPU seconds used so far by this process, its averager and its p2pd (the DHT's too)."""
        import psutil

        total = 0.0
        for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except Exception:
                pass
        return total

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _mlp(millions: float, width: int = 1024):
    """A plain MLP of about ``millions`` million parameters: square layers of ``width`` with biases."""
    from torch import nn

    layers = max(1, round(millions * 1e6 / (width * width + width)))
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(layers)))


def _sync_peer(index: int, args: dict, maddrs, barrier, results) -> None:
    # SIGTERM (gpu_figures.end_children, after a piece ran out of time) exits through the finally blocks below and
    # multiprocessing's finalizers, which stop the DHT and averager and remove this process's /tmp/pymp-* folder
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    _enter_namespace(args, index)
    mp.set_start_method("fork", force=True)  # a spawned child inherits "spawn"; hivemind forks its averager
    import torch

    from p2ptrain import DiLoCoOptimizer
    from p2ptrain.config import DiLoCoConfig, SwarmConfig
    from p2ptrain.model_source import build_from_spec, resolve_model
    from p2ptrain.swarm.dht import start_dht, stop_dht, visible_maddrs

    torch.set_num_threads(args["threads"])
    torch.manual_seed(1000 + index)
    device = torch.device(args["device"])
    if args.get("mlp"):
        torch.manual_seed(0)
        model = _mlp(args["mlp"]).to(device)
    else:
        model = build_from_spec(resolve_model(args["model"]), seed=0).to(device)
    host = [f"/ip4/{_host(args, index)}/tcp/0"]
    if index == 0:
        dht = start_dht(SwarmConfig(host_maddrs=host, reachability="public"))
        maddrs[0] = visible_maddrs(dht)
    barrier.wait()
    if index:
        dht = start_dht(SwarmConfig(initial_peers=maddrs[0], host_maddrs=host, reachability="public"))
    sparse = args["compression"] == "sparse"  # one group of the whole swarm: min_group_size holds it together
    if args.get("defaults"):  # the group settings a user's peer has: none given
        group = {}
    else:
        group = dict(target_group_size=None if sparse else args["peers"],
                     min_group_size=max(args["peers"], 1) if sparse else 2, matchmaking_time_s=5.0,
                     averaging_timeout_s=600.0)
    settings = DiLoCoConfig(compression=args["compression"], aggregation=args.get("aggregation", "mean"), **group)
    opt = DiLoCoOptimizer(
        model.parameters(), dht=dht, run_id="bench-sync", local_steps=1,
        inner_optimizer=partial(torch.optim.SGD, lr=0.0),
        outer_optimizer=partial(torch.optim.SGD, lr=1.0) if sparse else
        partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True), settings=settings,
    ).start()
    memory = baseline = None
    cpu: List[float] = []  # CPU seconds of this peer's processes per sync, from the second on
    try:
        for k in range(args["syncs"]):
            with torch.no_grad():  # one direction all peers share this sync, plus each one's own noise
                shared = torch.Generator(device=device).manual_seed(k)
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=shared, device=device), alpha=7e-4)
                    p.add_(torch.randn_like(p), alpha=7e-4)
            if device.type == "cuda":
                torch.cuda.synchronize()
            barrier.wait()
            if k == min(1, args["syncs"] - 1):  # from the second sync on: the outer momentum exists by then
                memory = _PeakMemory()
                baseline = memory.now()
            cpu_before = memory.cpu_seconds() if memory else 0.0
            opt.step()
            if memory:
                cpu.append(memory.cpu_seconds() - cpu_before)
        peak = memory.stop()
        time.sleep(1.0)  # the last round's audits (audit.py) run after it returns
        results[index] = dict(records=[r.to_dict() for r in opt.history], rss_before=baseline, rss_peak=peak, cpu=cpu,
                              audits=opt.averager.audits,
                              params=sum(p.numel() for p in model.parameters()), compression=args["compression"],
                              message_bytes=opt.sparse_message_bytes if sparse else None,
                              digests=[r.digest for r in opt.history])
    finally:
        opt.shutdown()
        stop_dht(dht)


def join_peers(procs, barrier, timeout_s: Optional[float] = None) -> None:
    """Wait for the peer processes to end. One that fails breaks the barrier: the others were waiting there for it
    (before a sync, or before the ceiling's streams), and leave through their ``BrokenBarrierError`` and finally
    blocks instead of hanging until someone kills them (which left their /tmp files behind)."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while any(p.is_alive() for p in procs) and (deadline is None or time.monotonic() < deadline):
        if any(p.exitcode not in (None, 0) for p in procs):
            barrier.abort()
        time.sleep(0.2)
    for p in procs:
        p.join(0 if deadline is not None else None)


def run_syncs(args: dict) -> List[dict]:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        maddrs, results = manager.dict(), manager.dict()
        barrier = ctx.Barrier(args["peers"])
        procs = [ctx.Process(target=_sync_peer, args=(i, args, maddrs, barrier, results))
                 for i in range(args["peers"])]
        for p in procs:
            p.start()
        join_peers(procs, barrier)
        if len(results) != args["peers"]:
            raise RuntimeError("a sync peer died; see its log above")
        return [results[i] for i in range(args["peers"])]


# ---------------------------------------------------------------------------------------------------- report

def summarize(peers: List[dict], ceiling: Optional[float], skip_first: bool, rate_mbit: Optional[float] = None) -> dict:
    """Means over every peer's syncs (the first left out when there are more: it pays for warm-up)."""
    records = [r for peer in peers for r in (peer["records"][1:] if skip_first else peer["records"])]
    agree = all(len({p["digests"][k] for p in peers}) == 1 for k in range(len(peers[0]["digests"])))
    mean = lambda values: statistics.mean(values) if values else 0.0  # noqa: E731
    split = {phase: mean([r.get("phases", {}).get(phase, 0.0) for r in records]) for phase in PHASES}
    work = {name: mean([r.get("phases", {}).get(f"allreduce.{name}", 0.0) for r in records]) for name in ALLREDUCE_WORK}
    seconds = mean([r["seconds"] for r in records])
    allreduce_s = mean([r["allreduce_s"] for r in records])
    moved = mean([r["bytes_sent"] + r["bytes_received"] for r in records])
    sent = mean([r["bytes_sent"] for r in records])
    rate = moved / allreduce_s / 1e6 if allreduce_s else 0.0
    n = len(peers)
    params = peers[0]["params"]
    # the butterfly's bytes per peer: its parts of the others' ranges out, the averages of its own range back
    bound = 2 * (n - 1) / n * params * BYTES_PER_VALUE.get(peers[0]["compression"], 4)
    if peers[0].get("message_bytes"):  # sparse: the all-gather's (n - 1) messages out (sparse_round.py)
        bound = (n - 1) * peers[0]["message_bytes"]
    return dict(
        peers=n, params=params, syncs=len(records), seconds=seconds, split=split, allreduce_work=work,
        non_wire_s=max(seconds - split["matchmaking"] - split["allreduce"], 0.0),
        allreduce_mb_s=rate, ceiling_mb_s=ceiling, of_ceiling=rate / ceiling if ceiling else None,
        bytes_moved=moved, bytes_sent=sent, butterfly_sent_bytes=bound, of_butterfly=sent / bound if bound else None,
        # with a link rate: the butterfly's bytes per peer over it, the least a sync can take
        rate_mbit=rate_mbit, bound_s=bound * 8 / (rate_mbit * 1e6) if rate_mbit and n > 1 else None,
        group_sizes=sorted({r["group_size"] for r in records}), digests_agree=agree,
        rss_before_mb=max(p["rss_before"] for p in peers) / 1e6,
        # CPU seconds of every peer's processes (host, averager, p2pd) per second of sync: the machine's cores busy
        cores_busy=sum(statistics.mean(p["cpu"]) for p in peers if p["cpu"]) / seconds if seconds else 0.0,
        rss_added_mb=max(p["rss_peak"] - p["rss_before"] for p in peers) / 1e6,
        # audits (averaging/audit.py): parts recomputed and bytes fetched for them, per peer per sync (all syncs)
        cpu_s=mean([statistics.mean(p["cpu"]) for p in peers if p["cpu"]]),  # per peer per sync, all processes
        audited_parts=mean([p["audits"]["parts"] / len(p["records"]) for p in peers]),
        audit_bytes=mean([p["audits"]["bytes"] / len(p["records"]) for p in peers]),
    )


def print_table(rows: List[dict]) -> None:
    head = ["codec", "peers", "sync s", *PHASES, "non-wire s", "AR MB/s", "ceiling", "of ceil", "+RSS MB"]
    print(" | ".join(head))
    for row in rows:
        codec = row["compression"] + (f" {row['aggregation']}" if row.get("aggregation", "mean") != "mean" else "")
        cells = [codec, str(row["peers"]), f"{row['seconds']:.3f}", *(f"{row['split'][p]:.3f}" for p in PHASES),
                 f"{row['non_wire_s']:.3f}", f"{row['allreduce_mb_s']:.0f}",
                 f"{row['ceiling_mb_s']:.0f}" if row["ceiling_mb_s"] else "-",
                 f"{row['of_ceiling']:.0%}" if row["of_ceiling"] else "-", f"{row['rss_added_mb']:.0f}"]
        print(" | ".join(cells))
    for row in rows:
        work = ", ".join(f"{k} {v:.3f}" for k, v in row["allreduce_work"].items())
        if row["peers"] == 1:
            print(f"peers=1: a lone peer's sync, no all-reduce; cores busy during a sync {row['cores_busy']:.2f}")
            continue
        if row.get("bound_s"):
            print(f"peers={row['peers']} at {row['rate_mbit']:g} Mbit/s: the bandwidth bound is {row['bound_s']:.2f} s; "
                  f"a sync takes {row['seconds'] / row['bound_s']:.2f}x it, the all-reduce "
                  f"{row['split']['allreduce'] / row['bound_s']:.2f}x, and {row['seconds'] - row['split']['allreduce']:.2f} s"
                  " of each sync is outside the all-reduce")
        print(f"peers={row['peers']}: all-reduce CPU seconds (overlapping the wire): {work}; bytes moved per peer "
              f"{row['bytes_moved'] / 1e6:.1f} MB; sent {row['bytes_sent'] / 1e6:.1f} MB = {row['of_butterfly']:.3f}x the "
              f"butterfly bound; "
              f"groups {row['group_sizes']}; digests agree: {row['digests_agree']}; cores busy during a sync "
              f"{row['cores_busy']:.2f} of {os.cpu_count()} ({row['cpu_s']:.2f} CPU s per peer per sync); audits: {row['audited_parts']:.1f} parts and "
              f"{row['audit_bytes'] / 1e6:.2f} MB fetched per peer per sync "
              f"({row['audit_bytes'] / max(row['bytes_moved'], 1):.1%} of the bytes moved)")


def draw(rows: List[dict], title: str, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no PNG: matplotlib is missing; pip install matplotlib", file=sys.stderr)
        return
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.8 * len(rows)))
    colors = dict(zip(PHASES, plt.get_cmap("tab10").colors))  # one color per phase in every row
    for y, row in enumerate(rows):
        left = 0.0
        for phase in PHASES:
            width = row["split"][phase]
            ax.barh(y, width, left=left, color=colors[phase], label=phase if y == 0 else None)
            left += width
    ax.set_yticks(range(len(rows)), [f"{r['compression']}, {r['peers']} peers\n{r['allreduce_mb_s']:.0f} of "
                                     f"{r['ceiling_mb_s']:.0f} MB/s" if r["peers"] > 1 else
                                     f"{r['compression']}, lone peer" for r in rows])
    ax.set_xlabel("seconds per sync")
    ax.set_title(title)
    ax.legend(fontsize=7, ncol=4, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="small", help="built-in size (tiny, small, 124m, ...), a Hugging Face "
                                                         "folder with config.json, or package.module:factory")
    parser.add_argument("--peers", type=int, nargs="+", default=[2])
    parser.add_argument("--syncs", type=int, default=4)
    parser.add_argument("--compression", nargs="+", default=["fp16"], help="wire codecs to compare")
    parser.add_argument("--device", default="cpu", help="where the model lives: cpu or cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per peer process")
    parser.add_argument("--ceiling-mb", type=int, default=512, help="MB each peer sends to measure the ceiling")
    parser.add_argument("--no-ceiling", action="store_true")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--redraw", metavar="JSON", help="only draw --png from a --json file an earlier run wrote")
    parser.add_argument("--png", help="draw the time split here")
    parser.add_argument("--mlp", type=float, help="average a plain MLP of about this many million parameters")
    parser.add_argument("--rate-mbit", type=float, help="each peer in a namespace with this link rate (root)")
    parser.add_argument("--defaults", action="store_true", help="the optimizer's default group settings")
    parser.add_argument("--aggregation", nargs="+", default=["mean"],
                        help="reducers' rules to compare (mean, trim, mean+check: the sender check, ...)")
    args = parser.parse_args()
    if args.rate_mbit is not None and args.rate_mbit <= 0:
        parser.error("--rate-mbit: a positive rate in Mbit/s")
    if args.mlp is not None and args.mlp <= 0:
        parser.error("--mlp: a positive number of million parameters")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here; run on a GPU machine or use --device cpu")
    if args.redraw:
        with open(args.redraw) as f:
            rows = json.load(f)
        draw(rows, f"sync of {rows[0]['model']} ({rows[0]['params'] / 1e6:.1f}M params)", args.png or "sync.png")
        return
    if any(peers < 1 for peers in args.peers):
        parser.error("--peers: at least 1 (1: a lone peer's sync, its fixed costs alone)")
    net = {}
    if args.rate_mbit:
        from p2ptrain.bench.netns import NetnsUnavailable, Topology

        try:
            topology = Topology(hosts=max(args.peers), rate_mbit=args.rate_mbit)
        except NetnsUnavailable as e:
            parser.error(f"--rate-mbit: {e}; run as root, or leave --rate-mbit out for loopback")
        net = dict(namespaces=topology.namespaces, addresses=topology.addresses)
    model = f"mlp-{args.mlp:g}M" if args.mlp else args.model
    rows, ceilings = [], {}
    try:
        for compression, aggregation in [(c, a) for c in args.compression for a in args.aggregation]:
            for peers in args.peers:
                if peers not in ceilings:
                    ceilings[peers] = (None if args.no_ceiling or peers == 1 else
                                       transport_ceiling(peers, args.ceiling_mb, net))
                    if ceilings[peers]:
                        print(f"transport ceiling, {peers} peers: {ceilings[peers]:.0f} MB/s sent+received per peer",
                              flush=True)
                results = run_syncs(dict(vars(args), peers=peers, compression=compression, aggregation=aggregation,
                                         **net))
                rows.append(summarize(results, ceilings[peers], skip_first=args.syncs > 1, rate_mbit=args.rate_mbit))
                rows[-1].update(model=model, compression=compression, aggregation=aggregation, device=args.device,
                                raw=results)
                print_table(rows[-1:])
    finally:
        if net:
            topology.close()
    print()
    print_table(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        draw(rows, f"sync of {model} ({rows[0]['params'] / 1e6:.1f}M params)", args.png)


if __name__ == "__main__":
    main()
