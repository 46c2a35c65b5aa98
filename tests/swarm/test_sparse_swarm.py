"""--compression sparse against real hivemind peers on 127.0.0.1 (each DHT and averager its own process): the
all-gather of 2-bit top-k messages leaves every member with bit-identical global parameters, equal to SparseLoCo's
math in one process, and the error-feedback accumulator is each peer's own (a newcomer starts from zeros; a
checkpoint keeps it)."""

from __future__ import annotations

import asyncio
import logging
import signal
from functools import partial

import hivemind
import pytest
import torch
from hivemind.p2p import P2P

from p2ptrain.proto.p2ptrain_pb2 import SparsePiece

from p2ptrain import DiLoCoOptimizer
from p2ptrain.averaging.sparse import Layout, accumulate_, send_
from p2ptrain.averaging.sparse_round import average_messages
from tests.helpers import exit_code, report, start_bootstrap, start_worker, stop_all
from tests.swarm.test_diloco_exact import INNER, batches, make_model, train_peers
from tests.swarm.test_streaming import assert_matches_reference

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

SPARSE_OUTER = partial(torch.optim.SGD, lr=1.0, momentum=0.0)
K = 8  # of 4096: the test model's tensors are runs of at most 1024 values, so a chunk keeps 2-8 of them
DECAY = 0.95


@pytest.fixture
def three_dhts():
    first = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    others = [hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=first.get_visible_maddrs())
              for _ in range(2)]
    yield [first, *others]
    for dht in [*others, first]:
        dht.shutdown()


def sparse_reference(num_peers: int, *, local_steps: int, outer_steps: int):
    """The swarm in one process: each peer's AdamW on its own data, its accumulator (e <- decay e + g, its top-k
    message out of it), the per-entry mean of the messages, plain SGD at lr 1. The global parameters after each
    outer step, and each peer's accumulator at the end."""
    models = [make_model() for _ in range(num_peers)]
    inner = [INNER(model.parameters()) for model in models]
    data = [batches(i, [8] * (local_steps * outer_steps)) for i in range(num_peers)]
    global_params = [p.detach().clone() for p in models[0].parameters()]
    layout = Layout(tuple(tuple(g.shape) for g in global_params), k=K)
    accumulators = [[torch.zeros_like(g) for g in global_params] for _ in models]
    history = []
    for outer in range(outer_steps):
        messages = []
        for i, (model, opt) in enumerate(zip(models, inner)):
            for x, y in data[i][outer * local_steps:(outer + 1) * local_steps]:
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
            pseudo_gradient = [g - p.detach() for g, p in zip(global_params, model.parameters())]
            accumulate_(accumulators[i], pseudo_gradient, DECAY)
            message, _ = send_(accumulators[i], layout)
            messages.append(message)
        average = average_messages(messages, layout)
        with torch.no_grad():
            for g, a in zip(global_params, average):
                g.sub_(a)
            for model in models:
                for p, g in zip(model.parameters(), global_params):
                    p.copy_(g)
        history.append([g.clone() for g in global_params])
    return history, accumulators


def test_three_peers_end_every_sync_bit_identical_and_match_sparseloco_math(three_dhts):
    models, opts, snapshots = train_peers(three_dhts, adaptive_steps=False,
                                          compression="sparse", local_steps=4, outer_steps=3,
                                          run_id="sparse3", target_group_size=None, sparse_k=K, sparse_decay=DECAY,
                                          outer_optimizer=SPARSE_OUTER, min_group_size=3)
    try:
        for opt in opts:
            assert all(r.averaged and r.group_size == 3 for r in opt.history), opt.history
        for k in range(3):
            for a, b, c in zip(snapshots[0][k], snapshots[1][k], snapshots[2][k]):
                assert torch.equal(a, b) and torch.equal(a, c), f"parameters differ after sync {k + 1}"
        # the same math as in one process (the group's order of addition is the leader's, so equal up to rounding)
        expected, accumulators = sparse_reference(3, local_steps=4, outer_steps=3)
        for k in range(3):
            for got, want in zip(snapshots[0][k], expected[k]):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        # each peer keeps its own accumulator, which a checkpoint carries
        for opt, want in zip(opts, accumulators):
            saved = opt.state_dict()["sparse_accumulator"]
            for got, value in zip(saved, want):
                torch.testing.assert_close(got, value, rtol=1e-5, atol=1e-6)
        assert not all(torch.equal(a, b) for a, b in zip(opts[0]._accumulator, opts[1]._accumulator))
        # a sparse round moves (n - 1) messages each way per peer: a few percent of what fp16 would
        record = opts[0].history[-1]
        assert record.bytes_sent == 2 * opts[0].sparse_message_bytes, record
        assert record.bytes_received == sum(opt.sparse_message_bytes for opt in opts[1:]), record
        # against the fp16 butterfly's 2 (n - 1) / n x 2 bytes a value (k = 8 of 4096 here: about 0.2% of a value)
        fp16_butterfly = 2 * 2 / 3 * 2 * sum(g.numel() for g in opts[0].global_params)
        assert record.bytes_sent < 0.02 * fp16_butterfly, (record.bytes_sent, fp16_butterfly)
    finally:
        for opt in opts:
            opt.close()


