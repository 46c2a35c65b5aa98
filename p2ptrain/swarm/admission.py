"""Does the swarm admit this peer? A check at start-up, so a peer with no swarm key, another key, or a key for an
open swarm is told at once and exits, instead of training alone while every peer ignores its records.

A private swarm's peers refuse everything an outsider writes or asks (security.py), but silently: the outsider's DHT
starts, its records are dropped, no group ever takes it. So right after its DHT is up, a joining peer asks its
initial peers, on the stream protocol ``PROTOCOL``, "is this swarm private, and do you admit me?", sending its
admission token (security.SwarmAuth.token, bound to its peer id, which libp2p authenticates). Each answers whether
it runs with a key, whether the token is valid for that key, and its own token, which proves to an asker with the
same key that the initial peer holds it too (a token reveals nothing usable: it is valid only for its own peer id).

Refused by every initial peer that answered: ``SwarmRefused`` with the fix. No answer at all (initial peers of an
earlier version, or a network failure): the peer starts as before; its records are then checked as they arrive.
Every p2ptrain peer serves the check in its DHT process (``serve_admission``), the bootstrap peer too.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import List, Optional, Sequence, Tuple

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from p2ptrain.proto.p2ptrain_pb2 import AdmissionReport, AdmissionRequest
from p2ptrain.security import SwarmAuth, _RateLimitedWarning
from p2ptrain.swarm.reachability import _read_message, _short, again_if_cut

logger = logging.getLogger(__name__)

PROTOCOL = "p2ptrain.admission.v1"
MAX_REQUEST_BYTES = 1024
MAX_ASKED = 3
ANSWER_TIMEOUT_S = 10.0


class SwarmRefused(Exception):
    """The swarm does not admit this peer (no key, another key, or a key for an open swarm); the message says
    which and what to do."""


# ------------------------------------------------------------------------------------------------- the server

_refusals = _RateLimitedWarning()


def serve_admission(dht, auth: SwarmAuth) -> None:
    """Answer admission checks from joining peers (in the DHT process of ``dht``)."""
    dht.run_coroutine(partial(_serve, auth))


async def _serve(auth: SwarmAuth, _dht, node) -> None:
    await node.p2p.add_binary_stream_handler(PROTOCOL, partial(_handle, auth, auth.token(node.peer_id)))


async def _handle(auth: SwarmAuth, own_token: bytes, stream_info, reader: asyncio.StreamReader,
                  writer: asyncio.StreamWriter) -> None:
    try:
        request = AdmissionRequest.FromString(
            await asyncio.wait_for(_read_message(reader, MAX_REQUEST_BYTES), ANSWER_TIMEOUT_S))
        admitted = auth.admits(stream_info.peer_id, request.token)
        if not admitted:
            why = "it has no swarm key" if not request.token else "its swarm key is another one"
            _refusals(f"refused peer {stream_info.peer_id} at join: {why} (every peer of this swarm needs the same "
                      "--swarm-key file)")
        await P2P.send_protobuf(AdmissionReport(private_swarm=auth.private, admitted=admitted, token=own_token),
                                writer)
    except Exception as e:  # a peer's bad or vanished stream: nothing of ours to clean up beyond the writer
        logger.debug(f"admission check from {stream_info.peer_id} failed: {e!r}")
    finally:
        writer.close()


# ------------------------------------------------------------------------------------------------- the asker

def check_admission(dht, auth: SwarmAuth, initial_peers: Sequence[str], key_option: Optional[str],
                    timeout_s: float = ANSWER_TIMEOUT_S) -> None:
    """Ask up to MAX_ASKED initial peers whether they admit this peer (through its running ``dht``). Raises
    SwarmRefused if every one that answered refuses it (or is open while this peer has a key); returns if one
    admits it, or if none answered. ``key_option``: how the user gave the key (``--swarm-key FILE``), for messages."""
    peers = list(dict.fromkeys(Multiaddr(m)["p2p"] for m in initial_peers))[:MAX_ASKED]
    if not peers:
        return
    timeout_s = min(timeout_s, ANSWER_TIMEOUT_S)
    try:
        answers = dht.run_coroutine(partial(_ask_all, auth, peers, timeout_s), return_future=True).result(
            timeout=timeout_s + 5.0)
    except Exception as e:
        logger.debug(f"could not ask the initial peers whether they admit this peer: {e!r}")
        return
    refusals = []
    for peer, report, error in answers:
        if report is None:
            logger.debug(f"initial peer {peer} did not answer the admission check ({error})")
            continue
        refusal = _refusal(auth, PeerID.from_base58(peer), AdmissionReport.FromString(report), key_option)
        if refusal is None:
            return
        refusals.append(f"{refusal[0]} {peer[-8:]}{refusal[1]}")
    if refusals:
        raise SwarmRefused(refusals[0])


def _refusal(auth: SwarmAuth, peer: PeerID, report: AdmissionReport, key_option: Optional[str]):
    """None if ``report`` admits us, else the message, split around where the peer's name goes."""
    if report.private_swarm and not auth.private:
        return ("the swarm refused this peer: it is private and this peer has no swarm key (initial peer", "); "
                "start it with the swarm's key file, --swarm-key FILE (the file the swarm's peers run with)")
    if auth.private and not report.private_swarm:
        return ("the swarm is open (initial peer", f" runs without a swarm key), so this peer's {key_option} would "
                "refuse all of its peers; leave --swarm-key out to join it, or point --initial-peers at the "
                "private swarm")
    if auth.private and not (report.admitted and auth.admits(peer, report.token)):
        return (f"the swarm refused this peer's {key_option}: it runs with another key (initial peer",
                "); use the key file the swarm's peers run with")
    return None


async def _ask_all(auth: SwarmAuth, peers: List[str], timeout_s: float, _dht, node) -> List[Tuple]:
    """(peer, serialized AdmissionReport or None, error) for each peer; run in the DHT process."""
    request = AdmissionRequest(token=auth.token(node.peer_id))

    async def ask(peer: str) -> Tuple:
        try:
            report = await asyncio.wait_for(
                again_if_cut(partial(_exchange, node.p2p, PeerID.from_base58(peer), request)), timeout_s)
            return peer, report, ""
        except Exception as e:  # an initial peer of an earlier version (no such protocol), gone, or too slow
            return peer, None, _short(e) if str(e) else type(e).__name__

    return list(await asyncio.gather(*(ask(peer) for peer in peers)))


async def _exchange(p2p: P2P, peer: PeerID, request: AdmissionRequest) -> bytes:
    _, reader, writer = await p2p.call_binary_stream_handler(peer, PROTOCOL)
    try:
        await P2P.send_protobuf(request, writer)
        report = await _read_message(reader, 4096)
        AdmissionReport.FromString(report)  # refuse garbage here, where it arrived
        return report
    finally:
        writer.close()
