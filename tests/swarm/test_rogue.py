"""A private swarm of two honest DiLoCo peers against a rogue peer written with plain hivemind.

The rogue does not go through p2ptrain's averaging code: it is a hivemind ``DHT`` and ``DecentralizedAverager``
(hivemind's own all-reduce and codecs, its parts framed for the honest peers' part stream) plus raw calls to the
honest peers' RPCs. Without the swarm key it tries to
write records, fetch the state, join a group and send a part; with the key (it then also implements the record
format, security.py) it averages NaN, Inf, huge or wrong-shaped tensors. The honest peers' parameters must end
exactly where two honest peers alone end.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import math
import os
import threading
import time
from functools import partial
from typing import Optional

import hivemind
import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.compression import Float16Compression
from hivemind.p2p import P2P
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

from p2ptrain import DiLoCoOptimizer
from p2ptrain.averaging import part_stream
from p2ptrain.averaging.allreduce import ExactAllReduceRunner
from p2ptrain.averaging.averager import PseudoGradientAverager as P2PTrainAverager
from p2ptrain.averaging.audit import MAX_PROOF_BYTES, Audits
from p2ptrain.averaging.part_stream import open_part_stream
from p2ptrain.averaging.reducer import Reducer
from p2ptrain.proto import p2ptrain_pb2
from p2ptrain.security import PeerSignatureValidator, SwarmAuth, SwarmKeyValidator, generate_swarm_key, load_identity
from p2ptrain.swarm.dht import FollowingDHT, SwarmConfig, start_dht, stop_dht
from p2ptrain.swarm.pipe import RECORD_MAX_BYTES
from p2ptrain.swarm.progress import ProgressPublisher, RunMismatch, fetch_progress, progress_key

pytestmark = [pytest.mark.swarm, pytest.mark.timeout(240)]

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
RUN = "private"
PREFIX = f"{RUN}_diloco"
LOCAL_STEPS, OUTER_STEPS = 3, 3
INNER = partial(torch.optim.AdamW, lr=1e-2)
OUTER = partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
SERVICER = "PseudoGradientAverager"  # the class whose RPCs the honest peers serve (hivemind names handlers by it)


class PartStreamStub:
    """What hivemind's runner calls ``rpc_aggregate_part`` on, sending over the honest peers' part stream: since
    protocol 10 they take parts only there (p2ptrain's framing; hivemind's all-reduce and codecs make the parts)."""

    def __init__(self, runner: "RogueRunner", peer) -> None:
        self._runner, self._peer = runner, peer

    async def rpc_aggregate_part(self, requests):
        runner = self._runner
        return await open_part_stream(runner._p2p, self._peer, runner._prefix, runner.group_id, requests, runner)


class RogueRunner(AllReduceRunner):
    bytes_sent = bytes_received = 0  # what the part stream counts

    def _get_peer_stub(self, peer):
        return PartStreamStub(self, peer)


class PseudoGradientAverager(DecentralizedAverager):
    """The rogue's averager: hivemind's, under the name hivemind's RPC handles carry on the honest peers, with its
    all-reduce's parts on the part stream (part_stream.py) both ways."""

    async def add_p2p_handlers(self, p2p, *args, **kwargs) -> None:
        await super().add_p2p_handlers(p2p, *args, **kwargs)
        await p2p.add_binary_stream_handler(part_stream.handler_name(self.prefix),
                                            partial(part_stream.serve_part_stream, self))

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        """hivemind's (1.1.12), with ``RogueRunner``."""
        group_id = group_info.group_id if group_id is None else group_id
        runner = RogueRunner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                             group_id=group_id, ordered_peer_ids=group_info.peer_ids, **kwargs)
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update, alpha=self._averaging_alpha)
                self.last_updated = get_dht_time()
                self._state_updated.set()


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def make_deeper_model() -> torch.nn.Module:
    """Three layers: whichever place a member takes in a group of 3, its range holds a part (hivemind gives a tensor
    smaller than a part to the member whose range overlaps it most: with ``make_model`` the middle one gets none)."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 4))


def make_wide_model() -> torch.nn.Module:
    """806K parameters: a group of 3 cuts each member's range into parts of up to 512 KiB of fp16 (a real model's
    size of part), whose signed averages are evidence too large for the DHT."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 768),
                               torch.nn.Tanh(), torch.nn.Linear(768, 4))


class _Fd2Handler(logging.Handler):
    """Writes to whatever file descriptor 2 is at the time (capfd's file, in this process and forked ones)."""

    def emit(self, record: logging.LogRecord) -> None:
        os.write(2, (self.format(record) + "\n").encode())


@pytest.fixture
def logs_to_stderr(capfd):
    """p2ptrain's warnings, in the averager and DHT processes too (forked after this), go to fd 2 for capfd."""
    handler = _Fd2Handler()
    handler.setLevel(logging.WARNING)
    logging.getLogger("p2ptrain").addHandler(handler)
    yield
    logging.getLogger("p2ptrain").removeHandler(handler)


@pytest.fixture(scope="module")
def swarm_key(tmp_path_factory):
    path = tmp_path_factory.mktemp("key") / "swarm.key"
    generate_swarm_key(path)
    return path


def honest_swarm(swarm_key, peers: int = 2):
    """Peers of a private swarm (two honest ones by default); returns their DHTs (the first one is the others'
    initial peer)."""
    first = start_dht(SwarmConfig(host_maddrs=[LOOPBACK], swarm_key_file=str(swarm_key)))
    return [first, *(start_dht(SwarmConfig(host_maddrs=[LOOPBACK], swarm_key_file=str(swarm_key),
                                           initial_peers=[str(m) for m in first.get_visible_maddrs()]))
                     for _ in range(peers - 1))]


TEACHER = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))


