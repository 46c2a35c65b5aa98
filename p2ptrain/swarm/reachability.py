"""Is this host reachable from the swarm? A probe through an initial peer decides between public and client mode.

A peer behind NAT (a home router, a cloud box without a public IP) can dial out but cannot be dialled. In hivemind
such a peer must run in *client mode*: it stores and reads DHT records through others, joins groups that others
lead, sends its whole pseudo-gradient to reducers and takes the average back, and downloads state from donors,
all over connections it opens itself. A public peer is a full member: it also serves DHT requests, leads groups,
reduces a share of every round and serves state. A NATed peer started as a full member would be put in other
peers' routing tables and given a share to reduce, and every one of those calls would time out.

So ``--reachability auto`` (the default of ``join``) asks before it starts the DHT:

1. start a throw-away p2pd listening where the DHT will (``--host-maddrs``), connected to the initial peers;
2. ask up to ``MAX_ASKED`` of them, on the stream protocol ``PROBE_PROTOCOL``, to open a plain TCP connection back
   to the address our connection came from (the NAT's public address, if there is one), on each of our ports;
3. any port that connects: public. An answer with none: client mode (behind NAT or a firewall).
4. no answer at all (the initial peers do not serve the probe: a plain ``hivemind-dht`` bootstrap, or an older
   p2ptrain): the addresses decide (``_unprobed``). Public when no NAT can sit between this host and the initial
   peer: they are on this host (loopback), or on a network of one of this host's interfaces, or this host listens
   on a public IP of its own. Else client mode, which works either way. Client mode for every peer of a run whose
   bootstrap cannot probe would leave nobody to lead a group: two workers on one host never averaged (issue 34).

TCP connections, not libp2p dials: the server's p2pd already holds our outbound connection and would reuse it,
which says nothing about inbound reachability. The server dials only the address the request came from, at most
``MAX_PORTS`` ports, so the probe cannot be used to make a peer connect to a third host.

Every full-mode p2ptrain peer serves the probe (``serve_probes``, run in its DHT process), the bootstrap peer too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import ipaddress
import logging
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Awaitable, Callable, List, Optional, Sequence, TypeVar

import psutil
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2ptrain.hivemind_compat import p2ps_made, remove_unstarted_p2p_files
from p2ptrain.proto.p2ptrain_pb2 import ReachabilityReport, ReachabilityRequest
from p2ptrain.swarm.relays import offered_relays, relay_ids

logger = logging.getLogger(__name__)
T = TypeVar("T")

PROBE_PROTOCOL = "p2ptrain.reachability.v1"
MAX_PORTS = 8
MAX_ASKED = 3
MAX_REQUEST_BYTES = 1024
DIAL_TIMEOUT_S = 3.0
MODES = ("auto", "public", "client")


class SwarmUnreachable(Exception):
    """The probe's p2pd could not start or reach any initial peer: the DHT would fail the same way, only later."""


@dataclass
class Reachability:
    """What this peer decided, and why (logged at start, published in its progress records, shown by status)."""

    client_mode: bool
    reason: str
    observed_maddr: str = ""
    """our address as an initial peer saw it ('' if none answered)"""
    reachable_ports: List[int] = field(default_factory=list)
    relay_maddrs: List[str] = field(default_factory=list)
    """client mode only: the bootstrap's relays, on which this peer reserves slots to run relayed (swarm/relays.py)"""

    @property
    def mode(self) -> str:
        return "relayed" if self.relay_maddrs else "client" if self.client_mode else "public"

    def __str__(self) -> str:
        return f"{self.mode}: {self.reason}"


def decide(setting: str, initial_peers: Sequence[str], host_maddrs: Sequence[str],
           announce_maddrs: Sequence[str] = (), timeout_s: float = 15.0, role: str = "") -> Reachability:
    """Public or client mode for ``--reachability setting`` (auto, public or client). ``role``: why the command set
    public or client itself (a bootstrap peer, status), said instead of the user's flag. Raises SwarmUnreachable if
    no initial peer can be reached at all."""
    if setting in ("public", "client"):
        client = setting == "client"
        what = "dialling out only" if client else "serving as a full member"
        return Reachability(client, role or f"--reachability {setting} (forced): {what}")
    if setting != "auto":
        raise ValueError(f"--reachability {setting!r} is unknown; use one of: {', '.join(MODES)}")
    if not initial_peers:
        return Reachability(False, "no initial peers: the first peer of a swarm is the one the others dial")
    started = time.monotonic()
    reports, errors = probe(initial_peers, host_maddrs, announce_maddrs, timeout_s)
    took = time.monotonic() - started
    for peer, report in reports:
        if report.reachable_ports:
            ip = _ip_of(report.observed_maddr)
            return Reachability(False, f"{peer[-8:]} connected back to {ip} port(s) "
                                       f"{', '.join(map(str, report.reachable_ports))} (probe {took:.1f}s)",
                                report.observed_maddr, list(report.reachable_ports))
    if reports:
        peer, report = reports[0]
        ip = _ip_of(report.observed_maddr) or report.observed_maddr
        why = report.error or f"could not connect back to {ip}"
        relays = next((list(r.relay_maddrs) for _, r in reports if r.relay_maddrs), [])
        if relays:
            return Reachability(True, f"{peer[-8:]} {why} (behind NAT; probe {took:.1f}s): through the bootstrap's "
                                      f"{len(relay_ids(relays))} relays while no worker is public, or forward a port",
                                report.observed_maddr, relay_maddrs=relays)
        return Reachability(True, f"{peer[-8:]} {why} (behind NAT or a firewall; probe {took:.1f}s); to serve as a "
                                  "full member, forward a port and pass --host-maddrs and --announce-maddrs",
                            report.observed_maddr)
    return _unprobed(initial_peers, host_maddrs, f"no initial peer could check whether this host is reachable "
                                                  f"({'; '.join(errors)})")


