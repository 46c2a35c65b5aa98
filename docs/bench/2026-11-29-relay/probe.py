"""Can two peers that are each behind their own NAT router reach each other through a public relay, with the p2pd
that hivemind 1.1.12 bundles? (issue 38; README.md beside this file has what it found)

    sudo [RELAYS=N] python docs/bench/2026-11-29-relay/probe.py [RATE_MBIT]

Three network namespaces (p2ptrain.bench.netns): host 0 public, hosts 1 and 2 each behind a MASQUERADE router. Host 0
runs a hivemind P2P with reachability forced public (p2pd's relay service is on by default); hosts 1 ("a") and 2
("b") run one each with auto relay, the relay as trusted relay and reachability forced private. Each NATed peer
looks at its visible addresses for a relayed (/p2p-circuit) one for ``POLL_S`` seconds; then a dials b (at a relayed
address if b has one, else at the circuit through the relay) every 5 s until it connects, and streams ``MB``
megabytes to it. The peers meet through files in a temporary folder.
"""

import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import base58
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

MB = int(os.environ.get("MB", "64"))
POLL_S = float(os.environ.get("POLL_S", "20"))
DIAL_FOR_S = float(os.environ.get("DIAL_FOR_S", "300"))
RELAYS = int(os.environ.get("RELAYS", "1"))
"""how many relay daemons host 0 runs (each its own p2pd and identity): autorelay waits 3 minutes with fewer than 4"""
LIFE_S = 400.0
"""how long the relay and the whole probe may run"""


class GoBytes:
    """A multiaddr whose /p2p/ part is encoded as go-multiaddr reads it (the peer id's multihash). hivemind's Python
    multiaddr writes a CID there (0x01 0x72 + the multihash), which p2pd refuses: "length greater than remaining
    number of bytes in buffer"."""

    def __init__(self, text: str):
        self.text = text

    def to_bytes(self) -> bytes:
        head, _, rest = self.text.partition("/p2p/")
        peer, _, tail = rest.partition("/")
        multihash = base58.b58decode(peer)
        encoded = Multiaddr(head).to_bytes() + bytes([0xa5, 0x03, len(multihash)]) + multihash  # 0x01a5: p2p
        return encoded + (Multiaddr("/" + tail).to_bytes() if tail else b"")

    def __repr__(self) -> str:
        return self.text


def wait_for_file(folder: str, name: str, timeout_s: float = 60.0) -> str:
    path = os.path.join(folder, name)
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise SystemExit(f"no {name} in {folder} after {timeout_s:.0f} s")
        time.sleep(0.2)
    time.sleep(0.1)  # written whole
    with open(path) as f:
        return f.read().strip()


def write_file(folder: str, name: str, text: str) -> None:
    with open(os.path.join(folder, name), "w") as f:
        f.write(text)


async def relay(folder: str, address: str) -> None:
    daemons = [await P2P.create(host_maddrs=[f"/ip4/{address}/tcp/0"], force_reachability="public")
               for _ in range(RELAYS)]
    maddrs = [str((await p2p.get_visible_maddrs())[0]) for p2p in daemons]
    write_file(folder, "relay", json.dumps(maddrs))
    print("relays", maddrs, flush=True)
    await asyncio.sleep(LIFE_S)
    for p2p in daemons:
        await p2p.shutdown()


async def natted_peer(role: str, folder: str, address: str) -> None:
    relay_maddrs = json.loads(wait_for_file(folder, "relay"))
    p2p = await P2P.create(initial_peers=relay_maddrs, host_maddrs=[f"/ip4/{address}/tcp/0"],
                           use_auto_relay=True, trusted_relays=relay_maddrs, force_reachability="private")
    started = time.monotonic()
    while True:
        maddrs = [str(a) for a in await p2p.get_visible_maddrs(latest=True)]
        if any("p2p-circuit" in a for a in maddrs) or time.monotonic() - started > POLL_S:
            break
        await asyncio.sleep(0.5)
    print(f"{role} maddrs after {time.monotonic() - started:.1f} s: {maddrs}", flush=True)
    if role == "b":
        await receive(p2p, folder, maddrs)
    else:
        await send(p2p, folder, relay_maddrs)
    await p2p.shutdown()