def learn_step(model: torch.nn.Module, opt: DiLoCoOptimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    """One inner step of a peer learning y from x."""
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def train(dhts, *, before_rounds=None, target_group_size: int = 2, model=make_model, aggregation: str = "mean",
          classes=(), teacher: bool = False, after_rounds=None, to_outer_step: bool = False):
    """Train one DiLoCoOptimizer per DHT, each in its own thread, on fixed data; returns the final parameters and
    the optimizers' histories. ``before_rounds`` runs once the optimizers exist (the attack), ``after_rounds`` once they trained, before
    they close (``to_outer_step``: each peer trains until it reaches the last outer step, not for a fixed
    number of steps); ``classes``: the
    optimizer class of the first peers (a rogue's), DiLoCoOptimizer for the rest. The targets are random, or with
    ``teacher`` one linear map of the inputs that every peer learns (their pseudo-gradients then agree, as those of
    peers learning one task from different samples do)."""
    models = [model() for _ in dhts]
    kinds = [*classes, *[DiLoCoOptimizer] * (len(dhts) - len(classes))]
    opts = [kind(model.parameters(), dht=dht, run_id=RUN, local_steps=LOCAL_STEPS, inner_optimizer=INNER,
                 outer_optimizer=OUTER, compression="fp16", matchmaking_time_s=2.0, averaging_timeout_s=6.0,
                 batch_size=8, target_group_size=target_group_size, no_group_policy="wait",
                 aggregation=aggregation).start()
            for kind, model, dht in zip(kinds, models, dhts)]
    errors = []

    def run(i):
        try:
            gen = torch.Generator().manual_seed(100 + i)
            for _ in range(LOCAL_STEPS * OUTER_STEPS * (4 if to_outer_step else 1)):
                if to_outer_step and opts[i].outer_step >= OUTER_STEPS:
                    break  # a peer that took the state skipped inner steps: it is done at the same outer step
                x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
                learn_step(models[i], opts[i], x, x @ TEACHER + 0.1 * y if teacher else y)
        except BaseException as e:
            errors.append(e)

    try:
        if before_rounds is not None:
            before_rounds(opts)
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(dhts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert not errors, errors
        assert not any(t.is_alive() for t in threads), "an honest peer hung"
        if after_rounds is not None:
            after_rounds(opts)
        return [[p.detach().clone() for p in m.parameters()] for m in models], [list(o.history) for o in opts]
    finally:
        for opt in opts:
            opt.close()


def run_alone(swarm_key, target_group_size: int, model=make_model):
    dhts = honest_swarm(swarm_key)
    try:
        return train(dhts, target_group_size=target_group_size, model=model)
    finally:
        for dht in dhts:
            stop_dht(dht)


@pytest.fixture(scope="module")
def alone(swarm_key):
    """The two honest peers without any rogue: what every attacked run must end with."""
    return run_alone(swarm_key, 2)


COSTS = {}
"""attack -> what it cost the honest peers against the same run without it (benchmarks/bench_attacks.py)"""


@pytest.fixture(scope="module", autouse=True)
def cost_report():
    yield
    path = os.environ.get("P2PTRAIN_ATTACK_REPORT")
    if path and COSTS:
        with open(path, "w") as f:
            json.dump(COSTS, f, indent=1)


def record_cost(attack: str, histories, reference, outcome: str) -> None:
    """Mean over the honest peers of their syncs' seconds and payload bytes (sent + received), against the run
    without the rogue (with the same target group size, so the same matchmaking waits)."""
    def per_peer(hists):
        seconds = sum(sum(r.seconds for r in h) for h in hists) / len(hists)
        payload = sum(sum(r.bytes_sent + r.bytes_received for r in h) for h in hists) / len(hists)
        return seconds, payload

    (seconds, payload), (ref_seconds, ref_payload) = per_peer(histories), per_peer(reference[1])
    COSTS[attack] = dict(outcome=outcome, sync_s=seconds, sync_s_alone=ref_seconds, extra_s=seconds - ref_seconds,
                         payload_bytes=payload, payload_bytes_alone=ref_payload, extra_bytes=payload - ref_payload,
                         rounds_s=[[round(r.seconds, 2) for r in h] for h in histories],
                         rounds_s_alone=[[round(r.seconds, 2) for r in h] for h in reference[1]])


def assert_same_as_alone(params, histories, alone, *, rogue_group_sizes=(2,)):
    """Bit-identical parameters to the run without the rogue, every round averaged. A rogue that holds the key may
    be in a group (counted in its size) whose honest members refuse every part it sends: the round completes
    without its contribution."""
    want, _ = alone
    for peer_params in params:
        for got, expected in zip(peer_params, want[0]):
            assert torch.equal(got, expected), "the rogue changed an honest peer's parameters"
    for history in histories:
        assert [r.outer_step for r in history if r.averaged] == list(range(1, OUTER_STEPS + 1)), history
        assert all(r.group_size in rogue_group_sizes for r in history), history


class ByteCount:
    bytes_sent = bytes_received = 0


async def first_answer_code(stream, outcome: Optional[dict] = None) -> list:
    """The code an honest peer answered a request with first (a list: empty if it hung up without one); then the rogue
    hangs up, as hivemind's own clients do on a refusal (the honest peer holds a refused stream open until then, so
    that p2pd delivers the answer). Hanging up before the rogue's end-of-stream marker is written makes hivemind's
    writing task raise BrokenPipeError (CI saw it once)."""
    codes = []
    try:
        async for msg in stream:
            codes.append(msg.code)
            break
        if outcome is not None:  # whether the peer held the stream open for a second after its answer
            try:
                await asyncio.wait_for(stream.__anext__(), 1.0)
                outcome["held_open"] = False  # another message
            except asyncio.TimeoutError:
                outcome["held_open"] = True
            except StopAsyncIteration:
                outcome["held_open"] = False  # it hung up
    except (BrokenPipeError, ConnectionResetError):
        pass
    finally:
        await stream.aclose()
    return codes


def test_a_peer_without_the_key_is_refused_everything(swarm_key, alone, capfd, logs_to_stderr):
    dhts = honest_swarm(swarm_key)
    rogue = hivemind.DHT(start=True, host_maddrs=[LOOPBACK], initial_peers=dhts[0].get_visible_maddrs())
    outcome = {}

    def attack(opts):
        honest = [dht.peer_id for dht in dhts]

        async def attacks():
            p2p: P2P = await rogue.replicate_p2p()
            # 1. join a group: a well-formed request with the right schema, straight to an honest peer
            request = averaging_pb2.JoinRequest(
                schema_hash=opts[0].averager.schema_hash, expiration=get_dht_time() + 5,
                gather=opts[0].averager.serializer.dumps([0.0, 0, opts[0].averager.serializer.dumps({})]),
                group_key=f"{PREFIX}.0b00000000")
            stream = await p2p.iterate_protobuf_handler(
                honest[0], f"{PREFIX}::{SERVICER}.rpc_join_group", request, averaging_pb2.MessageFromLeader)
            outcome["join"] = await first_answer_code(stream)
            # 2. send a part of an all-reduce: on the part stream (protocol 10), and over hivemind's protobuf RPC
            part = averaging_pb2.AveragingData(group_id=b"x" * 20, weight=1.0, tensor_part=runtime_pb2.Tensor())
            stream = await open_part_stream(p2p, honest[1], PREFIX, b"x" * 20, as_aiter(part), ByteCount())
            outcome["part"] = await first_answer_code(stream)
            stream = await p2p.iterate_protobuf_handler(
                honest[1], f"{PREFIX}::{SERVICER}.rpc_aggregate_part", part, averaging_pb2.AveragingData)
            outcome["part_rpc"] = await first_answer_code(stream, outcome)
            # 3. fetch the model: p2ptrain's chunked state transfer, and hivemind's own download
            outcome["info"] = await p2p.call_protobuf_handler(
                honest[0], f"{PREFIX}::{SERVICER}.rpc_state_info", p2ptrain_pb2.StateInfoRequest(),
                p2ptrain_pb2.StateInfo)
            outcome["chunk"] = await p2p.call_protobuf_handler(
                honest[0], f"{PREFIX}::{SERVICER}.rpc_state_chunk", p2ptrain_pb2.StateChunkRequest(index=0),
                p2ptrain_pb2.StateChunk)
            stream = await p2p.iterate_protobuf_handler(
                honest[0], f"{PREFIX}::{SERVICER}.rpc_download_state", averaging_pb2.DownloadRequest(),
                averaging_pb2.DownloadData)
            outcome["download"] = [msg async for msg in stream]
            # 5. announce a 1 TiB message on a stream and start sending it: the peer must hang up, not buffer it
            _, reader, writer = await p2p._client.stream_open(honest[1], (f"{PREFIX}::{SERVICER}.rpc_aggregate_part",))
            started = time.monotonic()
            try:
                writer.write(P2P.MESSAGE_MARKER + (2**40).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + bytes(2**20))
                await writer.drain()
                while await asyncio.wait_for(reader.read(2**16), 10):  # until the honest peer closes the stream
                    pass
            except (ConnectionResetError, BrokenPipeError):
                pass  # hung up on us
            outcome["hung_up_after_s"] = time.monotonic() - started
            writer.close()
            # ... and on the part stream: a hello with a 65,535-byte group id, then a 1 TiB frame
            _, reader, writer = await p2p.call_binary_stream_handler(honest[1], part_stream.handler_name(PREFIX))
            started = time.monotonic()
            try:
                writer.write(part_stream.HELLO.pack(part_stream.MAGIC, part_stream.STREAM_VERSION, 65535)
                             + part_stream.FRAME.pack(part_stream.MESSAGE, 0, 2**32 - 1) + bytes(2**20))
                await writer.drain()
                while await asyncio.wait_for(reader.read(2**16), 10):
                    pass
            except (ConnectionResetError, BrokenPipeError):
                pass
            outcome["stream_hung_up_after_s"] = time.monotonic() - started
            writer.close()

        asyncio.run(asyncio.wait_for(attacks(), 30))
        # 4. write records: its own progress, and one over an honest peer's
        fake = p2ptrain_pb2.PeerProgress(run_id=RUN, peer_id=rogue.peer_id.to_base58(), outer_step=10**6)
        for subkey in (rogue.peer_id.to_bytes(), honest[0].to_bytes()):
            rogue.store(progress_key(RUN), fake.SerializeToString(), get_dht_time() + 60, subkey=subkey)
        outcome["records"] = fetch_progress(dhts[1], RUN)

    try:
        params, histories = train(dhts, before_rounds=attack)
    finally:
        rogue.shutdown()
        for dht in dhts:
            stop_dht(dht)
    assert outcome["join"] == [averaging_pb2.PROTOCOL_VIOLATION]
    assert outcome["part"] == [averaging_pb2.BAD_GROUP_ID]
    assert outcome["part_rpc"] == [averaging_pb2.PROTOCOL_VIOLATION]  # protocol 9's way in is closed
    assert outcome["held_open"], "the refusal's stream must stay open until the sender hangs up (else p2pd may drop it)"
    assert outcome["stream_hung_up_after_s"] < 10
    assert not outcome["info"].available and not outcome["chunk"].available and outcome["download"] == []
    assert outcome["hung_up_after_s"] < 10
    assert sorted(r.peer_id for r in outcome["records"]) == sorted(d.peer_id.to_base58() for d in dhts)
    assert all(r.outer_step == 0 for r in outcome["records"])
    assert_same_as_alone(params, histories, alone)
    record_cost("no key: join, part, state, records, 1 TiB message", histories, alone, "all refused")
    logs = capfd.readouterr().err
    rogue_id = rogue.peer_id.to_base58()
    assert f"refused peer {rogue_id}'s request to join our group: it does not hold this swarm's key" in logs
    assert f"refused peer {rogue_id} our state: it does not hold the swarm key" in logs
    assert "refused a DHT record not tagged with this peer's swarm key" in logs
    assert f"refused peer {rogue_id}'s all-reduce stream: its hello announces a 65535-byte group id" in logs


POISONS = {
    "nan": lambda t: torch.full_like(t, float("nan")),
    "inf": lambda t: torch.full_like(t, float("inf")),
    "huge": lambda t: torch.full_like(t, 1e30),  # fp16 on the wire: hivemind clamps it to 65504
    "wrong_shape": lambda t: torch.zeros(t.numel() + 7),
}


# two rogues at once per test (keeps the suite short); the benchmark runs each poison alone, for its own cost
POISON_SETS = ([(name,) for name in sorted(POISONS)] if os.environ.get("P2PTRAIN_ATTACK_REPORT")
               # the first set over 15 s on 2 cores: `make test-slow` (CI runs it)
               else [pytest.param(("nan", "wrong_shape"), marks=pytest.mark.slow), ("huge", "inf")])


def start_rogue(swarm_key, dhts, path) -> tuple:
    """A DHT that holds the key and speaks the record format (security.py), and the rogue's admission token."""
    P2P.generate_identity(path)
    auth = SwarmAuth.from_key(bytes.fromhex(swarm_key.read_text()))
    identity = PeerSignatureValidator(load_identity(path))
    # p2ptrain's DHT class, not a plain hivemind.DHT: hivemind's averager on it would leave its client socket in /tmp
    dht = FollowingDHT(
        start=True, host_maddrs=[LOOPBACK], initial_peers=dhts[0].get_visible_maddrs(), identity_path=path,
        record_validators=[identity, SwarmKeyValidator(auth)])
    dht.identity = identity  # a p2ptrain averager on it signs its averages, as start_dht's peers do
    return dht, hmac.new(auth.secret, b"admit " + dht.peer_id.to_bytes(), hashlib.sha256).digest()[:16]


@pytest.mark.parametrize("poisons", POISON_SETS, ids="+".join)
def test_key_holders_sending_poison_change_nothing(swarm_key, alone, poisons, tmp_path, capfd, logs_to_stderr):
    dhts = honest_swarm(swarm_key)
    group = 2 + len(poisons)
    rogue_dhts = [start_rogue(swarm_key, dhts, str(tmp_path / f"rogue{i}.key")) for i in range(len(poisons))]
    stop = threading.Event()
    rogues, threads = [], []

    def attack(opts):
        for poison, (rogue_dht, token) in zip(poisons, rogue_dhts):
            # hivemind's own averager and all-reduce, with poisoned tensors under the honest peers' schema
            tensors = [POISONS[poison](p.detach()) for p in make_model().parameters()]
            rogue = PseudoGradientAverager(tensors, rogue_dht, prefix=PREFIX, start=False, target_group_size=group,
                                           min_matchmaking_time=2.0, request_timeout=1.0, allreduce_timeout=5.0,
                                           compression=Float16Compression())
            rogues.append(rogue)
            rogue.schema_hash = opts[0].averager.schema_hash
            rogue.run_in_background(await_ready=True)
            threads.append(threading.Thread(target=rounds, args=(rogue, rogue_dht, token), daemon=True))
            threads[-1].start()
        time.sleep(1.0)  # the rogues look for a group before the honest peers' first round

    def rounds(rogue, rogue_dht, token):
        outer = 0
        while not stop.is_set():
            rogue.set_group_bits(format(outer % 256, "08b"))
            try:
                rogue.step(gather={"outer_step": outer, "samples": 8, "digest": "x", "admission": token},
                           weight=1.0, timeout=5.0)
            except Exception:
                pass
            progress = [r.outer_step for r in fetch_progress(rogue_dht, RUN, timeout_s=2.0)]
            outer = max(progress, default=outer)  # follow the honest peers' outer step

    try:
        params, histories = train(dhts, before_rounds=attack, target_group_size=group)
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=15)
        for rogue in rogues:
            rogue.shutdown()
        for rogue_dht, _ in rogue_dhts:
            rogue_dht.shutdown()
        for dht in dhts:
            stop_dht(dht)
    # the honest peers averaged every round and ended exactly where they would alone
    assert_same_as_alone(params, histories, alone, rogue_group_sizes=range(2, group + 1))
    if os.environ.get("P2PTRAIN_ATTACK_REPORT"):  # the benchmark: compare with the same matchmaking waits
        record_cost(f"with key: {'+'.join(poisons)} tensors", histories, run_alone(swarm_key, group),
                    "parts refused, peer excluded")
    logs = capfd.readouterr().err
    for rogue_dht, _ in rogue_dhts:
        assert f"excluding peer {rogue_dht.peer_id} from this run" in logs, "a rogue was never caught"


def newcomer_reads_the_evidence(swarm_key, dhts, model=make_deeper_model) -> list:
    """A newcomer joins (its DHT is added to ``dhts``), looks for state, and returns whom it excluded first: the
    evidence records are read before any donor is listed."""
    newcomer_dht = start_dht(SwarmConfig(host_maddrs=[LOOPBACK], swarm_key_file=str(swarm_key),
                                         initial_peers=[str(m) for m in dhts[0].get_visible_maddrs()]))
    dhts.append(newcomer_dht)
    newcomer = P2PTrainAverager([torch.zeros_like(p) for p in model().parameters()], newcomer_dht,
                                prefix=PREFIX, compression="fp16", request_timeout=1.0)
    newcomer.start_in_background(30.0)
    try:
        newcomer.download_state(timeout_s=5.0)
        return list(newcomer.banned_peers)
    finally:
        newcomer.shutdown()


class PoisonedReducer(ExactAllReduceRunner):
    """A key holder's runner that sends honest parts but answers, as a reducer, averages x1e30 (fp16 on the wire
    caps them at 65504: finite, 10^4 times too large), or NaN."""

    poison = 1e30

    async def _serialize_average(self, part_index: int, averaged_part: torch.Tensor):
        return await super()._serialize_average(part_index, averaged_part * self.poison)


class RogueReducer(P2PTrainAverager):
    """p2ptrain's own averager (the exact all-reduce, its codec and checks), with a reducer that lies. Named like the
    honest peers' class: hivemind names a servicer's RPC handlers after its class."""

    runner_type = PoisonedReducer


RogueReducer.__name__ = SERVICER


@pytest.mark.slow
@pytest.mark.parametrize("poison, model", [(1e30, make_deeper_model), (float("nan"), make_deeper_model),
                                           (float("nan"), make_wide_model)], ids=["x1e30", "nan", "nan-512KiB"])
def test_a_caught_reducer_costs_no_round_and_its_records_stop_counting(swarm_key, tmp_path, capfd, logs_to_stderr,
                                                                       poison, model):
    """A key holder in the first round's group sends honest (zero) parts but answers averages x1e30 (or NaN) for
    its range.
    Both honest peers catch it and exclude it; it then stores progress records claiming the swarm is 3 outer steps
    ahead, and offers its state. The honest peers re-run the round without it and ignore its records: they average
    every round together and end bit-identical to the run without it, take no state, and never step alone.

    Their evidence (its signed averages, evidence.py) reaches a newcomer that never met it: a NaN average convicts it
    there (proven), an x1e30 one does not (judged against the verifier's own contribution, which a newcomer lacks).
    With a model of 512 KiB parts ("512KiB"), each signed average is too large for the DHT: every evidence record
    stays under RECORD_MAX_BYTES with its items as summaries, the honest peers' DHT processes live through it (one
    that stored such an average whole died, issue 40), and the newcomer, reading while they still run, fetches the
    items from them and convicts."""
    wide = model is make_wide_model
    dhts = honest_swarm(swarm_key)
    rogue_dht, _ = start_rogue(swarm_key, dhts, str(tmp_path / "rogue.key"))
    rogue_dht.auth = SwarmAuth.from_key(bytes.fromhex(swarm_key.read_text()))  # its averager's admission tokens
    me = rogue_dht.peer_id.to_base58()
    stop, rogues, threads, lied, honest = threading.Event(), [], [], threading.Event(), []

    def attack(opts):
        honest.extend(opts)
        zeros = [torch.zeros_like(p) for p in model().parameters()]
        rogue = RogueReducer(zeros, rogue_dht, prefix=PREFIX, compression="fp16", target_group_size=3,
                             min_matchmaking_time=2.0, request_timeout=1.0, allreduce_timeout=5.0,
                             next_chunk_timeout=2.5)
        rogues.append(rogue)
        rogue.start_in_background(30.0)
        threads.extend([threading.Thread(target=rounds, args=(rogue,), daemon=True),
                        threading.Thread(target=lie, daemon=True)])
        for thread in threads:
            thread.start()
        time.sleep(1.0)  # the rogue looks for a group before the honest peers' first round

    def rounds(rogue):
        while not stop.is_set() and not lied.is_set():
            rogue.set_group_bits(format(0, "08b"))
            # a window as long as the honest peers' first round's: a leader refuses a follower that expires first
            rogue.set_round_plan(3, 25.0)
            try:
                rogue.step(gather={"outer_step": 0, "samples": 8, "digest": "x"}, weight=1.0, timeout=35.0)
            except Exception:
                pass

    def lie():
        publisher = ProgressPublisher(rogue_dht, RUN)
        while not stop.is_set():
            if all(me in opt.averager.banned_peers for opt in honest):  # caught: "the swarm is 3 steps past you"
                steps = [r.outer_step for r in fetch_progress(rogue_dht, RUN, timeout_s=2.0) if r.peer_id != me]
                publisher.publish(outer_step=max(steps, default=0) + 3, local_step=0, samples_per_s=1e3,
                                  samples_since_sync=0, wait_s=1.0)
                lied.set()
            time.sleep(0.1)

    def read_evidence(_opts=None):
        # a newcomer that never met the rogue reads the honest peers' evidence before it looks for state: it
        # excludes the rogue (whose averager still declares a state) on their proof alone
        newcomer_bans.extend(newcomer_reads_the_evidence(swarm_key, dhts, model))

    PoisonedReducer.poison = poison  # read in the rogue's averager process, forked below
    newcomer_bans, records, alive = [], {}, []
    try:
        # a summary's item is served by its accuser: the newcomer reads while the honest peers still run
        params, histories = train(dhts, before_rounds=attack, target_group_size=3, model=model,
                                  after_rounds=read_evidence if wide else None)
        if not wide:
            read_evidence()
        alive.extend(dht.is_alive() for dht in dhts[:2])
        found = dhts[0].get(f"{PREFIX}_evidence", latest=True)
        records.update(found.value if found is not None else {})
    finally:
        PoisonedReducer.poison = 1e30
        stop.set()
        for thread in threads:
            thread.join(timeout=15)
        for rogue in rogues:
            rogue.shutdown()
        rogue_dht.shutdown()
        for dht in dhts:
            stop_dht(dht)
    logs = capfd.readouterr().err
    assert alive == [True, True], logs[-3000:]
    assert len(records) == 2 and all(len(entry.value) <= RECORD_MAX_BYTES for entry in records.values()), \
        {subkey: len(entry.value) for subkey, entry in records.items()}
    summarized = [bool(item.item_digest) for entry in records.values()
                  for item in p2ptrain_pb2.Evidence.FromString(entry.value).items]
    assert summarized and all(summarized) == wide and any(summarized) == wide, summarized
    assert lied.is_set(), [[(r.outer_step, r.group_size, r.averaged, r.caught_up) for r in h] for h in histories]
    assert f"excluding peer {me} from this run" in logs and "as a reducer it returned" in logs, logs[-3000:]
    for history in histories:
        assert not any(r.caught_up or r.group_size == 1 for r in history), history
    assert "downloading the state" not in logs
    accusers = {dht.peer_id.to_base58() for dht in dhts[:2]}
    convicted = any(f"excluding peer {me} from this run for 600s: peer {accuser} holds its signed average" in logs
                    for accuser in accusers)
    if math.isnan(poison):
        assert newcomer_bans == [me] and convicted, (newcomer_bans, logs[-3000:])
    else:
        assert newcomer_bans == [] and not convicted, newcomer_bans
    alone = run_alone(swarm_key, 2, model)
    assert_same_as_alone(params, histories, alone, rogue_group_sizes=(2, 3))
    if os.environ.get("P2PTRAIN_ATTACK_REPORT") and not wide:  # the benchmark: compare with the same matchmaking waits
        record_cost(f"with key: reducer answers {'NaN' if math.isnan(poison) else 'x1e30'}, then records 3 steps "
                    "ahead", histories,
                    run_alone(swarm_key, 3, make_deeper_model),
                    "range refused, round re-run without it, its records ignored")


class ShadyReducer(ExactAllReduceRunner):
    """A key holder's runner whose averages look right: within every norm check, signed, with a receipt that lists
    every sender as it sent. It scales them by 1.5 ("x1.5"), or leaves the first other sender's part out of them
    ("drop": weighed 0, still listed; "drop-unlisted": left out of the receipt too, as if that sender had failed)."""

    lie = "x1.5"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        if self.lie.startswith("drop"):
            me = self.sender_peer_ids.index(self.peer_id)
            self.tensor_part_reducer.__class__ = _Dropping
            self.tensor_part_reducer.victim = next(i for i in range(len(self.sender_peer_ids)) if i != me)
            self.tensor_part_reducer.unlisted = self.lie == "drop-unlisted"

    async def _serialize_average(self, part_index: int, averaged_part: torch.Tensor):
        return await super()._serialize_average(part_index, averaged_part * (1.5 if self.lie == "x1.5" else 1.0))


class _Dropping(Reducer):
    victim, unlisted = 0, False

    async def accumulate_part(self, sender_index, part_index, tensor_part, weight=1.0):
        return await super().accumulate_part(sender_index, part_index, tensor_part,
                                             0.0 if sender_index == self.victim else weight)

    def check_current_part_finished(self):
        if self.unlisted and self.victim in self.current_included:
            self.current_included.remove(self.victim)
        super().check_current_part_finished()


class AuditedRogue(P2PTrainAverager):
    runner_type = ShadyReducer


AuditedRogue.__name__ = SERVICER


class Auditor(DiLoCoOptimizer):
    """An honest peer that audits every part of the other reducers' ranges (the tests' way to make a catch certain;
    the default audits one part a round)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs, audit_parts=1000)


def shady_swarm(swarm_key, tmp_path, lie: str, served: bool = False, audit_counts: Optional[list] = None):
    """Two honest auditors and a ``ShadyReducer`` in the first round's group (3 syncs), then a newcomer that reads
    the evidence while the honest peers still run (they serve the proofs that are not in the DHT; ``served``: none
    is). Returns the honest parameters and histories, the newcomer's exclusions, the rogue's id and the honest ids;
    the honest averagers' audit counts go into ``audit_counts``."""
    dhts = honest_swarm(swarm_key)
    rogue_dht, _ = start_rogue(swarm_key, dhts, str(tmp_path / "rogue.key"))
    rogue_dht.auth = SwarmAuth.from_key(bytes.fromhex(swarm_key.read_text()))
    honest = [dht.peer_id.to_base58() for dht in dhts]
    stop, rogues, threads, newcomer_bans = threading.Event(), [], [], []

    def attack(opts):
        rogue = AuditedRogue([torch.zeros_like(p) for p in make_deeper_model().parameters()], rogue_dht,
                             prefix=PREFIX, compression="fp16", target_group_size=3, min_matchmaking_time=2.0,
                             request_timeout=1.0, allreduce_timeout=5.0, next_chunk_timeout=2.5)
        rogues.append(rogue)
        rogue.start_in_background(30.0)
        threads.append(threading.Thread(target=rounds, args=(rogue,), daemon=True))
        threads[0].start()
        time.sleep(1.0)  # the rogue looks for a group before the honest peers' first round

    def rounds(rogue):
        while not stop.is_set():
            rogue.set_group_bits(format(0, "08b"))
            rogue.set_round_plan(3, 25.0)
            try:
                rogue.step(gather={"outer_step": 0, "samples": 8, "digest": "x"}, weight=1.0, timeout=35.0)
            except Exception:
                pass

    def newcomer_reads(opts):  # while the honest peers run: they serve the proofs that are not in the DHT
        newcomer_bans.extend(newcomer_reads_the_evidence(swarm_key, dhts))
        if audit_counts is not None:
            audit_counts.extend(opt.averager.audits for opt in opts)

    ShadyReducer.lie = lie  # read in the rogue's averager process, forked below
    Audits.max_proof_bytes = 0 if served else MAX_PROOF_BYTES  # in the honest ones, forked too
    try:
        params, histories = train(dhts, before_rounds=attack, target_group_size=3, model=make_deeper_model,
                                  classes=(Auditor, Auditor), after_rounds=newcomer_reads, to_outer_step=True)
    finally:
        ShadyReducer.lie, Audits.max_proof_bytes = "x1.5", MAX_PROOF_BYTES
        stop.set()
        for thread in threads:
            thread.join(timeout=15)
        for rogue in rogues:
            rogue.shutdown()
        rogue_dht.shutdown()
        for dht in dhts:
            stop_dht(dht)
    return params, histories, newcomer_bans, rogue_dht.peer_id.to_base58(), honest


@pytest.mark.slow
@pytest.mark.parametrize("lie", ["x1.5", "drop", "x1.5-served", "x1.5-from-file"])
def test_a_reducer_whose_average_is_wrong_is_caught_by_an_audit_and_excluded_swarm_wide(swarm_key, tmp_path, capfd,
                                                                                         logs_to_stderr, monkeypatch,
                                                                                         lie):
    """A key holder in the first round's group answers, for its range, averages that pass every check of the round
    (signed, plausible in size, with a receipt naming every sender's part as sent) but are wrong: x1.5, or without
    one member's part. The honest peers audit its parts after the round, recompute them from the inputs it signed
    for, exclude it, and average every later round without it. Their proof (the signed average, receipt and inputs)
    convicts it on a newcomer that never met it, before that newcomer looks for state: inside their DHT records, or
    ("-served") served by them on request, as a real model's proofs are (too large for the DHT). "-from-file": every
    reducer's inputs leave its memory after the round (no memory budget: kept_inputs.py), and the audits read them
    back from its file."""
    from_file, audit_counts = lie.endswith("-from-file"), []
    if from_file:
        monkeypatch.setenv("P2PTRAIN_AUDIT_MEMORY_MB", "0")
    _, histories, newcomer_bans, me, honest = shady_swarm(swarm_key, tmp_path,
                                                          lie.removesuffix("-served").removesuffix("-from-file"),
                                                          served=lie.endswith("-served"), audit_counts=audit_counts)
    # the honest reducers' inputs left their memory after each round exactly when there was no budget for them
    assert len(audit_counts) == 2 and all((c["spilled"] > 0) == from_file for c in audit_counts), audit_counts
    logs = capfd.readouterr().err
    caught = f"excluding peer {me} from this run for 600s: audited, part #"
    assert caught in logs and "it signed an average at distance" in logs, logs[-3000:]
    assert "as a reducer it returned" not in logs, "the lie was plausible: no check of the round refused it"
    sizes = [[r.group_size for r in h if r.averaged] for h in histories]
    # in the first round; the audit runs beside the next round's matchmaking, so a second round may still hold it
    assert all(s[0] == 3 and s[-1] == 2 for s in sizes), sizes
    for history in histories:
        assert [r.outer_step for r in history if r.averaged] == list(range(1, OUTER_STEPS + 1)), history
        assert not any(r.caught_up for r in history), history
    assert newcomer_bans == [me], newcomer_bans
    assert any(f"excluding peer {me} from this run for 600s: peer {accuser} holds its signed average" in logs
               for accuser in honest), logs[-3000:]


@pytest.mark.slow
def test_a_reducer_that_leaves_a_member_out_and_says_so_is_refused_by_that_member(swarm_key, tmp_path, capfd,
                                                                                 logs_to_stderr):
    """The same reducer leaves one honest member's part out of its averages and out of its receipt, as it would a
    member that failed. That member finds its part missing from the first answer and refuses the range; the other
    cannot tell it from a failure, and an audit finds the average consistent with what the receipt lists. Either the
    refusal stops the victim's own range too and both run the round again without the rogue, or the other had all
    its averages and committed, and the victim takes its state (the stated cost). Nothing proves the lie to a third
    party: the newcomer excludes nobody. The honest peers end at the last outer step with the same parameters."""
    params, histories, newcomer_bans, me, honest = shady_swarm(swarm_key, tmp_path, "drop-unlisted")
    logs = capfd.readouterr().err
    assert "returned an average that leaves this peer's part out" in logs, logs[-3000:]
    assert f"excluding peer {me} from this run for 600s: as a reducer it returned an average that leaves" in logs
    assert "audited, part #" not in logs
    assert newcomer_bans == [], newcomer_bans
    for got, expected in zip(params[1], params[0]):
        assert torch.equal(got, expected), "the honest peers disagree"
    assert sum(any(r.caught_up for r in h) for h in histories) <= 1, histories  # the victim, if the other committed
    for history in histories:
        assert history[-1].outer_step == OUTER_STEPS, history


def test_a_peer_with_another_model_or_settings_is_refused_at_join():
    """Peers of different schemas never group; rather than wait (or train alone) in silence, a newcomer whose
    model, H or codec differs from the live peers' is refused at once, with each difference named."""
    first = hivemind.DHT(start=True, host_maddrs=[LOOPBACK])
    second = hivemind.DHT(start=True, host_maddrs=[LOOPBACK], initial_peers=first.get_visible_maddrs())
    make = partial(DiLoCoOptimizer, run_id="settings", inner_optimizer=INNER, outer_optimizer=OUTER,
                   matchmaking_time_s=1.0, averaging_timeout_s=5.0)
    live = make(make_model().parameters(), dht=first, local_steps=LOCAL_STEPS, compression="fp16").start()
    try:
        # a live peer is one whose record the newcomer can read (it is stored in the background at start)
        deadline = time.monotonic() + 30
        while not fetch_progress(second, "settings") and time.monotonic() < deadline:
            time.sleep(0.2)
        other_model = torch.nn.Linear(16, 5)
        with pytest.raises(RunMismatch) as refused:
            make(other_model.parameters(), dht=second, local_steps=LOCAL_STEPS + 2, compression="int8").start()
        message = str(refused.value)
        assert "run 'settings'" in message and "\n" not in message
        assert f"H (local_steps) {LOCAL_STEPS + 2} here, {LOCAL_STEPS} on 1 of 1 live peer;" in message
        assert "codec (compression) 'int8' here, 'fp16'" in message
        # a library user's optimizer knows no model name: its tensors describe it
        assert ("model without a built-in name (85 parameters, 2 tensors) here, without a built-in name (676 "
                "parameters, 4 tensors) on 1 of 1 live peer") in message
        # the same model and settings are welcome
        make(make_model().parameters(), dht=second, local_steps=LOCAL_STEPS, compression="fp16").start().shutdown()
    finally:
        live.close()
        second.shutdown()
        first.shutdown()


def _toward_direction(buffer: torch.Tensor) -> torch.Tensor:
    """A fixed direction of the attacker's choosing (the same every round), at 5x the buffer's norm."""
    direction = torch.randn(buffer.shape, generator=torch.Generator().manual_seed(buffer.numel()))
    return direction * (5.0 * torch.linalg.vector_norm(buffer) / torch.linalg.vector_norm(direction))


PLAUSIBLE_POISONS = {"x5": lambda b: 5.0 * b, "flip_x5": lambda b: -5.0 * b, "direction": _toward_direction}


class PlausiblePoisoner(DiLoCoOptimizer):
    """A key holder that trains like everyone else but sends a poisoned pseudo-gradient within the 10x norm check,
    so every part of it is accepted: ``poison`` (a PLAUSIBLE_POISONS key) picks how."""

    poison = "flip_x5"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        honest_fill = self._contribution.fill_pseudo_gradient  # what goes into the buffers for a round

        def fill_pseudo_gradient(*args, **kwargs):
            diverged = honest_fill(*args, **kwargs)
            with self.averager.get_tensors() as buffers:
                for buffer in buffers:
                    buffer.copy_(PLAUSIBLE_POISONS[self.poison](buffer))
            return diverged

        self._contribution.fill_pseudo_gradient = fill_pseudo_gradient


_POISON_RUNS = {}
"""(aggregation, rogue class, poison) -> a run of ``poison_run``: the same swarm's run serves every test that needs it
(the honest peers alone, the mean's run of a poison), each one 3-4 peers' worth of seconds"""


def poison_run(swarm_key, aggregation: str = "mean", kind=None, poison: Optional[str] = None):
    """3 honest peers learning one linear map (``teacher``), and a ``kind`` rogue sending ``poison`` if any, in
    groups of all of them: the final parameters (the rogue's first) and histories."""
    key = (aggregation, kind, poison)
    if key not in _POISON_RUNS:
        if kind is not None:
            kind.poison = poison
        dhts = honest_swarm(swarm_key, 4 if kind else 3)
        try:
            _POISON_RUNS[key] = train(dhts, target_group_size=len(dhts), aggregation=aggregation,
                                      classes=[kind] if kind else [], teacher=True)
        finally:
            for dht in dhts:
                stop_dht(dht)
    return _POISON_RUNS[key]


@pytest.mark.slow
@pytest.mark.parametrize("poison", sorted(PLAUSIBLE_POISONS))
def test_centered_clipping_bounds_plausible_poison_that_the_mean_takes_in(swarm_key, poison):
    """3 honest peers and a poisoner (x5, x-5, or a direction of its own at 5x its norm) in groups of 4. Under the
    plain mean it drags the honest peers far from where the 3 of them end alone; under --aggregation clip it moves
    them a fraction of that. Every round still averages the 4 of them, and the honest peers stay bit-identical to
    each other."""
    def flat(params):
        return torch.cat([p.flatten() for p in params])

    reference, _ = poison_run(swarm_key)
    distances = {}
    for aggregation in ("mean", "clip"):
        params, histories = poison_run(swarm_key, aggregation, PlausiblePoisoner, poison)
        honest_params = params[1:]  # peer 0 is the rogue
        for other in honest_params[1:]:
            assert all(torch.equal(a, b) for a, b in zip(other, honest_params[0])), "honest peers differ"
        for history in histories:
            assert [r.outer_step for r in history if r.averaged] == list(range(1, OUTER_STEPS + 1)), history
            assert all(r.group_size == 4 for r in history), history
        distances[aggregation] = float(torch.linalg.vector_norm(flat(honest_params[0]) - flat(reference[0])))
    COSTS[f"with key: plausible poison {poison}, 1 of 4"] = dict(
        outcome="averaged in (mean) / clipped (clip)", distance_from_honest_run=distances)
    assert distances["clip"] < 0.5 * distances["mean"], distances


class WeightInflater(PlausiblePoisoner):
    """A poisoner (x-5) that also claims 10^6 times the samples it trained on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        run = self.rounds.run
        self.rounds.run = lambda weight, *a, **k: run(weight * 1e6, *a, **k)


@pytest.mark.slow
def test_a_claimed_weight_counts_at_most_twice_the_median_under_the_mean(swarm_key):
    """Under the plain mean, a poisoner claiming 10^6x the samples made the group's average its own pseudo-gradient.
    Its weight now counts 2x the median claim: it moves the honest peers about as far as the same poison at 2x the
    honest weight (share 2/5 against 1/4 at its own weight), not 4x as far."""
    def distance(params):
        return float(torch.linalg.vector_norm(torch.cat([p.flatten() for p in params[1]]) -
                                              torch.cat([p.flatten() for p in reference[0]])))

    reference, _ = poison_run(swarm_key)
    plain, _ = poison_run(swarm_key, "mean", PlausiblePoisoner, "flip_x5")
    inflated, histories = poison_run(swarm_key, "mean", WeightInflater, "flip_x5")
    for history in histories:
        assert all(r.group_size == 4 and r.averaged for r in history), history
    COSTS["with key: x-5 poison claiming 1e6x the samples, 1 of 4 (mean)"] = dict(
        outcome="its weight capped at 2x the median", distance_from_honest_run=dict(
            mean=distance(plain), mean_weight_1e6=distance(inflated)))
    assert distance(inflated) < 2.0 * distance(plain), (distance(inflated), distance(plain))
