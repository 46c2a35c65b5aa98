"""Workers behind real NAT routers train with the swarm as full members (issue 8).

Network namespaces make the hosts (p2ptrain/bench/netns.py), on one switch that lives in a namespace of its own:

    host 0  public   the bootstrap peer and worker A (the operator's box)
    host 1  public   worker B
    host 2  NAT      worker C, behind router r2 (iptables MASQUERADE, nothing inbound but replies)
    host 3  NAT      worker D, behind router r3
    host 4  NAT      worker E, behind router r4: the newcomer, started mid-run

Every worker starts with nothing but --initial-peers (and --reachability auto, the default): it asks the bootstrap
peer to dial it back and picks its mode. The test asserts that the NAT is real (an inbound connection to a NATed
worker fails), that C and D chose relayed (the bootstrap offers relays) and A and B public, that C and D act as
clients while A and B are live (no relayed connection), that all four commit rounds with group size 4,
that E joins mid-run, takes the state and averages with them, and that killing C, D and E leaves A and B averaging
on, bit-identical, without a failed round. It prints the time and bytes per round, and the relayed connections.

Needs root (namespaces, iptables): `make test-netns`, which `.ci/run` runs. Without root it skips and says why,
unless P2PTRAIN_REQUIRE_NETNS=1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hivemind.utils.multiaddr import Multiaddr

from p2ptrain.bench.netns import Topology, nat_problem
from p2ptrain.daemons import spawn, stop_daemons, wait_for_address
from tests.helpers import wait_until

pytestmark = [pytest.mark.netns, pytest.mark.timeout(600)]

PUBLIC, NATED = (0, 1), (2, 3, 4)
WORKER_HOSTS = {"A": 0, "B": 1, "C": 2, "D": 3, "E": 4}


def make_topology(hosts: int, nat: frozenset) -> Topology:
    problem = nat_problem()
    if problem:
        if os.environ.get("P2PTRAIN_REQUIRE_NETNS") == "1":
            pytest.fail(f"cannot make NAT routers ({problem}), but P2PTRAIN_REQUIRE_NETNS=1")
        pytest.skip(f"the NAT test {problem}; run it as root (make test-netns)")
    return Topology(hosts=hosts, rate_mbit=None, nat=nat)


@pytest.fixture
def topology():
    topo = make_topology(5, frozenset(NATED))
    yield topo
    topo.close()


def report(tmp_path: Path, name: str) -> dict:
    try:
        return json.loads((tmp_path / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {}


def rounds(tmp_path: Path, name: str) -> list:
    return report(tmp_path, name).get("rounds", [])


def survivors_average_on(tmp_path: Path, survivors: str, killed_at: float, alive, timeout_s: float) -> None:
    """After the others were killed at ``killed_at``: each survivor averages 3 rounds begun since, all in groups of
    every survivor with no failed range, and their digests agree."""
    def after_kill(name):
        return [r for r in rounds(tmp_path, name) if r["finished_at"] - r["seconds"] > killed_at]
    wait_until(lambda: all(len(after_kill(n)) >= 3 for n in survivors), f"3 rounds of {survivors} after the kill",
               timeout_s, alive)
    for name in survivors:
        later = after_kill(name)
        assert all(r["averaged"] and r["group_size"] == len(survivors) and r["failed_fraction"] == 0
                   for r in later), later
    digests = [{r["outer_step"]: r["digest"] for r in rounds(tmp_path, n)} for n in survivors]
    common = set.intersection(*map(set, digests))
    assert common and all(len({d[s] for d in digests}) == 1 for s in common), digests


def round_figures(tmp_path: Path, names: str) -> dict:
    """For the record, printed: each worker's mode, rounds averaged, mean time and bytes per round, relayed peers."""
    figures = {}
    for name in names:
        rs = [r for r in rounds(tmp_path, name) if r["averaged"] and not r["caught_up"]]
        figures[name] = dict(
            mode=report(tmp_path, name)["reachability"].split(":")[0], rounds=len(rs),
            seconds=round(sum(r["seconds"] for r in rs) / max(len(rs), 1), 2),
            allreduce_s=round(sum(r["allreduce_s"] for r in rs) / max(len(rs), 1), 2),
            sent_kb=round(sum(r["bytes_sent"] for r in rs) / max(len(rs), 1) / 1e3, 1),
            received_kb=round(sum(r["bytes_received"] for r in rs) / max(len(rs), 1) / 1e3, 1),
            relayed=max((r.get("connections", {}).get("relayed", 0) for r in rs), default=0))
    print(json.dumps(figures, indent=1))
    return figures


