"""Circuit relays: a swarm whose workers are all behind NAT trains through the bootstrap's relays (issue 38).

A worker behind NAT cannot be dialled. In *client mode* (swarm/reachability.py) it joins groups that a public peer
leads and sends its whole vector to public reducers: that costs it nothing, but a swarm without a public worker
cannot average at all. A bootstrap peer started with ``--relays N`` (default 4) therefore runs N relay daemons (a
p2pd and identity each, circuit relay v2 service on, ``start_relays``) and names them in its answer to the
reachability probe. A worker the probe could not dial back, told of relays, runs *relayed*:

- its DHT stays in client mode; its p2pd reserves slots on those relays (autorelay, the relays as static relays:
  with 4 or more candidates within a second of joining, with fewer after go-libp2p's 3-minute boot delay);
- it publishes the relays in its progress records (``PeerProgress.relay_maddrs``);
- while a public worker is live it acts as a client (``RelayedPeer.follows_only``: it leads nothing, reduces
  nothing, serves no state), so a mixed swarm keeps client mode's cost of nothing through the relay;
- while none is, it is a full member: it leads groups, reduces its share and serves state, and it keeps a libp2p
  connection through the relays to every other relayed peer (``RelayedPeer.look``: p2pd then opens the round's
  streams on it). p2pd's hole punching made no direct connection through the test's NAT routers, so every byte
  between two relayed peers crosses the bootstrap's link twice: 2 x 2(n-1)/n x V per worker and round (V: the
  model's wire size), in and out.

The circuit address is ``<relay>/p2p-circuit/p2p/<peer>``. hivemind's Python multiaddr writes a ``/p2p/`` part as a
CID, which p2pd refuses ("length greater than remaining number of bytes in buffer"), so ``CircuitAddr`` writes the
bytes as go-multiaddr reads them (the peer id's multihash). Measurements: docs/bench/2026-11-29-relay.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import base58
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import read_unsigned_varint
from hivemind.utils.multiaddr import Multiaddr

from p2ptrain.hivemind_compat import p2p_connect, p2p_disconnect, terminate_p2p

logger = logging.getLogger(__name__)

RELAYS = 4
"""relay daemons a bootstrap peer runs by default: go-libp2p's autorelay reserves a slot at once when it knows at
least 4 relays, and waits 3 minutes with fewer (docs/bench/2026-11-29-relay)"""
RELAY_TIME_LIMIT_S = 24 * 3600
RELAY_LIMITS = {"relayMaxCircuits": 16, "relayMaxReservations": 128, "relayTimeLimit": f"{RELAY_TIME_LIMIT_S}s",
                "relayDataLimit": 1 << 40}
"""each relay daemon's limits (p2pd flags): open circuits per peer, reserved slots, and per relayed connection its
lifetime and the bytes relayed each way (p2pd's defaults, 30 minutes and 4 GiB, would cut a run's connections
every few rounds of a large model); p2pd has no bandwidth cap: the relayed bytes share the host's link"""
CONNECT_TIMEOUT_S = 10.0
CONNECT_TRIES = 3


def relay_limits_text(count: int) -> str:
    """The bootstrap's one-line statement of what it relays."""
    return (f"relaying for workers behind NAT through {count} relay daemons: at most "
            f"{RELAY_LIMITS['relayMaxCircuits']} circuits per peer and {RELAY_LIMITS['relayMaxReservations']} "
            f"reservations each, {RELAY_TIME_LIMIT_S // 3600} h and {RELAY_LIMITS['relayDataLimit'] >> 30} GiB "
            "each way per relayed connection, no bandwidth cap (every relayed byte crosses this host's link twice); "
            "--relays 0 turns relaying off")


class CircuitAddr:
    """``<relay>/p2p-circuit/p2p/<peer>`` as go-multiaddr encodes it, for p2pd's connect."""

    def __init__(self, relay: str, peer: str):
        self.relay, self.peer = relay, peer

    def to_bytes(self) -> bytes:
        head, _, relay_id = self.relay.partition("/p2p/")
        return Multiaddr(head).to_bytes() + _p2p_part(relay_id) + Multiaddr("/p2p-circuit").to_bytes() + \
            _p2p_part(self.peer)

    def __str__(self) -> str:
        return f"{self.relay}/p2p-circuit/p2p/{self.peer}"

    __repr__ = __str__


