"""The swarm as a dashboard shows it (``/api/swarm``): the live peers' progress records (what ``status --json``
shows), their telemetry records (loss, evals, rounds, bans), and what the dashboard kept of earlier looks, so that
its curves go back further than the window a record holds. Read from the DHT by any peer: no central server.

A peer whose records vanished stays listed as stale for ``STALE_KEEP_S``, so an operator sees who left; the
warnings say what an operator should act on (a stale or lagging peer, an excluded peer, too few public peers).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

logger = logging.getLogger(__name__)

MAX_POINTS_PER_PEER = 2000
MAX_ROUNDS = 2000
STALE_AFTER_S = 20.0
"""a peer whose progress record is older than this is stale: records are refreshed every 5 s and expire after 15 s.
Younger, it is live even when the last read missed its record"""
STALE_KEEP_S = 300.0
"""a peer whose records are gone is still listed (stale) this long"""


def _short(peer_id: str) -> str:
    return f"...{peer_id[-8:]}"


def _tokens_per_s(seen: Dict[str, Any], record: Any) -> Optional[float]:
    if seen.get("block_size") and seen.get("samples_per_s") is not None:
        return _number(seen["samples_per_s"] * seen["block_size"])
    return _number(record.tokens_per_s) if record is not None else None


def _number(value: float) -> Optional[float]:
    """JSON has no NaN or infinity: unknown values are null."""
    return value if value is not None and math.isfinite(value) else None


class SwarmView:
    """Looks at run ``run_id`` through ``dht`` every ``refresh_s`` (``start``) or when asked (``look``), and keeps
    what it saw; ``snapshot()`` is the dashboard's JSON, ``status()`` the same object as ``status --json``."""

    def __init__(self, dht, run_id: str, *, private: bool, refresh_s: float = 2.0):
        self.dht, self.run_id, self.private, self.refresh_s = dht, run_id, private, refresh_s
        self._lock = threading.Lock()
        self._status: Dict[str, Any] = {"run_id": run_id, "peers": [], "public_peers": 0, "coverage": None}
        self._telemetry: Dict[str, Any] = {}
        self._losses: Dict[str, Dict[int, Tuple[int, float, float]]] = {}
        self._evals: Dict[str, Dict[int, Tuple[int, float, float]]] = {}
        self._rounds: Dict[Tuple[str, int, float], Dict[str, Any]] = {}
        self._last_peers: Dict[str, Dict[str, Any]] = {}  # every peer seen, as last seen, with when (monotonic)
        self.updated_at: Optional[float] = None
        self.looks = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    # ------------------------------------------------------------------------------------------------ reading

    def start(self) -> "SwarmView":
        self._thread = threading.Thread(target=self._loop, name="p2ptrain-swarm-view", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=15)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.look()
            except Exception as e:  # the DHT answers again later: a failed look keeps the last one
                logger.warning(f"could not read run {self.run_id!r} from the DHT: {e!r}")
            self._stop.wait(self.refresh_s)

    def look(self) -> None:
        """One read of the run's records, merged into what was kept."""
        from p2ptrain.cli.status import read_status
        from p2ptrain.observe.telemetry import fetch_telemetry

        # strict: a read that failed (a timeout under load) must not show a live swarm as empty; the loop keeps the
        # last answer and says so
        self.merge(read_status(self.dht, self.run_id, strict=True), fetch_telemetry(self.dht, self.run_id))

    def merge(self, status: Dict[str, Any], telemetry: Dict[str, Any]) -> None:
        """Take one read: ``status`` as ``read_status`` gives it, ``telemetry`` as ``fetch_telemetry`` does."""
        with self._lock:
            self._status = status
            self._telemetry.update(telemetry)  # a peer's last record stays, for as long as the peer is listed
            now = time.monotonic()
            for peer in status["peers"]:
                self._last_peers[peer["peer_id"]] = dict(peer, seen_at=now)
            for peer_id, record in telemetry.items():
                losses = self._losses.setdefault(peer_id, {})
                losses.update({p.local_step: (p.local_step, p.loss, p.time) for p in record.losses})
                evals = self._evals.setdefault(peer_id, {})
                evals.update({p.local_step: (p.local_step, p.loss, p.time) for p in record.evals})
                for points in (losses, evals):
                    for step in sorted(points)[:-MAX_POINTS_PER_PEER]:
                        del points[step]
                for r in record.rounds:
                    self._rounds[(peer_id, r.outer_step, r.finished_at)] = dict(
                        peer_id=peer_id, outer_step=r.outer_step, finished_at=r.finished_at,
                        group_size=r.group_size, seconds=_number(r.seconds), matchmaking_s=_number(r.matchmaking_s),
                        allreduce_s=_number(r.allreduce_s), bytes_sent=r.bytes_sent,
                        bytes_received=r.bytes_received, averaged=r.averaged, caught_up=r.caught_up)
            for key in sorted(self._rounds, key=lambda k: self._rounds[k]["finished_at"])[:-MAX_ROUNDS]:
                del self._rounds[key]
            for peer_id in [p for p, seen in self._last_peers.items() if now - seen["seen_at"] > STALE_KEEP_S]:
                del self._last_peers[peer_id]
                self._telemetry.pop(peer_id, None)
            self.updated_at = time.time()
            self.looks += 1

    # ----------------------------------------------------------------------------------------------- answers

    def status(self) -> Dict[str, Any]:
        """``status --json``'s object over the live peers as this view holds them: the peers of recent reads whose
        records are fresh, not only those of the last read (which under load can miss some or all of them)."""
        with self._lock:
            now = time.time()
            peers = [{k: v for k, v in seen.items() if k != "seen_at"} for _, seen in sorted(self._last_peers.items())
                     if now - seen["last_seen"] <= STALE_AFTER_S]
            return dict(run_id=self.run_id, peers=peers, public_peers=sum(p["mode"] == "public" for p in peers),
                        coverage=self._status["coverage"])

    def snapshot(self) -> Dict[str, Any]:
        """The dashboard's JSON (docs/observability.md, "The dashboard": /api/swarm)."""
        with self._lock:
            now = time.time()
            # live: refreshed recently, whether or not the last read had its record (a DHT lookup under load can
            # come back without some or all of a key's subkeys: that must not make a live swarm look empty)
            live = {p for p, seen in self._last_peers.items() if now - seen["last_seen"] <= STALE_AFTER_S}
            peers = []
            for peer_id, seen in sorted(self._last_peers.items()):
                record = self._telemetry.get(peer_id)
                losses = sorted(self._losses.get(peer_id, {}).values())
                evals = sorted(self._evals.get(peer_id, {}).values())
                last_round = record.rounds[-1] if record is not None and record.rounds else None
                peers.append(dict(
                    {k: v for k, v in seen.items() if k != "seen_at"},
                    stale=peer_id not in live,
                    # from the samples/s shown beside it (every sample is one block of tokens): the telemetry's own
                    # figure is taken at another moment, and the two disagreed 27-fold on one worker
                    tokens_per_s=_tokens_per_s(seen, record),
                    data_position=[record.data_epoch, record.data_sample] if record is not None else None,
                    loss=_number(losses[-1][1]) if losses else None,
                    eval_loss=_number(evals[-1][1]) if evals else None,
                    banned=list(record.banned) if record is not None else [],
                    states_served=record.states_served if record is not None else None,
                    states_taken=record.states_taken if record is not None else None,
                    last_sync=None if last_round is None else dict(
                        outer_step=last_round.outer_step, finished_at=last_round.finished_at,
                        group_size=last_round.group_size, seconds=_number(last_round.seconds),
                        bytes_sent=last_round.bytes_sent, bytes_received=last_round.bytes_received,
                        averaged=last_round.averaged),
                ))
            return dict(
                run_id=self.run_id, updated_at=self.updated_at, private=self.private,
                public_peers=sum(p["mode"] == "public" and not p["stale"] for p in peers),
                coverage=self._status["coverage"], peers=peers,
                losses={p: [[s, _number(v), t] for s, v, t in sorted(points.values())]
                        for p, points in self._losses.items()},
                evals={p: [[s, _number(v), t] for s, v, t in sorted(points.values())]
                       for p, points in self._evals.items()},
                rounds=sorted(self._rounds.values(), key=lambda r: r["finished_at"]),
                warnings=self._warnings(peers),
            )

    def _warnings(self, peers: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
        warnings = []
        live = [p for p in peers if not p["stale"]]
        if not live:
            warnings.append(dict(kind="no_peers", message=f"no live peer in run {self.run_id!r}"
                                 + (" (a private run: only holders of its swarm key see it)" if self.private else "")))
        for p in peers:
            if p["stale"]:
                age = max(0.0, time.time() - p["last_seen"])
                warnings.append(dict(kind="stale_peer", peer_id=p["peer_id"],
                                     message=f"peer {_short(p['peer_id'])} last seen {age:.0f} s ago"))
        top = max((p["outer_step"] for p in live), default=0)
        for p in live:
            if p["outer_step"] < top - 1:
                warnings.append(dict(kind="behind", peer_id=p["peer_id"],
                                     message=f"peer {_short(p['peer_id'])} is at outer step {p['outer_step']}, the "
                                             f"swarm at {top}: it takes the swarm's state at its next step"))
        excluded: Dict[str, List[str]] = {}
        for p in live:
            for banned in p["banned"]:
                excluded.setdefault(banned, []).append(p["peer_id"])
        for banned, by in sorted(excluded.items()):
            warnings.append(dict(kind="banned_peer", peer_id=banned,
                                 message=f"peer {_short(banned)} is excluded for misbehaving by "
                                         f"{', '.join(_short(b) for b in by)}"))
        public = sum(p["mode"] == "public" for p in live)
        clients = sum(p["mode"] == "client" for p in live)  # relayed peers reach each other through the relays
        if clients and public == 0:
            warnings.append(dict(kind="few_public_peers",
                                 message=f"no public peer: the {clients} client-mode peer(s) (behind NAT) cannot "
                                         "form a group; a peer with a reachable address must join"))
        elif clients and public == 1:
            warnings.append(dict(kind="few_public_peers",
                                 message=f"only one public peer: if it leaves, the {clients} client-mode peer(s) "
                                         "cannot average"))
        return warnings
