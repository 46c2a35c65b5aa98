"""Hosts for the swarm benchmark: one Linux network namespace per peer, joined by a switch, links rate-limited.

    switch namespace  p2pb-<tag>-sw:  bridge br0, ports s0 .. s<n-1>  (tbf on each port: the host's download)
    host namespace    p2pb-<tag>-h<i>: eth0 = 10.<a>.<b>.<i+1>/24      (tbf on eth0: the host's upload)

A host behind NAT (``nat``) sits behind a router namespace of its own, which takes its place on the switch:

    router namespace  p2pb-<tag>-r<i>: eth0 = 10.<a>.<b>.<i+1>/24 (public), eth1 = 172.16.<i>.1/24 (the host's LAN)
    host namespace    p2pb-<tag>-h<i>: eth0 = 172.16.<i>.2/24, default route via 172.16.<i>.1

The router masquerades the LAN's traffic (``iptables -t nat ... MASQUERADE``) and, like a home router, forwards
nothing inbound that is not part of a connection the LAN opened. Public hosts have no route to any LAN, so the
host can dial out and cannot be dialled: a real NAT, not a flag.

The bridge lives in a namespace of its own, never in the root one: a running dockerd sets the root namespace's
iptables FORWARD policy to DROP, which silently drops bridged traffic there. Byte counters are the switch ports'
(``/sys/class/net/s<i>/statistics``), read by one sampler process inside the switch namespace, so reading them costs
the hosts nothing. Everything is removed by :meth:`Topology.close` (deleting a namespace deletes its veth ends),
which the benchmark calls on every exit path, Ctrl-C included.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Dict, FrozenSet, List, Optional

PREFIX = "p2pb"


class NetnsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2/tc)."""


def netns_problem() -> str:
    """Why rate-limited namespaces cannot be made on this host, or ''."""
    if os.geteuid() != 0:
        return "needs root to make network namespaces"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs iproute2 ({', '.join(missing)} not found)"
    return ""


def nat_problem() -> str:
    """Why NAT routers cannot be made on this host, or ''."""
    return netns_problem() or ("" if shutil.which("iptables") else "needs iptables for the NAT routers")


def _sh(*args: str) -> None:
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode:
        raise NetnsUnavailable(f"{' '.join(args)}: {done.stderr.strip() or done.returncode}")


def _tbf(namespace: str, device: str, rate_mbit: float) -> None:
    # burst: at least one MTU and ~1 ms of traffic at the rate; latency bounds the queue (deep enough for TCP to fill
    # the link without tail drops that would make the figures a function of the queue instead of the rate)
    burst_bytes = max(1600, int(rate_mbit * 1e6 / 8 / 1000))
    _sh("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf", "rate",
        f"{rate_mbit}mbit", "burst", str(burst_bytes), "latency", "100ms")


