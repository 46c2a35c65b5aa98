"""Every kind of record p2ptrain stores in the DHT stays under RECORD_MAX_BYTES at its largest (swarm/pipe.py says
why the bound is where it is): progress, shard cursor, telemetry and evidence records. The other DHT values p2ptrain
relies on are hivemind's own (matchmaking declarations and state donors: a float per peer)."""

from __future__ import annotations

import hashlib

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.compression import CompressionInfo
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2

from p2ptrain.averaging.audit import commitment, make_receipt
from p2ptrain.averaging.compression import get_compression
from p2ptrain.averaging.evidence import (MAX_ITEMS, AverageSigner, evidence_record, judge, signed_average,
                                         signed_by_reducer, summary)
from p2ptrain.config_checks import MAX_RUN_ID_CHARS
from p2ptrain.observe.telemetry import (MAX_BANNED, MAX_EVALS, MAX_LOSSES, MAX_ROUNDS, TelemetryPublisher,
                                        parse_telemetry)
from p2ptrain.proto import p2ptrain_pb2
from p2ptrain.security import PeerSignatureValidator, peer_id_of
from p2ptrain.swarm.pipe import RECORD_MAX_BYTES
from p2ptrain.swarm.progress import MAX_LEFT_SHARDS, TEXT_MAX_CHARS, ProgressPublisher, check_run_settings
from p2ptrain.swarm.shards import publish_cursor

RUN = "r" * MAX_RUN_ID_CHARS
BIG = 2 ** 64 - 1
CODEC = get_compression("fp16")


class Recorder:
    """Stands in for the DHT handle whose store calls are measured here (no network: the sizes are the point)."""

    def __init__(self):
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        self.identity = PeerSignatureValidator(key)
        self.peer_id = peer_id_of(self.identity._public_der)
        self.stored = []

    def store(self, key, value, expiration_time, subkey=None, return_future=False):
        self.stored.append(value)
        return None


@pytest.fixture(scope="module")
def dht():
    return Recorder()


def test_the_largest_progress_record_fits(dht):
    publisher = ProgressPublisher(dht, RUN, client_mode=True)
    publisher._heartbeat_stop.set()  # no heartbeat thread: one record, measured
    publisher.shard_index = 2 ** 32 - 1
    publisher.left_shards = tuple(range(2 ** 32 - 2 * MAX_LEFT_SHARDS, 2 ** 32))
    publisher.reachability = "client: " + "a peer could not connect back; " * 200
    long = "x" * 5000
    publisher.settings = dict(model=long, n_layer=2 ** 32 - 1, n_embd=2 ** 32 - 1, n_head=2 ** 32 - 1,
                              block_size=2 ** 32 - 1, vocab_size=2 ** 32 - 1, num_parameters=BIG,
                              num_tensors=2 ** 32 - 1, params_schema="f" * 16, seed=-2 ** 63, data=long,
                              batch_size=2 ** 32 - 1, threads=2 ** 32 - 1, sync_schedule=long, local_steps=2 ** 32 - 1,
                              compression="fp16", protocol=2 ** 32 - 1)
    publisher.publish(outer_step=BIG, local_step=BIG, samples_per_s=1e300, samples_since_sync=BIG, step_s=1e300)
    record = p2ptrain_pb2.PeerProgress.FromString(dht.stored[-1])
    assert len(dht.stored[-1]) <= RECORD_MAX_BYTES, len(dht.stored[-1])
    assert len(record.model) == len(record.data) == len(record.reachability) == TEXT_MAX_CHARS
    assert list(record.left_shards) == list(publisher.left_shards[-MAX_LEFT_SHARDS:])
    # a newcomer with that long model name is compared as the records carry it: the same model
    mine = dict(publisher.settings)
    check_run_settings(mine, [record], RUN)


def test_the_largest_shard_cursor_fits(dht):
    state = dict(shard_index=2 ** 32 - 1, num_shards=2 ** 32 - 1, samples_per_epoch=BIG, seed=BIG,
                 block_size=2 ** 32 - 1, epoch=BIG, position=BIG)
    publish_cursor(dht, RUN, state, outer_step=BIG)
    assert len(dht.stored[-1]) <= RECORD_MAX_BYTES, len(dht.stored[-1])


