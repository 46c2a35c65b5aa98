"""Will the chosen model fit? An estimate of a peer's memory, checked at start-up before anything is trained.

A peer that runs out of memory an hour in, or dies with a bus error when hivemind fills /dev/shm, wastes its
owner's time and the swarm's rounds. The estimate is coarse (figures at the end) and counts what p2ptrain keeps:

per rank, on its device (the model is sharded over ``shard`` ranks; ``b`` sequences of ``T`` tokens per rank):
  * fp32 parameters, gradients and AdamW's two moments of its shard: 16 bytes x N / shard
  * activations kept for the backward pass: about 20 values of width ``d`` per token and block (LayerNorm inputs
    and outputs, q/k/v, the attention's output, the MLP's 4d hidden layer before and after GELU, and what the
    kernels keep besides: 17 by count, 20 measured), or with activation checkpointing only each block's input
    plus one block's activations; 2 bytes each under bf16, 4 in fp32
  * on CUDA, bf16 copies of the parameters in use (autocast's cache, or FSDP's all-gathered blocks)
  * 10% for allocator fragmentation

on the leader's host, the swarm side (fp32, never on the GPU):
  * global parameters, outer momentum and the averager's buffers: 12 bytes x N; and the butterfly's outputs, which
    the averager keeps between rounds (averaging/flat_outputs.py): 4 bytes x N
  * the donor's snapshot for newcomers and the averager's copy of it while serving: 2 x 16 bytes x N (global
    parameters, momentum and the inner AdamW moments)
  * with several ranks, the full fp32 proxy the sync gathers into and its copy of the inner moments: 12 bytes x N
  * the processes themselves (python with torch in the main, DHT and averager processes, p2pd): 0.75 GiB, and
    0.6 GiB for each further rank with its torch, gloo and FSDP state (measured on CPU: 0.65 GiB for the tiny
    model's whole 1-rank process tree; a 2-rank peer's torchrun agent and second rank add about 0.6)
  * on CPU, every rank's own memory too

Against the measured peak on CPU (PSS summed over the whole process tree, small model, batch 16): 1 rank 3.6 GiB
estimated, 2.9 measured; 2 ranks 3.9 estimated, 4.2 measured. So it is a guard against configurations that are
far off (the common mistake: a batch or model several times too big), not a promise to the last 10%.
in /dev/shm: the averager's buffers and the snapshot (hivemind shares them between processes through it).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Tuple, Union

import psutil
import torch

from p2ptrain.config import ConfigError
from p2ptrain.model import GPT, GPTConfig

if TYPE_CHECKING:
    from p2ptrain.model_source import ModelSpec

GiB = 1 << 30
FRAGMENTATION = 1.10
PROCESSES_BYTES, RANK_PROCESS_BYTES = int(0.75 * GiB), int(0.6 * GiB)
ACTIVATION_VALUES_PER_TOKEN_AND_WIDTH = 20


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a peer needs, by place."""

    parameters: int
    rank_bytes: int
    """on each rank's device"""
    host_bytes: int
    """on the host, for the whole peer (all ranks' memory included when the ranks run on CPU)"""
    shm_bytes: int
    """in /dev/shm"""


def count_parameters(config: GPTConfig) -> int:
    with torch.device("meta"):  # shapes only: no memory, no init cost
        return GPT(config).num_parameters()


def _shape(model: Union[GPTConfig, "ModelSpec"]) -> Tuple[int, int, int, int, int]:
    """(parameters, blocks, width, sequence length, vocabulary) of a built-in shape or a resolved ModelSpec. A
    factory's module may not say its depth and width: then one block as wide as a GPT of its size (coarse)."""
    if isinstance(model, GPTConfig):
        return count_parameters(model), model.n_layer, model.n_embd, model.block_size, model.vocab_size
    n = model.num_parameters
    return n, model.n_layer or 1, model.n_embd or int(math.sqrt(n / 12)), model.seq_len, model.vocab_size


