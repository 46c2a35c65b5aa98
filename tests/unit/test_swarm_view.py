"""The dashboard's view of a swarm, fed reads by hand: history kept past a record's window, peers that leave shown
stale, and the warnings an operator acts on."""

from __future__ import annotations

import json
import time

from p2ptrain.observe.swarm_view import SwarmView
from p2ptrain.observe.telemetry import MAX_LOSSES, TelemetryPublisher

A, B, C = "QmPeerAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaA", "QmPeerBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbB", \
    "QmPeerCcccccccccccccccccccccccccccccccccccccccccC"


def status(*peers: dict) -> dict:
    return dict(run_id="r", peers=list(peers), public_peers=sum(p["mode"] == "public" for p in peers), coverage=None)


def peer(peer_id: str, outer_step: int = 3, mode: str = "public", age_s: float = 1.0) -> dict:
    return dict(peer_id=peer_id, outer_step=outer_step, local_step=10 * outer_step, samples_per_s=5.0,
                last_seen=time.time() - age_s, mode=mode, reachability="", shard=0, shard_passes=0.0)


def telemetry(peer_id: str, first_step: int, steps: int, *, banned=(), rounds=()):
    publisher = TelemetryPublisher(dht=None, run_id="r")
    for step in range(first_step, first_step + steps):
        publisher._last_loss_at = -1e9  # one point a step here: the publisher keeps one a second
        publisher.add_loss(step, 5.0 - step / 1000)
    for outer_step in rounds:
        publisher.add_round(dict(outer_step=outer_step, finished_at=1000.0 + outer_step, group_size=2, seconds=0.5,
                                 phases={"matchmaking": 0.1}, allreduce_s=0.3, bytes_sent=10, bytes_received=10,
                                 averaged=True, eval_loss=4.0, local_step=10 * outer_step, data_position=[0, 7]))
    publisher.banned = list(banned)
    return publisher.record(peer_id, time.time())


def kinds(snapshot: dict) -> list:
    return sorted(w["kind"] for w in snapshot["warnings"])


def test_the_history_outlasts_a_records_window_and_the_json_has_no_nan():
    view = SwarmView(dht=None, run_id="r", private=False)
    view.merge(status(peer(A), peer(B)), {A: telemetry(A, 0, MAX_LOSSES, rounds=[1, 2])})
    view.merge(status(peer(A), peer(B)), {A: telemetry(A, MAX_LOSSES, MAX_LOSSES, rounds=[2, 3])})
    snapshot = view.snapshot()
    assert [p[0] for p in snapshot["losses"][A]] == list(range(2 * MAX_LOSSES))
    assert [(r["peer_id"], r["outer_step"]) for r in snapshot["rounds"]] == [(A, 1), (A, 2), (A, 3)]
    a = next(p for p in snapshot["peers"] if p["peer_id"] == A)
    assert a["last_sync"]["outer_step"] == 3 and a["eval_loss"] == 4.0 and a["data_position"] == [0, 7]
    assert next(p for p in snapshot["peers"] if p["peer_id"] == B)["last_sync"] is None
    assert kinds(snapshot) == []
    json.dumps(snapshot, allow_nan=False)


def test_a_peer_that_left_is_stale_and_one_behind_is_named():
    view = SwarmView(dht=None, run_id="r", private=False)
    view.merge(status(peer(A, 5), peer(B, 5), peer(C, 3)), {})
    assert kinds(view.snapshot()) == ["behind"]
    view.merge(status(peer(A, 5), peer(C, 5)), {})  # B's record, 1 s old, missing from a read: not gone yet
    assert not any(p["stale"] for p in view.snapshot()["peers"]) and view.snapshot()["public_peers"] == 3
    assert [p["peer_id"] for p in view.status()["peers"]] == [A, B, C] and view.status()["public_peers"] == 3
    view.merge(status(peer(A, 5), peer(B, 5, age_s=30), peer(C, 5)), {})  # its last record, then none
    view.merge(status(peer(A, 5), peer(C, 5)), {})
    snapshot = view.snapshot()
    assert {p["peer_id"]: p["stale"] for p in snapshot["peers"]} == {A: False, B: True, C: False}
    assert [w["peer_id"] for w in snapshot["warnings"] if w["kind"] == "stale_peer"] == [B]


def test_an_excluded_peer_and_too_few_public_peers_are_warned_about():
    view = SwarmView(dht=None, run_id="r", private=True)
    view.merge(status(peer(A), peer(B, mode="client"), peer(C, mode="client")), {A: telemetry(A, 0, 1, banned=[C])})
    snapshot = view.snapshot()
    assert kinds(snapshot) == ["banned_peer", "few_public_peers"]
    banned = next(w for w in snapshot["warnings"] if w["kind"] == "banned_peer")
    assert banned["peer_id"] == C and A[-8:] in banned["message"]
    view.merge(status(peer(A, age_s=30), peer(B, mode="client"), peer(C, mode="client", age_s=30)), {})
    assert "no public peer" in next(w["message"] for w in view.snapshot()["warnings"] if w["kind"] == "few_public_peers")


def test_an_empty_run_says_so():
    view = SwarmView(dht=None, run_id="r", private=True)
    view.merge(status(), {})
    snapshot = view.snapshot()
    assert snapshot["peers"] == [] and kinds(snapshot) == ["no_peers"] and snapshot["private"] is True
    assert "swarm key" in snapshot["warnings"][0]["message"]
