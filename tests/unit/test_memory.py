"""The start-up memory estimate and the one-line refusal when a model will not fit."""

from __future__ import annotations

import pytest

from p2ptrain.memory import GiB, MemoryEstimate, count_parameters, estimate_memory, memory_problem
from p2ptrain.model import build_model, model_config


def estimate(**overrides) -> MemoryEstimate:
    args = dict(config=model_config("124m"), batch_size=8, world=1, shard=1, device_type="cuda",
                activation_checkpointing=False)
    args.update(overrides)
    return estimate_memory(**args)


def test_parameter_count_matches_the_built_model():
    assert count_parameters(model_config("small")) == build_model("small").num_parameters()


def test_a_rank_needs_at_least_its_shard_of_weights_gradients_and_adamw_moments():
    one = estimate()
    assert one.rank_bytes >= 16 * one.parameters
    # sharding over 2 ranks halves those 16 bytes per parameter and the batch
    two = estimate(world=2, shard=2)
    assert two.rank_bytes < 0.6 * one.rank_bytes
    assert estimate(world=2, shard=1).rank_bytes > two.rank_bytes  # replicated, not sharded


def test_activation_checkpointing_and_smaller_batches_need_less():
    plain = estimate(batch_size=32)
    assert estimate(batch_size=32, activation_checkpointing=True).rank_bytes < 0.5 * plain.rank_bytes
    assert estimate(batch_size=8).rank_bytes < plain.rank_bytes


def test_on_cpu_the_ranks_memory_is_the_hosts():
    cpu = estimate(device_type="cpu", world=2, shard=2)
    assert cpu.host_bytes >= 2 * cpu.rank_bytes


@pytest.mark.parametrize(
    "free, fragments",
    [
        (dict(device_free=2 * GiB), ["per rank", "cuda:0 has 2.0 GiB free", "--activation-checkpointing"]),
        (dict(host_free=1 * GiB), ["of host memory", "1.0 GiB is available", "smaller --model"]),
        (dict(shm_free=64 << 20), ["shared memory", "/dev/shm has 0.06 GiB free", "--shm-size"]),
    ],
)
def test_a_model_that_does_not_fit_is_one_line_with_the_numbers_and_the_fixes(free, fragments):
    plenty = dict(device_free=80 * GiB, host_free=500 * GiB, shm_free=100 * GiB)
    problem = memory_problem(estimate(), **{**plenty, **free}, device_name="cuda:0")
    assert "\n" not in problem and "--no-memory-check" in problem
    for fragment in fragments:
        assert fragment in problem, problem
    assert memory_problem(estimate(), **plenty, device_name="cuda:0") == ""


def test_mixing_groups_add_the_stepped_state_to_the_host_and_shared_memory():
    """--target-group-size keeps the stepped parameters and outer momenta (fp32) in the averager's shared memory."""
    plain, mixing = estimate(), estimate(mixing=True)
    n = plain.parameters
    assert mixing.shm_bytes - plain.shm_bytes == 8 * n and mixing.host_bytes - plain.host_bytes == 8 * n
    assert mixing.rank_bytes == plain.rank_bytes