async def receive(p2p: P2P, folder: str, maddrs: list) -> None:
    done = asyncio.Event()

    async def sink(_info, reader, _writer) -> None:
        received, started = 0, time.perf_counter()
        while True:
            try:
                chunk = await reader.read(1 << 20)
            except ConnectionError as e:
                print(f"b: the stream broke after {received / 1e6:.1f} MB in {time.perf_counter() - started:.1f} s: "
                      f"{e!r}", flush=True)
                raise
            if not chunk:
                break
            received += len(chunk)
        # its own rate: p2pd closes the stream at a's end, so b sends no reply
        print(f"b received {received} bytes at {received / 1e6 / (time.perf_counter() - started):.1f} MB/s",
              flush=True)
        done.set()

    await p2p.add_binary_stream_handler("sink", sink)
    write_file(folder, "b", json.dumps({"id": p2p.peer_id.to_base58(), "maddrs": maddrs}))
    await asyncio.wait_for(done.wait(), LIFE_S)


async def send(p2p: P2P, folder: str, relay_maddrs: list) -> None:
    b = json.loads(wait_for_file(folder, "b"))
    peer = PeerID.from_base58(b["id"])
    targets = ([Multiaddr(a) for a in b["maddrs"] if "p2p-circuit" in a]
               or [GoBytes(relay + "/p2p-circuit") for relay in relay_maddrs])
    print("a dials", targets, flush=True)
    started = time.monotonic()
    while True:  # b is reachable once it holds a reservation on the relay
        try:
            await p2p._client.connect(peer, targets)
            break
        except Exception as e:
            if time.monotonic() - started > DIAL_FOR_S:
                raise
            print(f"a: dial failed after {time.monotonic() - started:.0f} s: {e}", flush=True)
            await asyncio.sleep(5)
    print(f"a connected {time.monotonic() - started:.1f} s after its first dial", flush=True)
    started = time.perf_counter()
    _, _, writer = await p2p.call_binary_stream_handler(peer, "sink")
    chunk = bytes(1 << 20)
    for sent in range(MB):
        try:
            writer.write(chunk)
            await writer.drain()
        except ConnectionError as e:
            print(f"a: the stream broke after {sent} MB in {time.perf_counter() - started:.1f} s: {e!r}", flush=True)
            raise
    writer.write_eof()
    seconds = time.perf_counter() - started
    print(f"a sent {MB} MiB in {seconds:.2f} s: {MB * 1.048576 / seconds:.1f} MB/s", flush=True)
    print("a peers", [(str(p.peer_id)[-6:], [str(a) for a in p.addrs]) for p in await p2p.list_peers()], flush=True)


def run(rate_mbit) -> None:
    from p2ptrain.bench.netns import Topology

    topology = Topology(hosts=3, rate_mbit=rate_mbit, nat=frozenset({1, 2}))
    folder = tempfile.mkdtemp(prefix="p2pt-relay-probe-")
    procs = []
    try:
        for i, role in enumerate(["relay", "a", "b"]):
            command = topology.command(i, sys.executable, __file__, role, folder, topology.addresses[i])
            procs.append(subprocess.Popen(command))
        procs[1].wait(timeout=LIFE_S)  # a: done or failed; b ends once a's stream ended, or never if none came
        try:
            procs[2].wait(timeout=10)
        except subprocess.TimeoutExpired:
            print("b: no stream from a came", flush=True)
    finally:
        for proc in procs:
            proc.kill()
        topology.close()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 2:
        role, folder, address = sys.argv[1:4]
        asyncio.run(relay(folder, address) if role == "relay" else natted_peer(role, folder, address))
    else:
        run(float(sys.argv[1]) if len(sys.argv) > 1 else None)
