"""Relays for workers behind NAT (swarm/relays.py): circuit addresses as p2pd reads them, and a relayed peer's
choice between acting as a client and as a full member. The relays themselves, and the check that finds a relay
daemon serving go-libp2p's default limits, run on real p2pd in test_reachability.py; behind real NAT in tests/netns."""

from __future__ import annotations

import base58
import pytest
from hivemind.utils.multiaddr import Multiaddr

from p2ptrain.proto.p2ptrain_pb2 import PeerProgress
from p2ptrain.swarm.relays import CircuitAddr, RelayedPeer, averages_as_client, peer_mode

RELAY = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"
PEER = "12D3KooWByf5atD8CXEfzhFroUwAfhr2SEwR6x52UQSK6y5qVKnJ"


def test_a_circuit_address_is_written_as_go_multiaddr_reads_it():
    """/p2p/ as the peer id's multihash (code 0x01a5, varint a5 03, then its length), not hivemind's CID."""
    address = CircuitAddr(f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}", PEER)
    relay_hash, peer_hash = base58.b58decode(RELAY), base58.b58decode(PEER)
    expected = (Multiaddr("/ip4/10.0.0.1/tcp/4001").to_bytes() + bytes([0xa5, 0x03, len(relay_hash)]) + relay_hash
                + bytes([0xa2, 0x02]) + bytes([0xa5, 0x03, len(peer_hash)]) + peer_hash)  # 0x0122: p2p-circuit
    assert address.to_bytes() == expected
    assert str(address) == f"/ip4/10.0.0.1/tcp/4001/p2p/{RELAY}/p2p-circuit/p2p/{PEER}"


def record(peer: str, client_mode: bool = False, relays=()) -> PeerProgress:
    return PeerProgress(run_id="r", peer_id=peer, client_mode=client_mode, relay_maddrs=list(relays))


def test_a_record_says_public_relayed_or_client():
    assert peer_mode(record("A")) == "public"
    assert peer_mode(record("B", client_mode=True)) == "client"
    assert peer_mode(record("C", client_mode=True, relays=[f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}"])) == "relayed"


class RecordingDHT:
    """Stands in for the DHT handle only where RelayedPeer hands it a coroutine: records the targets."""

    def __init__(self):
        self.asked = []

    def run_coroutine(self, coroutine, return_future=False):
        self.asked.append(coroutine.targets)

        class Done:
            def result(self, timeout=None):
                return {peer: None for peer, _ in coroutine.targets}
        return Done()


def test_a_relayed_peer_follows_while_a_public_worker_is_live_and_leads_and_connects_when_none_is():
    dht = RecordingDHT()
    me = RelayedPeer(dht, [f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}"])
    assert averages_as_client(type("D", (), {"relayed": me})()) is False  # its averager takes handlers and shares
    assert me.follows_only  # no look yet: as a client, the safe side in a mixed swarm
    relays = (f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}",)
    me.look([record("P"), record("N", client_mode=True, relays=relays)])
    assert me.follows_only and not dht.asked  # a public worker is live: nobody dials a relayed peer
    me.look([])  # a look that read nothing is no news
    assert me.follows_only
    me.look([record("N", client_mode=True, relays=relays), record("C", client_mode=True)])
    me._thread.join(timeout=10)  # the connecting runs apart from the look (the heartbeat's thread)
    assert not me.follows_only and dht.asked == [[("N", relays)]] and "N" in me.connected


@pytest.mark.parametrize("count", [1, 3])
def test_a_bootstrap_refuses_fewer_than_four_relays(count):
    from p2ptrain.swarm.dht import SwarmConfig, SwarmError, start_dht

    with pytest.raises(SwarmError, match=f"--relays {count}: use 0 .* or at least 4"):
        start_dht(SwarmConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"]), relays=count)


def test_connecting_never_holds_up_the_look_that_started_it():
    """The heartbeat that looks must go on refreshing the peer's record while dials take their seconds: a look
    returns with the connecting still blocked, and a second look while it runs starts no second one."""
    import threading

    release = threading.Event()

    class BlockingDHT(RecordingDHT):
        def run_coroutine(self, coroutine, return_future=False):
            done = super().run_coroutine(coroutine, return_future)
            release.wait(30)
            return done

    dht = BlockingDHT()
    me = RelayedPeer(dht, [f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}"])
    others = [record("N", client_mode=True, relays=(f"/ip4/10.0.0.1/tcp/1/p2p/{RELAY}",))]
    me.look(others)  # returns although the connecting is blocked
    first = me._thread
    me.look(others)
    assert me._thread is first and first.is_alive() and "N" not in me.connected
    release.set()
    first.join(timeout=10)
    assert "N" in me.connected and len(dht.asked) == 1
