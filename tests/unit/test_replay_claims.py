"""The replay check's pieces without a swarm (diloco/replay.py, averaging/replay_serving.py): the steps a claim
names, the digest that fixes a claim, the claims a sender keeps and serves, and what a DiLoCo peer must be given to
run the check. The check itself runs in real swarms in tests/swarm/test_replay_swarm.py."""

from __future__ import annotations

import pytest
import torch
from hivemind.p2p import PeerID

from p2ptrain.averaging.context import AveragerContext
from p2ptrain.averaging.replay_serving import CLAIMS_KEPT, ReplayServing, claim_digest
from p2ptrain.averaging.state_transfer import CHUNK_VALUES
from p2ptrain.config import DiLoCoConfig
from p2ptrain.diloco.options import DiLoCoOptions
from p2ptrain.diloco.replay import replay_check_of, step_runs, steps_of
from p2ptrain.security import SwarmAuth


def test_a_phases_local_steps_travel_as_runs_and_come_back():
    assert step_runs([6, 7, 8]) == [[6, 3]]
    assert step_runs([6, 8, 10, 11]) == [[6, 1], [8, 1], [10, 2]]  # a slow peer's stride, then one
    assert step_runs([]) == []
    for steps in ([6, 7, 8], [0, 2, 4], [3]):
        assert steps_of(step_runs(steps)) == steps


@pytest.mark.parametrize("runs", [None, "0-3", [[1]], [[1, 0]], [[-1, 2]], [[1.0, 2]], [[1, True]], [["a", 1]]])
def test_malformed_step_runs_are_no_claim(runs):
    assert steps_of(runs) is None


def test_a_claims_digest_fixes_its_metadata_as_well_as_its_state():
    flat = torch.arange(10, dtype=torch.float32)
    digest = claim_digest(flat, b"data at batch 3")
    assert digest == claim_digest(flat.clone(), b"data at batch 3")
    assert digest != claim_digest(flat, b"data at batch 4")
    assert digest != claim_digest(flat + 1, b"data at batch 3")
    assert claim_digest(torch.zeros(0), bytes(8)) != claim_digest(torch.zeros(2), b"")  # the same bytes, cut elsewhere


def serving() -> ReplayServing:
    me = PeerID.from_base58("QmT5nVuW2JwLDe27ifFymp7pnc7tNLDoB25ohuSFH55GaJ")
    context = AveragerContext(prefix="run_diloco", auth=SwarmAuth(), dht=None, own_id=lambda: me,
                              stub=lambda peer: None, ban=lambda *args: None, is_banned=lambda peer: False)
    return ReplayServing(context, total_size=CHUNK_VALUES, input_for=lambda *args: None)


def test_a_sender_serves_its_last_claims_in_chunks_and_only_as_it_gathered_them():
    claims = serving()
    flats = {step: torch.randn(CHUNK_VALUES + 5) for step in range(CLAIMS_KEPT + 1)}
    for step, flat in flats.items():
        claims.keep_claim(outer_step=step, flat=flat, metadata=b"m%d" % step, digest=claim_digest(flat, b"m%d" % step))
    assert not claims.info(0).available  # the oldest went when the fourth came
    info = claims.info(CLAIMS_KEPT)
    assert info.available and info.num_values == CHUNK_VALUES + 5 and info.metadata == b"m%d" % CLAIMS_KEPT
    values = b"".join(claims.chunk(CLAIMS_KEPT, info.digest, i).values for i in range(2))
    assert torch.equal(torch.frombuffer(bytearray(values), dtype=torch.float32), flats[CLAIMS_KEPT])
    assert not claims.chunk(CLAIMS_KEPT, "another digest", 0).available
    assert not claims.chunk(CLAIMS_KEPT, info.digest, 2).available  # past its end


def test_a_peer_that_replays_must_be_given_a_replica_and_a_blocking_sync():
    assert replay_check_of(DiLoCoConfig(), DiLoCoOptions(), state=None, inner_factory=None, serializer=None) is None
    with pytest.raises(ValueError, match=r"needs a replica of the model and the data .* DiLoCoOptions\(replayer="):
        replay_check_of(DiLoCoConfig(replay_rate=0.1), DiLoCoOptions(), None, None, None)
    with pytest.raises(ValueError, match="replays a blocking sync's pseudo-gradients"):
        replay_check_of(DiLoCoConfig(replay_rate=0.1, fragments=2), DiLoCoOptions(replayer=object()), None, None,
                        None)


class ListReplayer:
    """A replica and a list of batches: the claim is the index of the phase's first batch."""

    def __init__(self, model: torch.nn.Module, batches) -> None:
        self.replica, self.batches = model, batches

    def claim(self) -> dict:
        return {"batch": 0}

    def parameters(self):
        return list(self.replica.parameters())

    def step(self, claim: dict, step: int, optimizer) -> None:
        x, y = self.batches[claim["batch"] + step]
        torch.nn.functional.mse_loss(self.replica(x), y).backward()
        optimizer.step(batch_size=len(x))
        optimizer.zero_grad()


def test_a_replay_follows_the_claimed_inner_state_schedule_and_strides_bit_for_bit():
    """A phase of a slow peer (local steps 5, 7, 9: a stride of 2) under a warm-up schedule, from an inner state
    of earlier steps: the replay gives its pseudo-gradient exactly, and the same claim at other local steps does not."""
    from types import SimpleNamespace

    from hivemind.utils.serializer import MSGPackSerializer

    from p2ptrain.averaging.state_transfer import flatten_state
    from p2ptrain.diloco.replay import ReplayCheck
    from p2ptrain.diloco.state import inner_state_layout
    from p2ptrain.schedules import scale_lrs

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))

    def inner_factory(params):
        return torch.optim.AdamW(params, lr=1e-2)

    gen = torch.Generator().manual_seed(3)
    batches = [(torch.randn(4, 6, generator=gen), torch.randn(4, 2, generator=gen)) for _ in range(6)]
    schedule = (lambda local_step: min(1.0, (local_step + 1) / 8))
    trainer = model()
    inner = inner_factory(trainer.parameters())
    for i, local_step in enumerate([0, 1, 2]):  # earlier steps: the claimed inner state is not a fresh one
        scale_lrs(inner.param_groups, schedule(local_step))
        torch.nn.functional.mse_loss(trainer(batches[i][0]), batches[i][1]).backward()
        inner.step()
        inner.zero_grad()
    start = [p.detach().clone() for p in trainer.parameters()]
    tensors, layout = inner_state_layout(list(trainer.parameters()), inner)
    metadata = MSGPackSerializer.dumps({"inner": layout, "shapes": [list(t.shape) for t in tensors],
                                        "data": {"batch": 3}})
    flat = flatten_state(tensors)
    steps = [5, 7, 9]
    for i, local_step in enumerate(steps):
        scale_lrs(inner.param_groups, schedule(local_step))
        torch.nn.functional.mse_loss(trainer(batches[3 + i][0]), batches[3 + i][1]).backward()
        inner.step()
        inner.zero_grad()
    sent = torch.cat([(s - p.detach()).reshape(-1) for s, p in zip(start, trainer.parameters())])

    state = SimpleNamespace(inner_lr_schedule=schedule)
    check = ReplayCheck(state, ListReplayer(model(), batches), 1.0, inner_factory, MSGPackSerializer, max_steps=6)
    assert torch.equal(check._replay(start, metadata, flat, steps), sent)
    assert not torch.equal(check._replay(start, metadata, flat, [6, 7, 8]), sent)  # another schedule position
