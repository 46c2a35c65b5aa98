"""One benchmark configuration: a bootstrap peer and N real `p2ptrain join` daemons, each on a host of its own.

With root, every daemon runs in its own network namespace behind a rate-limited link (``netns.Topology``) and the
bytes on the wire come from the switch ports' counters; without it, on loopback with no limit, and the bytes are
the payload the peers counted themselves (the report says which). Each worker is pinned to one CPU core and one
torch thread. The figures come from the workers' ``--report`` files (every round's seconds, all-reduce seconds,
cumulative compute seconds, eval loss, wall-clock end) and the counter samples.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional

from p2ptrain.bench.cpu import CpuQuota
from p2ptrain.bench.netns import Topology, bytes_between, wait_for_counters
from p2ptrain.bench.stall import Stall
from p2ptrain.daemons import DaemonError, spawn, stop_daemons, wait_for_address
from p2ptrain.memory import count_parameters
from p2ptrain.model import model_config

BYTES_PER_VALUE = {"none": 4, "fp16": 2, "bf16": 2, "int8": 1}


@dataclass(frozen=True)
class BenchConfig:
    model: str = "small"
    peers: int = 3
    rate_mbit: Optional[float] = 100.0
    local_steps: int = 60
    outer_steps: int = 3
    compression: str = "fp16"
    batch_size: int = 16
    matchmaking_time_s: float = 5.0
    behind_nat: int = 0
    """the last this-many workers each sit behind a NAT router of its own (netns.Topology), and pick client mode"""
    grouping: str = "pinned"
    """"pinned": every round is a round of all the peers (--target-group-size and --min-group-size = peers, "wait"
    policy, one data shard each); "defaults": none of those flags, the workers group as a user's would"""
    fragments: int = 1
    """streaming sync: fragments (1 and overlap_steps 0: the blocking sync)"""
    overlap_steps: int = 0
    throttle: float = 1.0
    """the last worker is made this many times slower (join --throttle): peers of different speeds"""
    adaptive_steps: bool = True
    """False: every worker takes every inner step of a phase (join --no-adaptive-steps), as the convergence
    experiment's simulation does"""
    cpu_per_peer: Optional[float] = None
    """each worker (with its p2pd) limited to this many CPUs by a cgroup quota (``cpu.CpuQuota``); None: the workers
    share the host's cores as the scheduler pleases"""
    apart: bool = False
    """the peers train apart: each worker in a run of its own, so it never syncs with another (its outer steps are
    solo steps); the baseline of 'samples/s vs solo' on the same hardware"""
    eval_batches: int = 2
    """held-out batches per eval (after every round): evals are wall time but not inner steps, so they lower the
    compute utilization; the worker's default of 8 would cost a 25M-model peer ~10% of a 1-minute phase here"""

    @property
    def name(self) -> str:
        rate = f"{self.rate_mbit:g}Mbit" if self.rate_mbit else "loopback"
        nat = f"-{self.behind_nat}nat" if self.behind_nat else ""
        grouping = "-defaults" if self.grouping == "defaults" else ""
        streaming = f"-F{self.fragments}tau{self.overlap_steps}" if self.fragments > 1 or self.overlap_steps else ""
        slow = f"-slow{self.throttle:g}x" if self.throttle != 1.0 else ""
        cpu = f"-cpu{self.cpu_per_peer:g}" if self.cpu_per_peer else ""
        apart = "-apart" if self.apart else ""
        return (f"{self.model}-{self.peers}peers{nat}-{rate}-H{self.local_steps}-{self.compression}{streaming}"
                f"{slow}{grouping}{cpu}{apart}")

    @property
    def nat_hosts(self) -> frozenset:
        """Topology host indices behind NAT (host 0 is the bootstrap peer, worker i is host i)."""
        return frozenset(range(self.peers + 1 - self.behind_nat, self.peers + 1))


class BenchFailed(RuntimeError):
    pass


