"""--compression sparse against real hivemind peers on 127.0.0.1 (each DHT and averager its own process): the
all-gather of 2-bit top-k messages leaves every member with bit-identical global parameters, equal to SparseLoCo's
math in one process, and the error-feedback accumulator is each peer's own (a newcomer starts from zeros; a
checkpoint keeps it)."""

from __future__ import annotations

import signal
from functools import partial

import hivemind
import pytest
import torch

from p2ptrain import DiLoCoOptimizer
from p2ptrain.averaging.sparse import Layout, accumulate_, send_
from p2ptrain.averaging.sparse_round import average_messages
from tests.helpers import exit_code, report, start_bootstrap, start_worker, stop_all
from tests.swarm.test_diloco_exact import INNER, batches, make_model, train_peers

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
    models, opts, snapshots = train_peers(three_dhts, compression="sparse", local_steps=4, outer_steps=3,
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
        message = opts[0].averager.sparse_layout.message_bytes
        assert record.bytes_sent == 2 * message and record.bytes_received == 2 * message, record
    finally:
        for opt in opts:
            opt.close()


def test_a_checkpoint_restores_the_accumulator_and_a_newcomer_starts_from_zeros(three_dhts):
    first, second, newcomer_dht = three_dhts
    models, opts, _ = train_peers([first, second], compression="sparse", local_steps=3, outer_steps=2,
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