def test_streaming_fragments_send_each_fragments_message_and_stay_bit_identical(three_dhts):
    """Three peers, three fragments, each launched one inner step before it is applied: each fragment's round is
    an all-gather of that fragment's sparse message (its own layout and size), every peer ends each phase with the
    same global bits, and every phase equals the one-process replay of Streaming DiLoCo with SparseLoCo's round."""
    local_steps, outer_steps = 6, 2
    models, opts, snapshots = train_peers(three_dhts, adaptive_steps=False,
                                          compression="sparse", local_steps=local_steps,
                                          outer_steps=outer_steps, run_id="sparse-stream", target_group_size=None,
                                          min_group_size=3, sparse_k=K, sparse_decay=DECAY,
                                          outer_optimizer=SPARSE_OUTER, fragments=3, overlap_steps=1,
                                          max_extra_steps=0)
    try:
        layouts = opts[0].averager.sparse_layouts
        assert len(layouts) == 3  # the model's chunks, each in one fragment's message
        assert sum(layout.num_chunks for layout in layouts) == opts[0].averager.sparse_layout.num_chunks
        assert [layout.shapes for layout in layouts] == [tuple(tuple(opts[0].global_params[i].shape) for i in f)
                                                         for f in opts[0].plan.tensors]
        for opt in opts:
            assert opt.outer_step == outer_steps and len(opt.history) == outer_steps
            for record in opt.history:
                assert [r["fragment"] for r in record.fragments] == [0, 1, 2], record.fragments
                for r, layout in zip(record.fragments, layouts):
                    assert r["averaged"] and r["group_size"] == 3, r
                    # (n - 1) messages of this fragment each way: a part of the model's message, not all of it
                    for way in ("bytes_sent", "bytes_received"):
                        assert 2 * layout.min_message_bytes <= r[way] <= 2 * layout.max_message_bytes, (r, layout)
        for a, b, c in zip(*(opt.global_params for opt in opts)):
            assert torch.equal(a, b) and torch.equal(a, c)
        assert len({tuple(r.digest for r in opt.history) for opt in opts}) == 1
        assert_matches_reference(opts, snapshots, outer_steps, "sparse", outer_optimizer=SPARSE_OUTER,
                                 sparse=(K, DECAY))
    finally:
        for opt in opts:
            opt.close()