def _unprobed(initial_peers: Sequence[str], host_maddrs: Sequence[str], why: str,
              interfaces: Optional[List[ipaddress.IPv4Interface | ipaddress.IPv6Interface]] = None) -> Reachability:
    """Public or client mode from the addresses alone, when no initial peer answered the probe (module docstring,
    step 4). ``interfaces``: this host's addresses with their networks (default: read from the host)."""
    interfaces = _interfaces() if interfaces is None else interfaces
    listened = [ipaddress.ip_address(ip) for ip in map(_ip_of, host_maddrs) if ip]
    for maddr in initial_peers:
        ip = _ip_of(maddr)
        if ip is None:
            continue
        peer = ipaddress.ip_address(ip)
        for interface in interfaces:
            if peer not in interface.network:  # (never across IP versions)
                continue
            if any(address.is_unspecified or address == interface.ip for address in listened):
                where = "this host" if peer.is_loopback else f"the network {interface.network} of this host"
                return Reachability(False, f"{why}; the initial peer {ip} is on {where} and this peer listens there, "
                                           "so no NAT is in between: serving as a full member (unprobed; pass "
                                           "--reachability client if the peers cannot dial this host)")
    for interface in interfaces:
        if interface.ip.is_global and any(a.is_unspecified and a.version == interface.ip.version or a == interface.ip
                                          for a in listened):
            return Reachability(False, f"{why}; this host listens on its public IP {interface.ip}: serving as a full "
                                       "member (unprobed; pass --reachability client if a firewall stops the peers)")
    return Reachability(True, f"{why}; client mode works either way")


def _interfaces() -> List[ipaddress.IPv4Interface | ipaddress.IPv6Interface]:
    """This host's addresses, each with its network."""
    found = []
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family in (socket.AF_INET, socket.AF_INET6) and address.netmask:
                try:
                    found.append(ipaddress.ip_interface(f"{address.address.split('%')[0]}/{address.netmask}"))
                except ValueError:
                    continue
    return found


def probe(initial_peers: Sequence[str], host_maddrs: Sequence[str], announce_maddrs: Sequence[str] = (),
          timeout_s: float = 15.0) -> tuple:
    """Ask initial peers to dial us back. Returns ([(peer id, ReachabilityReport)], [error strings]); raises only
    SwarmUnreachable (no initial peer reached). Runs its own event loop in a thread, so it works from any caller."""
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="p2ptrain-probe") as pool:
        try:
            return pool.submit(asyncio.run, _probe(initial_peers, host_maddrs, announce_maddrs, timeout_s)).result()
        except SwarmUnreachable:
            raise
        except Exception as e:
            return [], [f"the probe failed: {_short(e)}"]