def test_the_largest_telemetry_record_fits_and_keeps_its_newest_points(dht):
    publisher = TelemetryPublisher(dht, RUN)
    for step in range(MAX_LOSSES):
        publisher.losses.append(p2ptrain_pb2.LossPoint(local_step=BIG - step, loss=1.5, time=1e9 + step))
    for step in range(MAX_EVALS):
        publisher.evals.append(p2ptrain_pb2.LossPoint(local_step=BIG - step, loss=1.5, time=1e9 + step))
    for step in range(MAX_ROUNDS):
        publisher.rounds.append(p2ptrain_pb2.RoundPoint(
            outer_step=BIG - step, finished_at=1e9 + step, group_size=2 ** 32 - 1, seconds=1.5, matchmaking_s=1.5,
            allreduce_s=1.5, bytes_sent=BIG, bytes_received=BIG, averaged=True, caught_up=True))
    publisher.banned = [str(dht.peer_id)] * MAX_BANNED
    publisher.tokens_per_s, publisher.data_position = 1e300, (BIG, BIG)
    whole = publisher._whole_record(str(dht.peer_id), 1e9)
    assert whole.ByteSize() > RECORD_MAX_BYTES  # the windows at their limits do not fit: the record drops points
    publisher.publish()
    value = dht.stored[-1]
    assert len(value) <= RECORD_MAX_BYTES, len(value)
    record = parse_telemetry(value, RUN, str(dht.peer_id))
    assert record is not None and record.losses[-1] == whole.losses[-1] and record.rounds[-1] == whole.rounds[-1]
    # a record that fits is stored whole
    small = TelemetryPublisher(dht, RUN)
    small.losses.append(p2ptrain_pb2.LossPoint(local_step=1, loss=1.0, time=1.0))
    assert small.record(str(dht.peer_id), 1.0) == small._whole_record(str(dht.peer_id), 1.0)


def signed_item(signer: AverageSigner, values: int, senders: int, inputs: int = 0) -> bytes:
    """An accuser's whole item: a reducer's signed average of ``values`` fp16 values with a receipt of ``senders``,
    carrying ``inputs`` of the senders' parts as an audit's proof."""
    average = torch.full((values,), float("nan"))
    tensor = CODEC.compress(average, CompressionInfo.from_tensor(average))
    parts = [tensor.SerializeToString()] * inputs
    receipt = make_receipt([(commitment(tensor), 1.0)] * senders, float("inf"), "mean")
    group_id = hashlib.sha256(b"group").digest()
    answer = averaging_pb2.AveragingData(tensor_part=tensor, peer_id=signer.sign(group_id, 2 ** 31, receipt, tensor))
    return signed_average(peer_id_of(signer.public_der), group_id, 2 ** 31, answer, "x" * 1000, parts)


@pytest.mark.parametrize("values, senders, inputs", [(256 * 1024, 256, 0), (64 * 1024, 64, 3), (8, 2, 0)],
                         ids=["512KiB-average", "256KiB-with-its-proof", "tiny"])
def test_the_largest_evidence_record_fits_and_names_what_its_accuser_serves(dht, values, senders, inputs):
    signer = AverageSigner(dht.identity)
    items = [signed_item(signer, values, senders, inputs) for _ in range(MAX_ITEMS)]
    record = evidence_record(items)
    assert len(record) <= RECORD_MAX_BYTES, len(record)
    stored = p2ptrain_pb2.Evidence.FromString(record).items
    assert len(stored) == MAX_ITEMS
    for whole, item in zip(items, stored):
        if item.item_digest:  # a summary: what it accuses is readable, the rest is fetched by its digest
            assert item.item_digest == hashlib.sha256(whole).digest() and item == summary(whole)
            assert not item.average and not item.signature and not signed_by_reducer(item)
            assert item.reducer == peer_id_of(signer.public_der).to_bytes()
        else:  # whole, and a proof on its own
            assert item.SerializeToString() == whole and "NaN" in judge(item, CODEC, None, None)
    summarized = [bool(item.item_digest) for item in stored]
    # small items go whole; large ones as summaries, the most recent kept whole first where one fits
    assert summarized == ([False] * MAX_ITEMS if values == 8 else [True] * MAX_ITEMS)


def test_an_evidence_record_keeps_the_most_recent_items_whole_first(dht):
    signer = AverageSigner(dht.identity)
    small = signed_item(signer, 700, 3)  # about 2 KB: three fit beside a summary, not four
    items = [small] * MAX_ITEMS
    stored = p2ptrain_pb2.Evidence.FromString(evidence_record(items)).items
    assert [bool(item.item_digest) for item in stored] == [True, False, False, False]
    assert PeerID(stored[0].reducer) == peer_id_of(signer.public_der)