def dial(topology: Topology, from_host: int, ip: str, port: int) -> str:
    """Try a TCP connection from inside a host's namespace: 'connected', or the error."""
    code = (f"import socket\ntry:\n    socket.create_connection(({ip!r}, {port}), timeout=3)\n    print('connected')\n"
            "except OSError as e:\n    print(type(e).__name__, e)\n")
    done = subprocess.run(topology.command(from_host, sys.executable, "-c", code), capture_output=True, text=True,
                          timeout=30)
    return done.stdout.strip() or done.stderr.strip()


def test_workers_behind_nat_train_as_full_members(topology, tmp_path):
    procs: dict = {}
    started = {}

    def worker(name: str) -> None:
        host = WORKER_HOSTS[name]
        procs[name] = spawn([
            "join", "--initial-peers", bootstrap_maddr, "--host-maddrs", f"/ip4/{topology.addresses[host]}/tcp/0",
            "--run-id", "nat", "--model", "tiny", "--local-steps", "10", "--batch-size", "8", "--threads", "1",
            "--target-group-size", "5", "--matchmaking-time", "4", "--averaging-timeout", "30",
            "--no-group-policy", "wait", "--log-interval", "5", "--eval-batches", "1", "--no-progress",
            "--report", str(tmp_path / f"{name}.json"),
        ], tmp_path / f"{name}.log", topology.command(host))
        started[name] = time.time()

    def alive():
        return [(name, proc) for name, proc in procs.items() if name != "boot"]

    try:
        procs["boot"] = spawn(["bootstrap", "--host-maddrs", f"/ip4/{topology.addresses[0]}/tcp/0",
                               "--maddrs-file", str(tmp_path / "maddrs")], tmp_path / "boot.log",
                              topology.command(0))
        bootstrap_maddr = wait_for_address(tmp_path / "maddrs", procs["boot"])
        for name in "ABCD":
            worker(name)

        # the NAT is real: C listens on its LAN address, and no public host can open a connection to it
        wait_until(lambda: report(tmp_path, "C").get("maddrs"), "worker C to start listening", 120, alive())
        lan = Multiaddr(next(m for m in report(tmp_path, "C")["maddrs"] if topology.addresses[2] in m))
        port = int(lan["tcp"])
        assert "unreachable" in dial(topology, 1, topology.addresses[2], port)  # no route to a LAN
        assert "Refused" in dial(topology, 1, topology.public_addresses[2], port)  # its router forwards nothing in

        # each worker chose its mode from the bootstrap peer's probe
        wait_until(lambda: all(report(tmp_path, n).get("reachability") for n in "ABCD"), "every worker's mode",
                   120, alive())
        for name in "AB":
            assert report(tmp_path, name)["reachability"].startswith("public: "), report(tmp_path, name)
        for name in "CD":  # relayed: dialled through the bootstrap's relays only while no public worker is live
            reach, router = report(tmp_path, name)["reachability"], topology.public_addresses[WORKER_HOSTS[name]]
            assert reach.startswith("relayed: ") and f"could not connect back to {router} " in reach, reach

        # all four average together
        def rounds_of_four():
            return min(sum(r["averaged"] and r["group_size"] == 4 for r in rounds(tmp_path, n)) for n in "ABCD")
        wait_until(lambda: rounds_of_four() >= 2, "2 rounds with group size 4", 240, alive())

        # status, run from a public host, shows each peer's mode and why
        done = subprocess.run(topology.command(1, sys.executable, "-m", "p2ptrain", "status", "--initial-peers",
                                               bootstrap_maddr, "--run-id", "nat", "--json"),
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        listing = json.loads(done.stdout)
        modes = {p["peer_id"]: (p["mode"], p["reachability"]) for p in listing["peers"]}
        for name in "ABCD":
            mode, reason = modes[report(tmp_path, name)["peer_id"]]
            assert mode == ("public" if name in "AB" else "relayed") and reason == report(tmp_path, name)[
                "reachability"], (name, mode, reason)
        assert listing["public_peers"] == 2

        # a NATed newcomer joins mid-run, takes the state from the public peers and averages with the swarm
        worker("E")
        wait_until(lambda: any(r["averaged"] and not r["caught_up"] and r["group_size"] >= 2
                               for r in rounds(tmp_path, "E")), "the newcomer E to average a round", 240, alive())
        newcomer = report(tmp_path, "E")
        assert newcomer["reachability"].startswith("relayed: "), newcomer["reachability"]
        assert newcomer["state_download"] and newcomer["state_download"]["bytes"] > 0, newcomer
        assert newcomer["start_outer_step"] >= 2, newcomer

        # kill every NATed worker (a crash: SIGKILL to its process group); A and B go on undisturbed
        for name in "CDE":
            os.killpg(procs[name].pid, signal.SIGKILL)
            procs.pop(name).wait()
        survivors_average_on(tmp_path, "AB", time.time(), alive(), 240)

        # the figures for the record: time and bytes per round, relayed connections
        figures = round_figures(tmp_path, "ABCDE")
        # with public workers live, the relayed ones act as clients (they dial out): no byte goes through a relay
        assert all(f["relayed"] == 0 for f in figures.values()), figures
    finally:
        stop_daemons([proc for name, proc in procs.items() if name != "boot"], timeout_s=30)
        stop_daemons([procs["boot"]] if "boot" in procs else [], timeout_s=30)


def start_dht_in(topology: Topology, host: int, *args: str) -> str:
    """Run start_dht in a host's namespace with these SwarmConfig keyword arguments; returns its reachability."""
    code = ("import sys\nfrom p2ptrain.swarm.dht import SwarmConfig, start_dht, stop_dht\n"
            f"dht = start_dht(SwarmConfig({', '.join(args)}))\nprint(dht.reachability, flush=True)\nstop_dht(dht)\n")
    done = subprocess.run(topology.command(host, sys.executable, "-c", code), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def test_a_forwarded_port_makes_a_worker_behind_nat_public(tmp_path):
    """What the README tells a user behind NAT who wants to be a full member: forward a port, announce it."""
    topology = make_topology(2, frozenset({1}))
    boot = None
    try:
        # --relays 0: no relays for a worker behind NAT to fall back on, so it runs in client mode
        boot = spawn(["bootstrap", "--host-maddrs", f"/ip4/{topology.addresses[0]}/tcp/0", "--maddrs-file",
                      str(tmp_path / "maddrs"), "--relays", "0"], tmp_path / "boot.log", topology.command(0))
        maddr = wait_for_address(tmp_path / "maddrs", boot)
        port, lan, public = 31337, topology.addresses[1], topology.public_addresses[1]
        peer = f"initial_peers=[{maddr!r}], host_maddrs=['/ip4/{lan}/tcp/{port}']"
        announce = f"announce_maddrs=['/ip4/{public}/tcp/{port}']"
        assert start_dht_in(topology, 1, peer, announce).startswith("client: ")  # not forwarded yet
        topology.forward_port(1, port)
        reach = start_dht_in(topology, 1, peer, announce)
        assert reach.startswith("public: ") and f"connected back to {public} port(s) {port}" in reach, reach
    finally:
        if boot is not None:
            stop_daemons([boot], timeout_s=30)
        topology.close()