@dataclass
class Topology:
    """``hosts`` namespaces on one switch, each link limited to ``rate_mbit`` in both directions (None: no limit);
    the hosts in ``nat`` behind a NAT router each."""

    hosts: int
    rate_mbit: Optional[float]
    nat: FrozenSet[int] = frozenset()
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    namespaces: List[str] = field(default_factory=list)
    addresses: List[str] = field(default_factory=list)
    """each host's own address (a LAN address behind NAT): where its daemon listens"""
    public_addresses: List[str] = field(default_factory=list)
    """each host's address on the switch: its own, or its router's"""
    routers: Dict[int, str] = field(default_factory=dict)
    switch: str = ""
    _sampler: Optional[subprocess.Popen] = None
    _samples: List[dict] = field(default_factory=list)
    _reader: Optional[threading.Thread] = None

    def __post_init__(self) -> None:
        problem = nat_problem() if self.nat else netns_problem()
        if problem:
            raise NetnsUnavailable(problem)
        subnet = (10, 200 + int(self.tag[:2], 16) % 50, int(self.tag[2:4], 16))
        self.switch = f"{PREFIX}-{self.tag}-sw"
        try:
            _sh("ip", "netns", "add", self.switch)
            _sh("ip", "-n", self.switch, "link", "set", "lo", "up")
            _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i in range(self.hosts):
                ns, address = f"{PREFIX}-{self.tag}-h{i}", "{}.{}.{}.{}".format(*subnet, i + 1)
                _sh("ip", "netns", "add", ns)
                self.namespaces.append(ns)
                self.public_addresses.append(address)
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                on_switch = ns
                if i in self.nat:
                    on_switch = self.routers[i] = f"{PREFIX}-{self.tag}-r{i}"
                    _sh("ip", "netns", "add", on_switch)
                    address = self._nat_router(i, on_switch, ns)
                self.addresses.append(address)
                _sh("ip", "link", "add", f"{PREFIX}{self.tag}e{i}", "netns", on_switch, "type", "veth", "peer",
                    "name", f"{PREFIX}{self.tag}s{i}", "netns", self.switch)
                _sh("ip", "-n", on_switch, "link", "set", f"{PREFIX}{self.tag}e{i}", "name", "eth0")
                _sh("ip", "-n", self.switch, "link", "set", f"{PREFIX}{self.tag}s{i}", "name", f"s{i}")
                _sh("ip", "-n", on_switch, "addr", "add", f"{self.public_addresses[i]}/24", "dev", "eth0")
                _sh("ip", "-n", on_switch, "link", "set", "eth0", "up")
                _sh("ip", "-n", self.switch, "link", "set", f"s{i}", "master", "br0")
                _sh("ip", "-n", self.switch, "link", "set", f"s{i}", "up")
                if self.rate_mbit:
                    _tbf(ns, "eth0", self.rate_mbit)  # upload (behind NAT: the host's link to its router)
                    _tbf(self.switch, f"s{i}", self.rate_mbit)  # download
        except BaseException:
            self.close()
            raise

    def _nat_router(self, i: int, router: str, host: str) -> str:
        """Put host ``i`` on a LAN of its own behind ``router``, which masquerades it; returns its LAN address."""
        lan = f"172.16.{i}"
        _sh("ip", "-n", router, "link", "set", "lo", "up")
        _sh("ip", "link", "add", f"{PREFIX}{self.tag}l{i}", "netns", router, "type", "veth", "peer", "name",
            f"{PREFIX}{self.tag}h{i}", "netns", host)
        _sh("ip", "-n", router, "link", "set", f"{PREFIX}{self.tag}l{i}", "name", "eth1")
        _sh("ip", "-n", host, "link", "set", f"{PREFIX}{self.tag}h{i}", "name", "eth0")
        _sh("ip", "-n", router, "addr", "add", f"{lan}.1/24", "dev", "eth1")
        _sh("ip", "-n", host, "addr", "add", f"{lan}.2/24", "dev", "eth0")
        _sh("ip", "-n", router, "link", "set", "eth1", "up")
        _sh("ip", "-n", host, "link", "set", "eth0", "up")
        _sh("ip", "-n", host, "route", "add", "default", "via", f"{lan}.1")
        nft = ["ip", "netns", "exec", router]
        _sh(*nft, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
        _sh(*nft, "iptables", "-t", "nat", "-A", "POSTROUTING", "-s", f"{lan}.0/24", "-o", "eth0", "-j",
            "MASQUERADE")
        # a home router's firewall: from the outside, only replies to connections the LAN opened get in
        _sh(*nft, "iptables", "-A", "FORWARD", "-i", "eth0", "-o", "eth1", "-m", "conntrack", "--ctstate",
            "ESTABLISHED,RELATED", "-j", "ACCEPT")
        _sh(*nft, "iptables", "-A", "FORWARD", "-i", "eth0", "-o", "eth1", "-j", "DROP")
        return f"{lan}.2"

    def forward_port(self, host: int, port: int) -> None:
        """Forward TCP ``port`` of host ``host``'s router to the host (what a user does on a home router)."""
        router, lan = ["ip", "netns", "exec", self.routers[host]], self.addresses[host]
        _sh(*router, "iptables", "-t", "nat", "-A", "PREROUTING", "-i", "eth0", "-p", "tcp", "--dport", str(port),
            "-j", "DNAT", "--to-destination", f"{lan}:{port}")
        _sh(*router, "iptables", "-I", "FORWARD", "1", "-i", "eth0", "-o", "eth1", "-p", "tcp", "-d", lan,
            "--dport", str(port), "-j", "ACCEPT")

    def command(self, host: int, *args: str) -> List[str]:
        """``args`` run inside host ``host``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[host], *args]

    # ------------------------------------------------------------------------------------------------ counters

    def start_counters(self, interval_s: float = 0.1) -> None:
        """Sample every host's bytes sent and received (its switch port's counters) every ``interval_s``."""
        script = (
            "import json, sys, time\n"
            f"ports = {list(range(self.hosts))}\n"
            "def read(port, name):\n"
            "    with open(f'/sys/class/net/s{port}/statistics/{name}') as f:\n"
            "        return int(f.read())\n"
            "while True:\n"
            # the port's rx is what the host sent, its tx what the host received
            "    row = {'t': time.time(), 'sent': [read(p, 'rx_bytes') for p in ports],\n"
            "           'received': [read(p, 'tx_bytes') for p in ports]}\n"
            "    print(json.dumps(row), flush=True)\n"
            f"    time.sleep({interval_s})\n"
        )
        self._sampler = subprocess.Popen(["ip", "netns", "exec", self.switch, sys.executable, "-c", script],
                                         stdout=subprocess.PIPE, text=True)

        def collect() -> None:
            for line in self._sampler.stdout:
                self._samples.append(json.loads(line))

        self._reader = threading.Thread(target=collect, daemon=True)
        self._reader.start()

    def counters(self) -> List[Dict]:
        """The samples so far: dicts with ``t`` (time.time()), ``sent`` and ``received`` (bytes per host)."""
        return list(self._samples)

    # ---------------------------------------------------------------------------------------------- teardown

    def close(self) -> None:
        """Remove every namespace this topology made (their veth ends go with them). Safe to call twice."""
        if self._sampler is not None and self._sampler.poll() is None:
            self._sampler.kill()
            self._sampler.wait()
        for ns in [*self.namespaces, *self.routers.values(), self.switch]:
            if ns:
                subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()
        self.routers.clear()
        self.switch = ""


def leftover_namespaces() -> List[str]:
    """Namespaces a killed benchmark left behind (``p2ptrain bench --clean`` removes them)."""
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [line.split()[0] for line in done.stdout.splitlines() if line.startswith(PREFIX + "-")]


def bytes_between(samples: List[Dict], host: int, start: float, end: float, drain_s: float = 0.1) -> tuple:
    """(sent, received) bytes of ``host`` between two wall-clock times, from the counter samples around them."""
    # widen the window to the samples just outside it: this counts all of the sync's traffic, plus a few sampling
    # intervals of the background chatter (DHT heartbeats, a few KB). The end also waits ``drain_s`` for the bytes
    # a peer had handed to its socket before its round ended but the rate-limited link had not carried yet (seen:
    # 90 KB of a reducer's last averages still queued when a sample came 1 ms after the round's end)
    first = max((s for s in samples if s["t"] <= start), key=lambda s: s["t"], default=samples[0])
    last = min((s for s in samples if s["t"] >= end + drain_s), key=lambda s: s["t"], default=samples[-1])
    return last["sent"][host] - first["sent"][host], last["received"][host] - first["received"][host]


def wait_for_counters(topology: Topology, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not topology.counters():
        if time.monotonic() > deadline:
            raise NetnsUnavailable("the byte-counter sampler in the switch namespace did not start")
        time.sleep(0.05)
