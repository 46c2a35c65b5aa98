"""check_run_settings: a newcomer whose model or settings differ from the live peers' is refused with each difference
in words and the value on each side (records built here, as peers publish them)."""

from __future__ import annotations

import pytest

from p2ptrain.model import MODEL_SIZES
from p2ptrain.proto.p2ptrain_pb2 import PeerProgress
from p2ptrain.swarm.progress import RunMismatch, check_run_settings

SCHEMAS = {"tiny": "1111aaaa2222bbbb", "small": "3333cccc4444dddd", "124m": "5555eeee6666ffff"}
PARAMETERS = {"tiny": 437_760, "small": 25_456_640, "124m": 121_501_440}


def settings(model: str = "tiny", **changes) -> dict:
    shape = MODEL_SIZES[model]
    values = dict(model=model, n_layer=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head,
                  block_size=shape.block_size, vocab_size=shape.vocab_size, num_parameters=PARAMETERS[model],
                  num_tensors=28, params_schema=SCHEMAS[model], local_steps=10, compression="fp16", seed=0,
                  protocol=4, data="built-in corpus", batch_size=16, threads=1)
    values.update(changes)
    return values


def record(i: int, **values) -> PeerProgress:
    return PeerProgress(run_id="r", peer_id=f"peer{i}", **values)


def refusal(mine: dict, records) -> str:
    with pytest.raises(RunMismatch) as refused:
        check_run_settings(mine, records, "r")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("this peer does not match run 'r': ")
    return message


def test_the_same_model_and_settings_pass_whatever_each_worker_trains_on():
    check_run_settings(settings(), [record(0, **settings(data="/data/a", batch_size=32, threads=4))], "r")
    check_run_settings(settings(), [], "r")


def test_another_model_is_named_with_its_shape_on_both_sides():
    message = refusal(settings("small"), [record(i, **settings("tiny")) for i in range(2)])
    assert ("model 'small' (8 layers, 512 wide, 8 heads, block size 256, 25.5M parameters) here, "
            "'tiny' (2 layers, 128 wide, 4 heads, block size 64, 0.438M parameters) on 2 of 2 live peers") in message
    assert message.endswith("start it with the run's model and settings, or under another --run-id")
    assert "params_schema" not in message and SCHEMAS["tiny"] not in message


def test_each_run_setting_is_named_with_both_values_and_the_majority():
    live = [record(0, **settings()), record(1, **settings()), record(2, **settings(local_steps=20))]
    message = refusal(settings(local_steps=12, compression="int8", seed=7, protocol=5), live)
    assert "H (local_steps) 12 here, 10 on 2 of 3 live peers" in message
    assert "codec (compression) 'int8' here, 'fp16' on 3 of 3 live peers" in message
    assert "seed 7 here, 0 on 3 of 3 live peers" in message
    assert "protocol version 5 here, 4 on 3 of 3 live peers" in message
    assert "model" not in message.split(": ", 1)[1].split(";")[0]  # the model is the same: not mentioned


def test_a_vocab_or_width_change_names_just_that_detail():
    message = refusal(settings(vocab_size=512, num_parameters=470_528, params_schema="9999"), [record(0, **settings())])
    assert "model 'tiny' (2 layers, 128 wide, vocab 512, 0.471M parameters) here, " \
           "'tiny' (2 layers, 128 wide, vocab 256, 0.438M parameters) on 1 of 1 live peer;" in message + ";"


def test_a_library_user_without_a_model_name_is_described_by_its_tensors():
    """A DiLoCoOptimizer used as a library knows only its tensors (no name, shape or seed)."""
    mine = dict(params_schema="abcd", num_parameters=85, num_tensors=2, local_steps=10, compression="fp16",
                protocol=4)
    message = refusal(mine, [record(0, **settings())])
    assert ("model without a built-in name (85 parameters, 2 tensors) here, 'tiny' (2 layers, 128 wide, 0.438M "
            "parameters, 28 tensors) on 1 of 1 live peer") in message
    assert "seed" not in message  # unknown here: not compared
    # the same tensors as a named peer's, but other dtypes: only the schema tells
    theirs = dict(mine, params_schema="ef01")
    message = refusal(mine, [record(0, **theirs)])
    assert "tensor shapes or dtypes abcd here" in message and "tensor shapes or dtypes ef01 on 1 of 1 live peer" \
        in message


def test_records_of_old_peers_without_settings_are_not_compared():
    check_run_settings(settings("small"), [record(0)], "r")
    # a peer of an earlier version publishes the schema but no model words: it is compared on the schema alone
    old = {k: v for k, v in settings().items() if k in ("params_schema", "local_steps", "compression", "protocol")}
    message = refusal(settings("small"), [record(0, **old)])
    assert ("model 'small' (8 layers, 512 wide, 25.5M parameters, 28 tensors) here, without a built-in name (tensor "
            "schema 1111aaaa2222bbbb) on 1 of 1 live peer") in message


def test_a_different_streaming_sync_is_refused_with_both_schedules():
    """A fragment round needs every member on the same schedule: the blocking sync ("") against a streaming one."""
    live = [record(i, **settings(sync_schedule="fragments=4 overlap=2 alpha=0.5")) for i in range(2)]
    message = refusal(settings(sync_schedule=""), live)
    assert ("streaming sync (--fragments, --overlap-steps) blocking (1 fragment, no overlap) here, "
            "'fragments=4 overlap=2 alpha=0.5' on 2 of 2 live peers") in message
    check_run_settings(settings(sync_schedule="fragments=4 overlap=2 alpha=0.5"), live, "r")
