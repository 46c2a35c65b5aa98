"""What the averager's parts (audits, evidence, state transfer, sparse gather) may use of it, as one object.

The averager builds one ``AveragerContext`` in the host process, before its process forks (the fork copies it with
the averager, and its callables then act on the averager process's copy); the parts use it in the averager process.
A part reads nothing else of the averager, so a test builds a part with a context of fakes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from hivemind.p2p import PeerID

from p2ptrain.security import SwarmAuth


@dataclass(frozen=True)
class AveragerContext:
    prefix: str
    """the run's namespace: the averager's RPC handles and DHT keys start with it"""
    auth: SwarmAuth
    """who may take part (the swarm key's rule): checks others' admission tokens, makes ours"""
    dht: Any
    """the DHT (hivemind's ``DHT``: ``get`` and ``store``), for the evidence records and the declared donors"""
    own_id: Callable[[], PeerID]
    """this peer's id"""
    stub: Callable[[PeerID], Any]
    """an RPC stub of the averager's servicer on that peer (averager process: the P2P lives there)"""
    ban: Callable[[PeerID, str], None]
    """exclude a peer from our groups, state and pieces for a while, saying why (the averager logs it)"""
    is_banned: Callable[[PeerID], bool]

    @property
    def peer_id(self) -> PeerID:
        return self.own_id()