def estimate_memory(config: Union[GPTConfig, "ModelSpec"], batch_size: int, world: int, shard: int,
                    device_type: str, activation_checkpointing: bool, mixing: bool = False,
                    sparse: bool = False) -> MemoryEstimate:
    """``batch_size``: the sequences of one forward and backward pass (the micro-batch). ``mixing``: the averager
    also keeps the stepped state (parameters and outer momenta, fp32) for mixing groups (--target-group-size).
    ``sparse`` (--compression sparse): the host keeps the error-feedback accumulator (fp32), and the averager, while
    it averages the messages, their sum, their count per entry and one decoded message (fp32 each)."""
    n, n_layer, width, seq_len, vocab_size = _shape(config)
    cuda = device_type == "cuda"
    value_bytes = 2 if cuda else 4
    rows = max(batch_size // world, 1)
    tokens = rows * seq_len
    per_block = ACTIVATION_VALUES_PER_TOKEN_AND_WIDTH * tokens * width * value_bytes
    if activation_checkpointing:
        activations = n_layer * tokens * width * value_bytes + per_block
    else:
        activations = n_layer * per_block
    logits = tokens * vocab_size * (value_bytes + 4)  # and the fp32 softmax of the loss
    bf16_copies = 2 * n if cuda else 0
    rank = int((16 * n // shard + activations + logits + bf16_copies) * FRAGMENTATION)

    snapshot = 16 * n
    host = 12 * n + 2 * snapshot + (12 * n if world > 1 else 0) + PROCESSES_BYTES + (world - 1) * RANK_PROCESS_BYTES
    if not cuda:
        host += world * rank
    state = 8 * n if mixing else 0
    host += 16 * n if sparse else 4 * n  # sparse rounds decode no butterfly outputs (mixing rounds aside)
    return MemoryEstimate(parameters=n, rank_bytes=rank, host_bytes=host + state,
                          shm_bytes=4 * n + state + 2 * snapshot)


def memory_problem(estimate: MemoryEstimate, *, device_free: Optional[int], host_free: Optional[int],
                   shm_free: Optional[int], device_name: str) -> str:
    """Why the estimate does not fit in what is free (one line naming the numbers and the fixes), or ''. None:
    not checked."""
    fixes = "use a smaller --model or --batch-size, --activation-checkpointing, or more ranks"
    if device_free is not None and estimate.rank_bytes > device_free:
        return (f"the model needs about {estimate.rank_bytes / GiB:.1f} GiB per rank but {device_name} has "
                f"{device_free / GiB:.1f} GiB free; {fixes} (or --no-memory-check to try anyway)")
    if host_free is not None and estimate.host_bytes > host_free:
        return (f"the peer needs about {estimate.host_bytes / GiB:.1f} GiB of host memory but "
                f"{host_free / GiB:.1f} GiB is available; {fixes} (or --no-memory-check to try anyway)")
    if shm_free is not None and estimate.shm_bytes > shm_free:
        return (f"the averager needs about {estimate.shm_bytes / GiB:.1f} GiB of shared memory but /dev/shm has "
                f"{shm_free / GiB:.2f} GiB free; enlarge it (docker: --shm-size or shm_size) "
                "(or --no-memory-check to try anyway)")
    return ""


def check_memory(config: Union[GPTConfig, "ModelSpec"], batch_size: int, world: int, shard: int, device: torch.device,
                 activation_checkpointing: bool, leader: bool, mixing: bool = False,
                 sparse: bool = False) -> MemoryEstimate:
    """Raise ConfigError if this rank's part of the peer will not fit; return the estimate. The leader checks the
    host and /dev/shm for the whole peer."""
    estimate = estimate_memory(config, batch_size, world, shard, device.type, activation_checkpointing, mixing,
                               sparse)
    device_free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    host_free = psutil.virtual_memory().available if leader else None
    shm_free = _free_bytes("/dev/shm") if leader else None
    problem = memory_problem(estimate, device_free=device_free, host_free=host_free, shm_free=shm_free,
                             device_name=str(device))
    if problem:
        raise ConfigError(problem)
    return estimate


def _free_bytes(path: str) -> Optional[int]:
    try:
        return shutil.disk_usage(path).free
    except OSError:  # no such mount (not Linux): nothing to check
        return None