class _ClosedSocketFilter(logging.Filter):
    """p2pd logs the end of its control socket at shutdown ("use of closed network connection") as an ERROR."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "use of closed network connection" not in record.getMessage()


logging.getLogger("hivemind.p2p.p2p_daemon").addFilter(_ClosedSocketFilter())


async def _probe(initial_peers, host_maddrs, announce_maddrs, timeout_s) -> tuple:
    peer_ids = list(dict.fromkeys(Multiaddr(m)["p2p"] for m in initial_peers))[:MAX_ASKED]
    with p2ps_made() as made:
        try:
            # dht_mode client: this daemon only asks; no identity: its peer id is a throw-away one
            p2p = await P2P.create(initial_peers=list(initial_peers), host_maddrs=list(host_maddrs),
                                   dht_mode="client", startup_timeout=timeout_s, use_relay=False, auto_nat=False,
                                   nat_port_map=False)
        except Exception as e:
            for unstarted in made:  # p2pd refused to start (an initial peer that refuses): its sockets stay
                remove_unstarted_p2p_files(unstarted)
            raise SwarmUnreachable(_short(e)) from None
    try:
        ports = set()
        for maddr in [*await p2p.get_visible_maddrs(), *map(Multiaddr, announce_maddrs)]:
            if "tcp" in [proto.name for proto in maddr.protocols()] and int(maddr["tcp"]):
                ports.add(int(maddr["tcp"]))
        request = ReachabilityRequest(ports=sorted(ports)[:MAX_PORTS])
        answers = await asyncio.gather(*(_ask(p2p, PeerID.from_base58(peer), request, timeout_s) for peer in peer_ids),
                                       return_exceptions=True)
    finally:
        await p2p.shutdown()
    reports, errors = [], []
    for peer, answer in zip(peer_ids, answers):
        if isinstance(answer, BaseException):
            errors.append(f"{peer[-8:]}: {_short(answer)}")
        else:
            reports.append((peer, answer))
    return reports, errors


async def _ask(p2p: P2P, peer: PeerID, request: ReachabilityRequest, timeout_s: float) -> ReachabilityReport:
    async def exchange() -> ReachabilityReport:
        _, reader, writer = await p2p.call_binary_stream_handler(peer, PROBE_PROTOCOL)
        try:
            await P2P.send_protobuf(request, writer)
            return ReachabilityReport.FromString(await _read_message(reader, 64 * 1024))
        finally:
            writer.close()

    # the server answers within its dial timeout: an initial peer that says nothing for longer will not
    return await asyncio.wait_for(again_if_cut(exchange), min(timeout_s, DIAL_TIMEOUT_S + 7.0))


async def again_if_cut(exchange: Callable[[], Awaitable[T]]) -> T:
    """``exchange()``, run once more on a fresh stream if its answer was cut off on the way: CI saw a probe's answer
    end after its marker byte, once, while the peer joined next to another one (the join then guessed its mode from
    the addresses)."""
    try:
        return await exchange()
    except (asyncio.IncompleteReadError, ConnectionError):
        return await exchange()


# ------------------------------------------------------------------------------------------------- the server

async def serve_probes(_dht, node) -> None:
    """Run in the DHT process (``dht.run_coroutine(serve_probes)``): answer probes on this peer's p2pd; a peer that
    could not be dialled back is told of the relays this process runs (a bootstrap peer's, swarm/relays.py)."""
    await node.p2p.add_binary_stream_handler(PROBE_PROTOCOL, _handle_probe)


async def _handle_probe(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        report = await asyncio.wait_for(_answer(stream_info.addr, reader), DIAL_TIMEOUT_S + 5.0)
        if not report.reachable_ports and not report.error:
            report.relay_maddrs.extend(offered_relays())
        await P2P.send_protobuf(report, writer)
    except Exception as e:  # a peer's bad or vanished stream: nothing of ours to clean up beyond the writer
        logger.debug(f"reachability probe from {stream_info.peer_id} failed: {e!r}")
    finally:
        writer.close()


async def _answer(observed: Multiaddr, reader: asyncio.StreamReader) -> ReachabilityReport:
    report = ReachabilityReport(observed_maddr=str(observed))
    try:
        request = ReachabilityRequest.FromString(await _read_message(reader, MAX_REQUEST_BYTES))
    except Exception as e:
        report.error = f"sent a request that does not parse ({_short(e)})"
        return report
    ip = _ip_of(str(observed))
    ports = [port for port in dict.fromkeys(request.ports) if 0 < port < 65536]
    if not ip:
        report.error = f"came through {observed}, not from an IP address that can be dialled"
    elif not ports or len(ports) > MAX_PORTS:
        report.error = f"asked for {len(ports)} ports; ask for 1 to {MAX_PORTS}"
    else:
        connected = await asyncio.gather(*(_connects(ip, port) for port in ports))
        report.reachable_ports.extend(port for port, ok in zip(ports, connected) if ok)
    return report


async def _connects(ip: str, port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(ip, port), DIAL_TIMEOUT_S)
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    return True


async def _read_message(reader: asyncio.StreamReader, limit: int) -> bytes:
    """One message in hivemind's framing (marker byte, 8-byte length, bytes), refused if longer than ``limit``."""
    marker = await reader.readexactly(1)
    if marker != P2P.MESSAGE_MARKER:
        raise ValueError("not a message")
    (length,) = struct.unpack(">Q", await reader.readexactly(8))
    if length > limit:
        raise ValueError(f"a message of {length} bytes, more than {limit}")
    return await reader.readexactly(length)


def _ip_of(maddr: str) -> Optional[str]:
    try:
        parsed = Multiaddr(maddr)
        names = [proto.name for proto in parsed.protocols()]
    except Exception:
        return None
    if "p2p-circuit" in names:
        return None
    for name in ("ip4", "ip6"):
        if name in names:
            return parsed[name]
    return None


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1] if text else type(e).__name__


# ---------------------------------------------------------------------------------------- connections in use

async def _count_connections(_dht, node) -> dict:
    peers = await node.p2p.list_peers()
    # p2pd lists each connection's remote address: a relayed one goes through /p2p-circuit
    relayed = sum(any("p2p-circuit" in str(addr) for addr in peer.addrs) for peer in peers)
    return {"direct": len(peers) - relayed, "relayed": relayed}


def connection_counts(dht, timeout_s: float = 5.0) -> dict:
    """How many peers this peer's p2pd is connected to, directly and through relays ({} if it cannot say)."""
    try:
        return dht.run_coroutine(_count_connections, return_future=True).result(timeout=timeout_s)
    except Exception as e:
        logger.debug(f"could not list connections: {e!r}")
        return {}