def run_config(cfg: BenchConfig, out: Path, topology: Optional[Topology], progress=print,
               timeout_s: float = 3600.0) -> Dict:
    """Run one configuration to ``cfg.outer_steps`` rounds and return its figures (see ``summarize``)."""
    out.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    quotas: Dict[int, CpuQuota] = {}

    def prefix(i: int) -> List[str]:  # host i's share of the CPU or its core, and its namespace
        if cfg.cpu_per_peer and i > 0:
            # the cgroup is joined before entering the namespace, whose /sys has no cgroup mounts
            quotas[i] = CpuQuota(f"p2ptrain-bench-{os.getpid()}-w{i}", cfg.cpu_per_peer)
            return [*quotas[i].prefix(), *(topology.command(i) if topology else [])]
        return topology.command(i, *_pin(i, cores, cfg.peers)) if topology else _pin(i, cores, cfg.peers)

    address = (lambda i: topology.addresses[i]) if topology else (lambda i: "127.0.0.1")
    procs: List[subprocess.Popen] = []
    try:
        maddrs = out / "bootstrap.maddrs"
        maddrs.unlink(missing_ok=True)
        procs.append(spawn(["bootstrap", "--host-maddrs", f"/ip4/{address(0)}/tcp/0", "--maddrs-file", str(maddrs)],
                           out / "bootstrap.log", prefix(0)))
        try:
            initial_peer = wait_for_address(maddrs, procs[0])
        except DaemonError as e:
            raise BenchFailed(f"{e}; see {out / 'bootstrap.log'}") from None
        if topology:
            topology.start_counters()
            wait_for_counters(topology)
        for i in range(1, cfg.peers + 1):
            procs.append(spawn([
                "join", "--initial-peers", initial_peer,
                "--host-maddrs", f"/ip4/{address(i)}/tcp/0",
                # apart: a run of its own per worker, so nobody is there to sync with
                "--run-id", f"bench-{cfg.name}".replace(".", "_") + (f"-w{i}" if cfg.apart else ""),
                "--model", cfg.model, "--batch-size", str(cfg.batch_size), "--local-steps", str(cfg.local_steps),
                # the run's outer step to end at: every worker ends on the same one, also one that took the state
                # after a failed round (its syncs would count one fewer, and under "wait" it would wait for good)
                "--until-outer-step", str(cfg.outer_steps), "--compression", cfg.compression,
                "--fragments", str(cfg.fragments), "--overlap-steps", str(cfg.overlap_steps),
                "--throttle", str(cfg.throttle if i == cfg.peers else 1.0),
                *([] if cfg.adaptive_steps else ["--no-adaptive-steps"]),
                *_grouping_flags(cfg, i),
                "--averaging-timeout", "600", "--threads", "1", "--no-progress", "--log-interval", "30",
                "--eval-batches", str(cfg.eval_batches),
                "--report", str(out / f"w{i}.json"),
            ], out / f"w{i}.log", prefix(i)))
        started, last, first_done = time.monotonic(), -1, None
        stall = Stall([out / f"w{i}.log" for i in range(1, cfg.peers + 1)])
        while any(p.poll() is None for p in procs[1:]):
            if time.monotonic() - started > timeout_s:
                raise BenchFailed(f"{cfg.name} did not finish in {timeout_s:.0f}s")
            if first_done is None and any(p.poll() == 0 for p in procs[1:]):
                first_done = time.monotonic()
            # (apart, each worker runs at its own pace: a slower one ends later, it missed nothing)
            if first_done is not None and time.monotonic() - first_done > 120 and not cfg.apart:
                stuck = [i for i, p in enumerate(procs[1:], 1) if p.poll() is None]
                raise BenchFailed(f"worker(s) {stuck} still running 120s after another finished: they missed a round; "
                                  f"see {out}/w{stuck[0]}.log")
            failed = [i for i, p in enumerate(procs[1:], 1) if p.poll() not in (None, 0)]
            if failed:
                raise BenchFailed(f"worker {failed[0]} exited with {procs[failed[0]].returncode}; see "
                                  f"{out / f'w{failed[0]}.log'}")
            steps = min((_read(out / f"w{i}.json").get("outer_steps", 0) for i in range(1, cfg.peers + 1)))
            if steps != last:
                progress(f"  {cfg.name}: {steps}/{cfg.outer_steps} rounds, {time.monotonic() - started:.0f}s")
                last = steps
            given_up = stall.check(steps)  # rounds that stopped coming: one line, not a run until killed
            if given_up:
                raise BenchFailed(f"{cfg.name}: {given_up}")
            time.sleep(1.0)
        failed = [i for i, p in enumerate(procs[1:], 1) if p.returncode != 0]
        if failed:
            raise BenchFailed(f"worker {failed[0]} exited with {procs[failed[0]].returncode}; see "
                              f"{out / f'w{failed[0]}.log'}")
    finally:
        stop_daemons(procs[1:])
        stop_daemons(procs[:1])
        for quota in quotas.values():
            quota.close()
    reports = [_read(out / f"w{i}.json") for i in range(1, cfg.peers + 1)]
    samples = topology.counters() if topology else []
    (out / "counters.json").write_text(json.dumps(samples))
    return summarize(cfg, reports, samples)


