"""The replay check's pieces without a swarm (diloco/replay.py, averaging/replay_serving.py): the steps a claim
names, the digest that fixes a claim, the claims a sender keeps and serves, and what a DiLoCo peer must be given to
run the check. The check itself runs in real swarms in tests/swarm/test_replay_check.py."""

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
    return ReplayServing(context, total_size=CHUNK_VALUES, input_of=lambda *args: None)


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