def _p2p_part(peer: str) -> bytes:
    multihash = base58.b58decode(peer)
    return bytes([0xa5, 0x03]) + _varint(len(multihash)) + multihash  # 0x01a5: the p2p protocol code, as a varint


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


# --------------------------------------------------------------------------------------- the bootstrap's relays

class _RelayP2P(P2P):
    """A p2pd started with ``RELAY_LIMITS`` on top of hivemind's flags."""

    @staticmethod
    def _make_process_args(*args, **kwargs) -> List[str]:
        return P2P._make_process_args(*args, **{**kwargs, **RELAY_LIMITS})


CHECK_PROTOCOL = "p2ptrain.relay-check.v1"
CHECK_BYTES = 1 << 18
"""what a relayed peer sends through a new connection before it counts it: twice the 128 KiB after which a fresh
circuit is sometimes cut (RelayedPeer)"""


class RelayPool:
    """The relay daemons of a bootstrap peer, in its DHT process (``start_relays``), whose exit takes them down.

    hivemind 1.1.12's p2pd runs two relay services and whichever registered last serves: one with its flags
    (``RELAY_LIMITS``) and one with go-libp2p's defaults (p2pd's ``EnableRelayV2``), which cut a circuit after
    128 KiB and 2 minutes. Which one registers last is a race: most daemons served
    the defaults (17 of 20 started with AutoNAT, 10 of 20 without). So each daemon is asked, as a client would ask,
    for a reservation (``_served_limit``): its answer names the limit it applies, and a daemon that answers
    go-libp2p's default is started again."""

    def __init__(self, count: int, hosts: Sequence[str]):
        self.count, self.hosts = count, list(hosts)
        self.daemons: List[P2P] = []
        self.maddrs: List[str] = []
        self.restarts = 0

    async def start(self, asker: P2P) -> None:
        """Start ``count`` daemons whose limits are ``RELAY_LIMITS`` (``asker``: the p2pd that asks them)."""
        while len(self.daemons) < self.count:
            # without AutoNAT the race goes our way about half the time (20 starts each), with it 3 times in 20
            hosts = [_next_port(m, len(self.daemons) + 1) for m in self.hosts]
            relay = await _RelayP2P.create(host_maddrs=hosts, force_reachability="public", dht_mode="client",
                                           auto_nat=False, nat_port_map=False)
            maddrs = await relay.get_visible_maddrs()
            visible = sorted(map(str, maddrs), key=lambda m: ("/127.0.0.1/" in m, m))
            limit = await _served_limit(asker, relay.peer_id, maddrs)
            if limit != (RELAY_TIME_LIMIT_S, RELAY_LIMITS["relayDataLimit"]) and self.restarts < MAX_RESTARTS:
                logger.debug(f"relay daemon {relay.peer_id} serves the limits {limit}: starting another")
                await relay.shutdown()  # and wait: the next one listens on its port
                self.restarts += 1
                continue
            self.daemons.append(relay)
            self.maddrs.extend(m for m in visible if "/tcp/" in m)

    def stop(self) -> None:
        while self.daemons:
            terminate_p2p(self.daemons.pop())


HOP_PROTOCOL = "/libp2p/circuit/relay/0.2.0/hop"
MAX_RESTARTS = 64
"""a daemon that serves the defaults is started again, up to this many times in all (each start takes 0.15 s)"""


async def _served_limit(asker: P2P, relay: PeerID, maddrs) -> Optional[Tuple[int, int]]:
    """Ask ``relay`` for a reservation (circuit relay v2: a HopMessage of type RESERVE) and return the limit its
    answer names, (seconds, bytes each way), or None if it named none or did not answer."""
    try:
        # without /p2p/: hivemind's multiaddr writes it in a form p2pd refuses (CircuitAddr)
        await asyncio.wait_for(p2p_connect(asker, relay, [Multiaddr(str(m).split("/p2p/")[0]) for m in maddrs]), 5.0)
        _, reader, writer = await asker.call_binary_stream_handler(relay, HOP_PROTOCOL)
        try:
            writer.write(b"\x02\x08\x00")  # length 2, then field 1 (type) = 0 (RESERVE)
            await writer.drain()
            length = await asyncio.wait_for(read_unsigned_varint(reader), 5.0)
            answer = _fields(await reader.readexactly(length))
        finally:
            writer.close()
        limit = _fields(answer.get(4, b""))
        return (limit.get(1, 0), limit.get(2, 0)) if limit else None
    except Exception as e:
        logger.debug(f"relay daemon {relay} did not answer a reservation: {e!r}")
        return None