def with_solo_baseline(result: Dict, apart: Dict) -> Dict:
    """``result``'s samples/s against the same peers' measured throughput when they trained apart (``apart``: the
    same configuration with ``apart=True``, run on the same hardware), peer by peer: worker i there is worker i
    here, with the same throttle and CPU share."""
    rates = [p["throughput"] for p in apart["peers"]]
    if len(rates) != len(result["peers"]) or not all(rates):
        return result
    result = dict(result, solo_from=f"measured apart ({apart['name']})",
                  throughput_vs_median_step=result["throughput_vs_solo"],
                  peers=[dict(p, solo_throughput=rate) for p, rate in zip(result["peers"], rates)])
    swarm = [p["throughput"] for p in result["peers"]]
    result["throughput_vs_solo"] = sum(swarm) / sum(rates) if all(swarm) else None
    return result


def _grouping_flags(cfg: BenchConfig, i: int) -> List[str]:
    if cfg.grouping == "defaults" or cfg.apart:
        return []  # the workers find their groups from the live peers' progress records, as a user's do
    # every round of the benchmark is a round of all its peers, pinned by flags (the setup before the defaults
    # waited for the live peers): with fewer allowed, a peer a few seconds late would be left out of a round
    # (sparse runs the whole swarm as one group: --min-group-size alone holds it together)
    target = [] if cfg.compression == "sparse" else ["--target-group-size", str(cfg.peers)]
    return ["--num-shards", str(cfg.peers), "--shard-index", str(i - 1), *target,
            "--min-group-size", str(cfg.peers), "--no-group-policy", "wait",
            "--matchmaking-time", str(cfg.matchmaking_time_s)]


def _pin(i: int, cores: int, peers: int) -> List[str]:
    """One core per worker while there are enough (the bootstrap peer shares core 0); with more workers than cores,
    none: pinning 3 workers to 2 cores would give one a core of its own and make the other two wait for it."""
    return ["taskset", "-c", str(i % cores)] if peers <= cores else []


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def sparse_message_bytes(model: str) -> int:
    """The most one peer's sparse message for a built-in model may take at the default k (``sparse.Layout``: its
    places' code makes it shorter; the rounds' own byte counts say by how much)."""
    import torch

    from p2ptrain.averaging.sparse import Layout
    from p2ptrain.model import GPT

    with torch.device("meta"):
        shapes = tuple(tuple(p.shape) for p in GPT(model_config(model)).parameters())
    return Layout(shapes).max_message_bytes


def relayed_share(rounds: List[dict], peers: int) -> Optional[float]:
    """The bootstrap's bytes in a sync over all ``peers`` workers' (wire counters only; None without them): 1.0 when
    every byte between the workers was relayed. ``rounds``: each peer's rounds, with the bootstrap's bytes over the
    same window."""
    pairs = [(r["bootstrap_wire"], r["wire_sent"] + r["wire_received"]) for r in rounds if "bootstrap_wire" in r]
    workers = sum(w for _, w in pairs) * peers
    return sum(b for b, _ in pairs) / workers if workers else None


