"""Progress records from other peers: sound ones parse, everything else is skipped without raising."""

from __future__ import annotations

import logging

from hivemind.p2p import PeerID
from hivemind.utils import ValueWithExpiration

from p2ptrain.proto.p2ptrain_pb2 import PeerProgress
from p2ptrain.swarm.progress import parse_progress

PEER = PeerID.from_base58("QmSXUVsMGJFQBswMvF8D8Fmqy9QgjPzgfoqk3FUZv6ginu")
OTHER = PeerID.from_base58("QmTBBeeh2fDMz4PhTQGW9LthuufSNBV1ZigeB9TvTYXJW4")


def entry(record: PeerProgress | bytes) -> ValueWithExpiration:
    value = record if isinstance(record, bytes) else record.SerializeToString()
    return ValueWithExpiration(value, 1e12)


def good() -> PeerProgress:
    return PeerProgress(run_id="r", peer_id=PEER.to_base58(), outer_step=3, local_step=60, samples_per_s=12.5,
                        timestamp=1.7e9, shard_index=2)


def test_sound_record_parses():
    record = parse_progress(PEER.to_bytes(), entry(good()), "r")
    assert record is not None and record.outer_step == 3 and record.shard_index == 2


def test_bad_records_are_skipped_and_logged(caplog):
    caplog.set_level(logging.WARNING)
    wrong_run = good()
    wrong_run.run_id = "other"
    impossible = good()
    impossible.samples_per_s = float("nan")
    cases = [
        (PEER.to_bytes(), entry(b"\xff\xff\xff garbage")),  # does not parse
        (OTHER.to_bytes(), entry(good())),  # stored under another peer's subkey
        (b"not a peer id", entry(good())),
        (PEER.to_bytes(), entry(wrong_run)),
        (PEER.to_bytes(), entry(impossible)),
        (PEER.to_bytes(), "not a ValueWithExpiration"),
        (PEER.to_bytes(), ValueWithExpiration(12345, 1e12)),
    ]
    for subkey, value in cases:
        assert parse_progress(subkey, value, "r") is None
    assert len(caplog.records) == len(cases)


def test_withdrawn_record_is_silent(caplog):
    caplog.set_level(logging.WARNING)
    assert parse_progress(PEER.to_bytes(), entry(b""), "r") is None
    assert not caplog.records
