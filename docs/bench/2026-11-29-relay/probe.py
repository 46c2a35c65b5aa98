"""Can two peers that are each behind their own NAT router reach each other through a public relay, with the p2pd
that hivemind 1.1.12 bundles? (issue 38; docs/bench/2026-11-29-relay/README.md has what it found)

    sudo python docs/bench/2026-11-29-relay/probe.py [RATE_MBIT]

Three network namespaces (p2ptrain.bench.netns): host 0 public, hosts 1 and 2 each behind a MASQUERADE router. Host 0
runs a hivemind P2P with reachability forced public (p2pd's relay service is on by default); hosts 1 ("a") and 2
("b") run one each with auto relay, the relay as trusted relay and reachability forced private. Each NATed peer
polls its visible addresses for a relayed (/p2p-circuit) one; then a dials b (a relayed address if b has one, else
the explicit circuit through the relay) and streams MB megabytes to it.
"""
import subprocess, shutil
import asyncio, sys, time, os, json
from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

MB = int(os.environ.get("MB", "64"))

def wait_file(d, role, name, t=60):
    p = os.path.join(d, name); end = time.time() + t
    while not os.path.exists(p):
        if time.time() > end: raise SystemExit(f"{role}: no {name}")
        time.sleep(0.2)
    time.sleep(0.1); return open(p).read().strip()

class GoBytes:
    """A multiaddr whose /p2p/ part is encoded as go-multiaddr reads it (the peer id's multihash). hivemind's Python
    multiaddr writes a CID there (0x01 0x72 + the multihash), which p2pd refuses: "length greater than remaining
    number of bytes in buffer"."""

    def __init__(self, text):
        self.text = text

    def to_bytes(self):
        import base58
        head, _, rest = self.text.partition("/p2p/")
        peer, _, tail = rest.partition("/")
        mh = base58.b58decode(peer)
        out = Multiaddr(head).to_bytes() + bytes([0xa5, 0x03, len(mh)]) + mh
        return out + (Multiaddr("/" + tail).to_bytes() if tail else b"")

    def __repr__(self):
        return self.text


async def main(role, d, addr):
    if role == "relay":
        p2p = await P2P.create(host_maddrs=[f"/ip4/{addr}/tcp/0"], force_reachability="public")
        m = [str(a) for a in await p2p.get_visible_maddrs()]
        open(os.path.join(d, "relay"), "w").write(m[0])
        print("relay", m, flush=True)
        await asyncio.sleep(float(os.environ.get("LIFE", "120")))
        await p2p.shutdown(); return
    relay = wait_file(d, role, "relay")
    p2p = await P2P.create(initial_peers=[relay], host_maddrs=[f"/ip4/{addr}/tcp/0"], use_auto_relay=True,
                           trusted_relays=[relay], force_reachability="private")
    t0 = time.time()
    for _ in range(int(os.environ.get("POLLS","60"))):
        m = [str(a) for a in await p2p.get_visible_maddrs(latest=True)]
        if any("p2p-circuit" in a for a in m): break
        await asyncio.sleep(0.5)
    print(role, "maddrs after", round(time.time()-t0, 1), "s:", m, flush=True)
    if role == "b":
        got = asyncio.Event(); box = {}
        async def sink(info, reader, writer):
            n = 0; s = time.perf_counter()
            while True:
                try:
                    chunk = await reader.read(1 << 20)
                except ConnectionError as e:
                    print(f"b: the stream broke after {n / 1e6:.1f} MB in {time.perf_counter() - s:.1f} s: {e!r}",
                          flush=True)
                    raise
                if not chunk: break
                n += len(chunk)
            box["mb_s"] = n / 1e6 / (time.perf_counter() - s); box["n"] = n
            print("b received", box, flush=True)  # its own rate: p2pd closes the stream at a's end, so no reply
            got.set()
        await p2p.add_binary_stream_handler("sink", sink)
        open(os.path.join(d, "b"), "w").write(json.dumps({"id": p2p.peer_id.to_base58(), "maddrs": m}))
        await asyncio.wait_for(got.wait(), 300)
        await asyncio.sleep(1)
    else:
        b = json.loads(wait_file(d, role, "b"))
        pid = PeerID.from_base58(b["id"])
        circ = [Multiaddr(a) for a in b["maddrs"] if "p2p-circuit" in a] or [GoBytes(relay + "/p2p-circuit")]
        print("a dials", circ, flush=True)
        started = time.perf_counter()
        while True:  # b is reachable once it holds a reservation on the relay
            try:
                await p2p._client.connect(pid, circ)
                break
            except Exception as e:
                if time.perf_counter() - started > float(os.environ.get("DIAL_FOR_S", "300")):
                    raise
                print(f"a: dial failed after {time.perf_counter() - started:.0f} s: {e}", flush=True)
                await asyncio.sleep(5)
        print("a connected", round(time.perf_counter() - started, 1), "s after its first dial", flush=True)
        s = time.perf_counter()
        info, reader, writer = await p2p.call_binary_stream_handler(pid, "sink")
        buf = b"\0" * (1 << 20)
        for i in range(MB):
            try:
                writer.write(buf); await writer.drain()
            except ConnectionError as e:
                print(f"a: the stream broke after {i} MB in {time.perf_counter() - s:.1f} s: {e!r}", flush=True)
                raise
        writer.write_eof()
        el = time.perf_counter() - s
        print("a sent", MB, "MB in", round(el, 2), "s:", round(MB*1.048576/el, 1), "MB/s", flush=True)
        peers = await p2p.list_peers()
        print("a peers", [(str(p.peer_id)[-6:], [str(x) for x in p.addrs]) for p in peers], flush=True)
    await p2p.shutdown()



def run(rate):
    from p2ptrain.bench.netns import Topology
    topo = Topology(hosts=3, rate_mbit=rate, nat=frozenset({1, 2}))
    d = "/tmp/p2pt-relay-probe"
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    procs = []
    try:
        for i, role in enumerate(["relay", "a", "b"]):
            env = dict(os.environ, LIFE=os.environ.get("LIFE", "400"), POLLS=os.environ.get("POLLS", "40"))
            procs.append(subprocess.Popen(topo.command(i, sys.executable, __file__, role, d, topo.addresses[i]),
                                          env=env))
        procs[1].wait(timeout=400)  # a: done or failed; b ends once a's stream ended, or never if none came
        try:
            procs[2].wait(timeout=10)
        except subprocess.TimeoutExpired:
            print("b: no stream from a came", flush=True)
    finally:
        for p in procs:
            p.kill()
        topo.close()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 2:
        asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3]))
    else:
        run(float(sys.argv[1]) if len(sys.argv) > 1 else None)