def summarize(cfg: BenchConfig, reports: List[dict], samples: List[dict]) -> Dict:
    """Every figure of one configuration, per peer and overall. Steady state: the window from the end of the first
    round (which also waits for the slowest peer's start-up) to the end of the last."""
    n = cfg.peers
    params = count_parameters(model_config(cfg.model))
    if cfg.compression == "sparse":  # each peer's message to each other member (averaging/sparse_round.py)
        payload = sparse_message_bytes(cfg.model)
        butterfly = (n - 1) * payload
    else:
        payload = params * BYTES_PER_VALUE[cfg.compression]
        butterfly = 2 * (n - 1) / n * payload
    rate_bps = cfg.rate_mbit * 1e6 / 8 if cfg.rate_mbit else None
    # when each round's last member arrived: the time a peer spent before that is waiting for a slower peer, not
    # the cost of matchmaking or of the network
    arrivals: Dict[int, float] = {}
    launches: Dict[tuple, float] = {}  # streaming: when each fragment round's last member launched it
    for report in reports:
        for r in report["rounds"]:
            arrivals[r["outer_step"]] = max(arrivals.get(r["outer_step"], 0.0), r["finished_at"] - r["seconds"])
            for f in r.get("fragments", []):
                key = (r["outer_step"], f["fragment"])
                launches[key] = max(launches.get(key, 0.0), f.get("launched_at", 0.0))
    peers = []
    for host, report in enumerate(reports, 1):
        # the rounds it trained through and averaged (apart: its solo steps, there is nobody to average with)
        rounds = [r for r in report["rounds"] if (r["averaged"] or cfg.apart) and not r["caught_up"]]
        steady = rounds[1:]
        window = rounds[-1]["finished_at"] - rounds[0]["finished_at"] if steady else 0.0
        compute = rounds[-1]["compute_s"] - rounds[0]["compute_s"] if steady else 0.0
        per_round = []
        for i, r in enumerate(rounds):
            started = r["finished_at"] - r["seconds"]
            fragments = r.get("fragments") or []  # a streaming phase's rounds; none for the blocking sync
            if fragments:
                # a streaming phase's seconds are the ones its fragment rounds held training up, spread over the
                # phase: of a fragment's wait at its apply step, the part before its last member launched the
                # round is waiting for a slower peer. Its bytes flow all through the phase
                waiting = sum(min(f["waited_s"], max(launches[(r["outer_step"], f["fragment"])]
                                                     - f.get("launched_at", 0.0), 0.0)) for f in fragments)
                traffic_from = rounds[i - 1]["finished_at"] if i else started
            else:
                waiting = min(max(arrivals[r["outer_step"]] - started, 0.0), r["seconds"] - r["allreduce_s"])
                traffic_from = started + waiting
            entry = {"outer_step": r["outer_step"], "seconds": r["seconds"], "allreduce_s": r["allreduce_s"],
                     "waiting_s": waiting, "sync_s": r["seconds"] - waiting,
                     # streaming: the fragment rounds' time before their all-reduce, in the background
                     "matchmaking_s": sum(max(f["round_s"] - f["allreduce_s"], 0.0) for f in fragments)
                     if fragments else max(r["seconds"] - waiting - r["allreduce_s"], 0.0),
                     "group_size": r["group_size"], "payload_sent": r["bytes_sent"],
                     "payload_received": r["bytes_received"], "eval_loss": r["eval_loss"],
                     "eval_s": r.get("eval_s", 0.0),
                     "finished_at": r["finished_at"]}
            if samples:
                # the sync proper, from the last member's arrival; the chatter while waiting is counted apart
                sent, received = bytes_between(samples, host, traffic_from, r["finished_at"])
                # host 0 carries no training of its own: what crossed its port then was relayed (in and out)
                entry.update(wire_sent=sent, wire_received=received,
                             bootstrap_wire=sum(bytes_between(samples, 0, traffic_from, r["finished_at"])))
                if waiting > 1.0 and not fragments:
                    idle_sent, idle_received = bytes_between(samples, host, started, started + waiting)
                    entry["waiting_bytes_per_s"] = (idle_sent + idle_received) / waiting
            per_round.append(entry)
        waited = sum(r["waiting_s"] for r in per_round[1:])
        evaluated = sum(r["eval_s"] for r in per_round[1:])
        # samples per second into this peer's model, against what it would do alone at the step time it measured
        # here (the median of its inner steps' seconds, on this host's share of the CPU, the throttle included)
        trained = sum(r["samples"] for r in steady)
        step_times = [r["step_s"] for r in steady if r.get("step_s")]
        solo = cfg.batch_size / statistics.median(step_times) if step_times else None
        peers.append({
            "peer_id": report["peer_id"], "compute_utilization": compute / window if window else None,
            # without the time it waited for slower peers: what communication itself costs this peer
            "utilization_without_waiting": compute / (window - waited) if window > waited else None,
            # ... and without the held-out eval after each round (monitoring, not training; 1 s on a CPU here)
            "utilization_without_waiting_or_eval": compute / (window - waited - evaluated)
            if window > waited + evaluated else None,
            "throughput": trained / window if window else None, "solo_throughput": solo,
            "window_s": window, "compute_s": compute, "startup_s": report["startup_s"], "rounds": per_round,
            "initial_eval_loss": report["initial_eval_loss"], "final_eval_loss": report["final_eval_loss"],
            "train_started_at": report["train_started_at"], "reachability": report.get("reachability", ""),
            "relayed_connections": max((r.get("connections", {}).get("relayed", 0) for r in report["rounds"]),
                                       default=0),
        })
    steady_rounds = [r for p in peers for r in p["rounds"][1:]]
    wire_key = "wire_sent" if samples else "payload_sent"
    mean = (lambda xs: sum(xs) / len(xs) if xs else None)

    def sync_bytes(r: dict) -> int:  # a peer's bytes in one sync: the larger of the two directions
        return max(r[wire_key], r.get("wire_received", r["payload_received"]))

    if cfg.compression == "sparse":  # the messages as long as their places' code made them: what the peers sent
        sent = [r["payload_sent"] / (r["group_size"] - 1) for r in steady_rounds if r["group_size"] > 1]
        payload = mean(sent) or payload
        butterfly = (n - 1) * payload
    bytes_per_sync = mean([sync_bytes(r) for r in steady_rounds])
    sync_s = mean([r["sync_s"] for r in steady_rounds])
    bound_s = butterfly / rate_bps if rate_bps else None
    inner_steps = cfg.local_steps * cfg.outer_steps
    data_parallel_bytes = inner_steps * 2 * (n - 1) / n * 4 * params  # one fp32 all-reduce of the gradients a step
    diloco_bytes = bytes_per_sync * cfg.outer_steps if bytes_per_sync else None
    step_s = mean([p["compute_s"] / (cfg.local_steps * (len(p["rounds"]) - 1)) for p in peers if p["compute_s"]])
    # every round every peer committed (a solo step counts as a group of 1), and those in which it threw its inner
    # steps away to take the swarm's state: what "every round has every peer" looks like, or does not
    committed = [r for report in reports for r in report["rounds"] if not r["abandoned"]]
    group_sizes = {str(size): sum(1 for r in committed if r["group_size"] == size)
                   for size in sorted({r["group_size"] for r in committed})}
    return {
        "group_sizes": group_sizes, "caught_up_rounds": sum(1 for r in committed if r["caught_up"]),
        "config": asdict(cfg), "name": cfg.name, "parameters": params, "payload_bytes": payload,
        "butterfly_bound_bytes": butterfly, "bytes_measured_on": "wire (switch port counters)" if samples else
        "payload (no namespaces: loopback, the peers' own counts)",
        "bytes_per_peer_per_sync": bytes_per_sync,
        "bytes_vs_butterfly": bytes_per_sync / butterfly if bytes_per_sync else None,
        "sync_s": sync_s, "bandwidth_bound_s": bound_s,
        "sync_vs_bound": sync_s / bound_s if sync_s and bound_s else None,
        "matchmaking_s": mean([r["matchmaking_s"] for r in steady_rounds]),
        "waiting_s": mean([r["waiting_s"] for r in steady_rounds]),
        "waiting_chatter_bytes_per_s": mean([r["waiting_bytes_per_s"] for p in peers for r in p["rounds"]
                                             if "waiting_bytes_per_s" in r]),
        "allreduce_s": mean([r["allreduce_s"] for r in steady_rounds]),
        "eval_s": mean([r["eval_s"] for r in steady_rounds]),
        "compute_utilization": mean([p["compute_utilization"] for p in peers if p["compute_utilization"]]),
        "utilization_without_waiting": mean([p["utilization_without_waiting"] for p in peers
                                             if p["utilization_without_waiting"]]),
        "utilization_without_waiting_or_eval": mean([p["utilization_without_waiting_or_eval"] for p in peers
                                                     if p["utilization_without_waiting_or_eval"]]),
        # the figure for peers of different speeds: all samples entering the models, over the sum of the
        # peers' own speeds (a slow peer that holds the others up, or whose work is thrown away, lowers it). Here
        # each peer's own speed is its median inner step in this run; ``with_solo_baseline`` puts a measured one
        "throughput_vs_solo": sum(p["throughput"] for p in peers) / sum(p["solo_throughput"] for p in peers)
        if peers and all(p["throughput"] and p["solo_throughput"] for p in peers) else None,
        "solo_from": "median inner step",
        "utilization_bound": (cfg.local_steps * step_s / (cfg.local_steps * step_s + bound_s))
        if step_s and bound_s else None,
        "inner_phase_s": cfg.local_steps * step_s if step_s else None,
        "data_parallel_bytes_per_peer": data_parallel_bytes,
        "data_parallel_comm_s_at_link_rate": data_parallel_bytes / rate_bps if rate_bps else None,
        "communication_reduction": data_parallel_bytes / diloco_bytes if diloco_bytes else None,
        "final_eval_loss": mean([p["final_eval_loss"] for p in peers]),
        # behind NAT: client-mode peers reduce nothing, so the public ones carry every part
        "bytes_per_sync_by_mode": {
            mode: mean([sync_bytes(r) for p in peers if p["reachability"].startswith(mode) for r in p["rounds"][1:]])
            for mode in ("public", "relayed", "client")},
        "client_mode_peers": sum(p["reachability"].startswith("client") for p in peers),
        "relayed_peers": sum(p["reachability"].startswith("relayed") for p in peers),
        # of the bytes the workers' ports carried in a sync, the share that crossed the bootstrap's port: a relayed
        # byte crosses it in and out, and two workers' ports once each
        "relayed_share": relayed_share(steady_rounds, n),
        "relayed_connections": max((p["relayed_connections"] for p in peers), default=0),
        "peers": peers,
    }