def test_malformed_sparse_pieces_are_refused_and_their_sender_excluded_with_a_logged_reason(three_dhts, tmp_path):
    """Hand-made pieces from fresh p2pd peers to a real averager (two fragments): a sound piece is taken; a piece
    naming no fragment, empty, of a piece count no message of its fragment takes, or of a fragment other than its sender's earlier pieces of the
    group is refused, its sender excluded, and the averager process logs why."""
    dht = three_dhts[0]
    # the averager process's log, to a file (the handler is inherited when it forks)
    handler = logging.FileHandler(tmp_path / "averager.log")
    averager_logger = logging.getLogger("p2ptrain.averaging.averager")
    averager_logger.addHandler(handler)
    opt = DiLoCoOptimizer(make_model().parameters(), dht=dht, run_id="sparse-pieces", local_steps=4,
                          inner_optimizer=INNER, outer_optimizer=SPARSE_OUTER, compression="sparse", sparse_k=K,
                          fragments=2, matchmaking_time_s=3.0).start()
    averager = opt.averager
    small = averager.sparse_layouts[1].max_message_bytes
    assert small < 2 ** 20  # one piece each

    def piece(fragment=1, size=small, pieces=1, group=b"g1", index=0):
        return SparsePiece(group_id=group, index=index, pieces=pieces, fragment=fragment, data=bytes(size))

    def send(*pieces):
        """The acks of ``pieces``, sent in order by one fresh peer, and its id."""
        async def exchange():
            p2p = await P2P.create(initial_peers=dht.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"])
            try:
                stub = type(averager).get_stub(p2p, averager.peer_id, namespace=averager.prefix)
                return [(await stub.rpc_sparse_piece(p)).accepted for p in pieces], p2p.peer_id.to_base58()
            finally:
                await p2p.shutdown()
        return asyncio.run(exchange())

    try:
        acks, sound = send(piece(), piece(group=b"g2", fragment=0, size=averager.sparse_layouts[0].max_message_bytes))
        assert acks == [True, True]  # a group this peer does not know yet may be forming: its pieces are kept
        bad = {"no such fragment": (piece(fragment=2), "it sent a sparse piece of fragment 2, of 2"),
               "empty": (piece(size=0), "it sent a sparse piece that does not fit the message"),
               "wrong count": (piece(pieces=2), "it sent a sparse piece that does not fit the message")}
        senders = {}
        for name, (p, reason) in bad.items():
            acks, senders[name] = send(p, piece(group=b"g3"))
            assert acks == [False, False], name  # refused, then excluded: a sound piece after it is refused too
        acks, senders["two fragments"] = send(piece(fragment=0, size=averager.sparse_layouts[0].max_message_bytes),
                                              piece(fragment=1))
        assert acks == [True, False]
        assert averager.bans_total == 4 and set(averager.banned_peers) == set(senders.values())
        assert sound not in averager.banned_peers
        log = (tmp_path / "averager.log").read_text()
        for name, (_, reason) in bad.items():
            assert f"excluding peer {senders[name]} from this run" in log and reason in log, (name, log[-3000:])
        assert f"excluding peer {senders['two fragments']}" in log
        assert "it sent pieces of fragment 1 after pieces of fragment 0 for one group" in log
    finally:
        opt.close()
        averager_logger.removeHandler(handler)
        handler.close()


def test_a_checkpoint_restores_the_accumulator_and_a_newcomer_starts_from_zeros(three_dhts):
    first, second, newcomer_dht = three_dhts
    models, opts, _ = train_peers([first, second], adaptive_steps=False,
                                  compression="sparse", local_steps=3, outer_steps=2,
                                  run_id="sparse-join", target_group_size=None, sparse_k=K,
                                  outer_optimizer=SPARSE_OUTER)
    try:
        saved = opts[0].state_dict()
        assert any(e.abs().sum() > 0 for e in saved["sparse_accumulator"])
        model = make_model(seed=5)
        newcomer = DiLoCoOptimizer(model.parameters(), dht=newcomer_dht, run_id="sparse-join", local_steps=3,
                                   inner_optimizer=INNER, outer_optimizer=SPARSE_OUTER, compression="sparse",
                                   sparse_k=K, matchmaking_time_s=3.0).start()
        try:
            assert newcomer.load_state_from_peers(timeout_s=30)
            assert newcomer.outer_step == 2
            for mine, theirs in zip(newcomer.global_params, opts[0].global_params):
                assert torch.equal(mine, theirs)
            # the accumulator is not part of the shared state
            assert all(not e.any() for e in newcomer._accumulator)
            newcomer.load_state_dict(saved)
            for mine, theirs in zip(newcomer._accumulator, saved["sparse_accumulator"]):
                assert torch.equal(mine, theirs)
        finally:
            newcomer.close()
    finally:
        for opt in opts:
            opt.close()


@pytest.mark.slow  # about a minute on 2 cores (4 daemons): `make test-slow` (CI runs it)
def test_a_worker_killed_mid_round_leaves_the_others_on_one_model(tmp_path):
    """Three `join` workers with --compression sparse; worker 2 dies in the round that starts from outer step 2,
    after delivering its message to one member only: that member may commit the round, the other cannot (it misses
    a message), and must take its state rather than apply anything else. The survivors go on averaging together
    and hold the same digest at every outer step both committed."""
    args = ["--compression", "sparse", "--local-steps", "15", "--until-outer-step", "7", "--num-shards", "3",
            "--matchmaking-time", "2", "--averaging-timeout", "10", "--no-group-policy", "wait",
            "--wait-for-peers", "3", "--log-interval", "5"]
    boot, maddr = start_bootstrap(tmp_path)
    procs = {i: start_worker(tmp_path, i, maddr, "sparse-chaos", *args, "--shard-index", str(i),
                             env={"P2PTRAIN_FAULT": "kill-mid-allreduce@2:1"} if i == 2 else None)
             for i in range(3)}
    try:
        procs[2].wait(timeout=200)
        log = (tmp_path / "w2.log").read_text()
        assert procs[2].returncode == -signal.SIGKILL, log[-3000:]
        assert "fault injection: dying mid-all-reduce after sending its sparse message to 1 member(s)" in log
        for i in (0, 1):
            assert exit_code(procs[i], 200, tmp_path / f"w{i}.log") == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]
    finally:
        stop_all([*procs.values(), boot])
    reports = [report(tmp_path, i) for i in (0, 1)]
    for r in reports:
        assert r["outer_steps"] == 7 and r["final_eval_loss"] < r["initial_eval_loss"], r
        # no solo step: a survivor either averaged or took the state
        assert all(x["averaged"] or x["caught_up"] for x in r["rounds"]), r["rounds"]
        # the rounds before the death held all three, the ones after it the two survivors
        assert [x["group_size"] for x in r["rounds"] if x["outer_step"] <= 2] == [3, 3], r["rounds"]
        assert any(x["averaged"] and x["group_size"] == 2 and not x["caught_up"] for x in r["rounds"]), r["rounds"]
    digests = [{x["outer_step"]: x["digest"] for x in r["rounds"]} for r in reports]
    assert all(digests[0][s] == digests[1][s] for s in digests[0].keys() & digests[1].keys()), digests
    assert reports[0]["rounds"][-1]["digest"] == reports[1]["rounds"][-1]["digest"]