def _fields(data: bytes) -> Dict[int, object]:
    """The top-level fields of a protobuf message: number -> int (varint) or bytes (length-delimited)."""
    fields, i = {}, 0
    while i < len(data):
        key, i = _varint_at(data, i)
        number, kind = key >> 3, key & 7
        if kind == 0:
            fields[number], i = _varint_at(data, i)
        elif kind == 2:
            length, i = _varint_at(data, i)
            fields[number], i = data[i:i + length], i + length
        else:
            i += 8 if kind == 1 else 4
    return fields


def _varint_at(data: bytes, i: int) -> Tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


async def _carries(p2p: P2P, peer: PeerID) -> bool:
    """Whether the connection to ``peer`` carries ``CHECK_BYTES`` (its ``_sink`` answers "ok" once it has them)."""
    try:
        _, reader, writer = await p2p.call_binary_stream_handler(peer, CHECK_PROTOCOL)
        try:
            writer.write(bytes(CHECK_BYTES))
            await writer.drain()
            return await asyncio.wait_for(reader.readexactly(2), 5.0) == b"ok"
        finally:
            writer.close()
    except Exception:
        return False


async def _sink(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The far end of a check: no end of stream is sent (p2pd would close the stream both ways with it)."""
    with contextlib.suppress(Exception):
        await reader.readexactly(CHECK_BYTES)
        writer.write(b"ok")
        await writer.drain()
    writer.close()


async def serve_relay_checks(_dht, node) -> None:
    """Run in a relayed peer's DHT process: answer the checks of the peers that connect to it through relays."""
    await node.p2p.add_binary_stream_handler(CHECK_PROTOCOL, _sink)


_pool: Optional[RelayPool] = None
"""this process's relays (a bootstrap peer's DHT process)"""


async def start_relays(_dht, node, count: int, host_maddrs: Sequence[str]) -> int:
    """Run in the bootstrap's DHT process (``dht.run_coroutine``): start ``count`` relay daemons on the DHT's hosts,
    at the next ports (``_next_port``)."""
    global _pool
    _pool = RelayPool(count, list(host_maddrs) or ["/ip4/0.0.0.0/tcp/0"])
    await _pool.start(node.p2p)
    if _pool.restarts:
        logger.info(f"{_pool.restarts} relay daemon(s) started again: they served go-libp2p's default limits")
    return count


def offered_relays() -> List[str]:
    """The relays this process offers to peers behind NAT (a probe's answer names them)."""
    return [] if _pool is None else list(_pool.maddrs)


def stop_relays() -> None:
    """End this process's relay daemons (the DHT process, however it ends)."""
    if _pool is not None:
        _pool.stop()


def _next_port(maddr: str, offset: int) -> str:
    """``maddr`` with its TCP port moved up by ``offset`` (relay i of a bootstrap on port P listens on P + i, so that
    an operator opens a known range), or left at 0."""
    parts = maddr.split("/")
    if "tcp" in parts:
        at = parts.index("tcp") + 1
        parts[at] = str(int(parts[at]) + offset) if int(parts[at]) else "0"
    return "/".join(parts)


def relay_ids(relay_maddrs: Sequence[str]) -> List[str]:
    return list(dict.fromkeys(Multiaddr(m)["p2p"] for m in relay_maddrs))


# ------------------------------------------------------------------------------------------ a relayed worker

def peer_mode(record) -> str:
    """A progress record's peer: "public", "relayed" (behind NAT, dialled through relays) or "client"."""
    return "relayed" if record.relay_maddrs else "client" if record.client_mode else "public"


def averages_as_client(dht) -> Optional[bool]:
    """The averager's client mode: False for a relayed peer (its DHT is in client mode, but it takes rounds' shares
    while no public worker is live); None otherwise (hivemind's default: the DHT's mode)."""
    return False if getattr(dht, "relayed", None) is not None else None


class RelayedPeer:
    """A worker behind NAT that the bootstrap's relays make dialable (module docstring). ``look`` takes every look
    at the run's records (the progress heartbeat's, every few seconds)."""

    def __init__(self, dht, relay_maddrs: Sequence[str]):
        self.dht, self.relay_maddrs = dht, list(relay_maddrs)
        self.public_live: Optional[bool] = None
        """whether the last look saw a live public worker (None: no look yet)"""
        self.connected: Dict[str, float] = {}
        """peer (base58) -> when a circuit connection to it was last made or seen"""
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None

    @property
    def follows_only(self) -> bool:
        """Act as a client this round: a public worker is live, or no look has said otherwise yet."""
        return self.public_live is not False

    def look(self, others: Sequence) -> None:
        """The other live peers' records: note whether a public worker is among them, and when none is, connect to
        every relayed one that this peer's p2pd is not connected to yet. A look that read no record is no news.
        The connecting runs in a thread of its own (dials and checks take seconds, up to ``CONNECT_TIMEOUT_S`` each):
        the caller, the progress heartbeat, must refresh this peer's record meanwhile or the others see it gone."""
        if not others:
            return
        self.public_live = any(not r.client_mode for r in others)
        if self.public_live:
            return
        targets = [(r.peer_id, tuple(r.relay_maddrs)) for r in others if r.relay_maddrs]
        if targets and self._lock.acquire(blocking=False):  # one connecting look at a time
            self._thread = threading.Thread(target=self._connect_then_release, args=(targets,), daemon=True,
                                            name="p2ptrain-relay-connect")
            self._thread.start()

    def _connect_then_release(self, targets: List[Tuple[str, Tuple[str, ...]]]) -> None:
        try:
            self._connect(targets)
        finally:
            self._lock.release()

    def _connect(self, targets: List[Tuple[str, Tuple[str, ...]]]) -> None:
        try:
            outcome = self.dht.run_coroutine(_connect_all(targets), return_future=True).result(
                timeout=CONNECT_TIMEOUT_S + 5)
        except Exception as e:  # the DHT is shutting down, or slow: the next look tries again
            logger.debug(f"could not connect through the relays: {e!r}")
            return
        now = time.monotonic()
        for peer, error in outcome.items():
            if error is None:
                self.connected[peer] = now
            else:
                logger.info(f"could not reach {peer[-8:]} through the relays yet ({error}); trying again at the "
                            "next look")


class _connect_all:
    """The DHT-process side of ``RelayedPeer._connect`` (a picklable callable for ``dht.run_coroutine``): connect to
    each target not connected yet through its relays; peer -> None (connected) or the error, in words."""

    def __init__(self, targets: List[Tuple[str, Tuple[str, ...]]]):
        self.targets = targets

    async def __call__(self, _dht, node) -> Dict[str, Optional[str]]:
        connected = {p.peer_id.to_base58() for p in await node.p2p.list_peers()}
        todo = [(peer, relays) for peer, relays in self.targets if peer not in connected]
        errors = await asyncio.gather(*(self._connect(node.p2p, peer, relays) for peer, relays in todo))
        return {**{peer: None for peer, _ in self.targets if peer in connected},
                **{peer: error for (peer, _), error in zip(todo, errors)}}

    @staticmethod
    async def _connect(p2p: P2P, peer: str, relays: Sequence[str]) -> Optional[str]:
        """Connect through the relays, and check that the connection carries more than 128 KiB: a circuit is
        sometimes cut there (more often the first one between two peers), and p2pd would keep the connection."""
        target = PeerID.from_base58(peer)
        for _ in range(CONNECT_TRIES):
            try:
                await asyncio.wait_for(p2p_connect(p2p, target, [CircuitAddr(r, peer) for r in relays]),
                                       CONNECT_TIMEOUT_S)
            except Exception as e:
                text = str(e).strip().splitlines()
                return text[-1][:200] if text else type(e).__name__
            if await _carries(p2p, target):
                return None
            with contextlib.suppress(Exception):
                await p2p_disconnect(p2p, target)
        return f"every relayed connection was cut within {CHECK_BYTES >> 10} KiB ({CONNECT_TRIES} tries)"
