"""What a run config may not be: the checks that involve several settings or another module (each setting's own
bounds and choices are its ``Setting``'s), and the one-value checks the CLI also runs on its own (addresses, model
sources, dataset names). Each problem is one line that names the setting and the fix.

It imports nothing heavy (no torch, no hivemind): the CLI reads it to build --help, which must start at once.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional, Sequence

from p2ptrain.fragments import check_schedule  # light: no torch
from p2ptrain.hivemind_compat import multiaddr_class  # light: hivemind's address parser without hivemind itself
from p2ptrain.model_config import MODEL_SIZES  # light: the built-in shapes, without torch
from p2ptrain.settings import ConfigError

MAX_RUN_ID_CHARS = 64
"""a run id is part of every record peers store (swarm/pipe.py: RECORD_MAX_BYTES bounds them)"""


def multi_rank_problem(train, nproc: int) -> str:
    """Why this training config (``RunConfig.train``) cannot run as a peer of ``nproc`` ranks, or an empty string."""
    if train.batch_size % nproc:
        return f"--batch-size {train.batch_size} does not split over {nproc} ranks; use a multiple of {nproc}"
    if train.shard_size is not None and nproc % train.shard_size:
        return f"--shard-size {train.shard_size} does not divide --nproc-per-node {nproc}; use a divisor"
    return ""


def check_maddrs(maddrs: Sequence[str], option: str, *, need_peer_id: bool = False) -> None:
    """Raise ValueError naming ``option`` for an address that is not a multiaddr (or lacks /p2p/<id>)."""
    multiaddr = multiaddr_class()
    for maddr in maddrs:
        try:
            parsed = multiaddr(maddr)
        except Exception:
            raise ValueError(
                f"{option}: {maddr!r} is not a multiaddr; write it like /ip4/203.0.113.7/tcp/31337/p2p/Qm..."
            ) from None
        if need_peer_id and "p2p" not in [proto.name for proto in parsed.protocols()]:
            raise ValueError(
                f"{option}: {maddr!r} has no /p2p/<peer id> part; copy the full address the peer printed at start"
            )


def check_combinations(config) -> None:
    """Raise ConfigError for what involves several settings of ``config`` (a RunConfig) or another module, naming the
    settings and the fix (``validate`` has checked each setting's own bounds and choices first)."""
    d, t, s = config.diloco, config.train, config.swarm

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    need(bool(config.run_id) and "." not in config.run_id and " " not in config.run_id
         and len(config.run_id) <= MAX_RUN_ID_CHARS,
         f"run_id {config.run_id[:80]!r}{'...' if len(config.run_id) > 80 else ''} must be 1-{MAX_RUN_ID_CHARS} "
         "characters without dots or spaces; e.g. --run-id exp1")
    need(len(d.inner_betas) == 2, f"diloco.inner_betas must be two numbers in [0, 1), got {d.inner_betas}")
    need(d.target_group_size is None or d.target_group_size >= d.min_group_size,
         "diloco.target_group_size must be at least diloco.min_group_size")
    need(d.compression != "sparse" or d.target_group_size is None,
         "--compression sparse averages the whole swarm in one group: drop --target-group-size (to wait for N peers "
         "before the first round, use --wait-for-peers N)")
    need(d.compression != "sparse" or d.aggregation == "mean",
         f"--aggregation {d.aggregation} needs a butterfly codec: the sparse all-gather averages every message on every "
         "member; use --compression fp16 with it, or --aggregation mean")
    need(d.replay_rate <= 1, f"diloco.replay_rate {d.replay_rate} is a chance: use a number in [0, 1]")
    need(d.replay_rate == 0 or (d.compression != "sparse" and d.fragments == 1 and d.overlap_steps == 0),
         "--replay-rate replays a blocking sync's pseudo-gradients: use it with --fragments 1, --overlap-steps 0 and "
         "a butterfly codec (not --compression sparse)")
    need(d.replay_rate == 0 or t.precision != "fp16",
         "--replay-rate cannot redo fp16 steps (the gradient scaler skips some); use --precision bf16 or fp32")
    need(t.shard_index is None or t.shard_index < t.num_shards,
         f"train.shard_index {t.shard_index} must be in [0, {t.num_shards}); or leave it unset to claim one")
    need(t.device in ("auto", "cpu", "cuda") or t.device.startswith("cuda:"),
         f"train.device {t.device!r} is unknown; use auto, cpu, cuda or cuda:N")
    try:
        check_maddrs(s.initial_peers, "--initial-peers", need_peer_id=True)
        check_maddrs(s.host_maddrs, "--host-maddrs")
        check_maddrs(s.announce_maddrs, "--announce-maddrs")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    need(t.micro_batch_size is None or t.batch_size % t.micro_batch_size == 0,
         f"train.micro_batch_size {t.micro_batch_size} must divide train.batch_size {t.batch_size}; e.g. "
         f"--micro-batch-size {_largest_divisor(t.batch_size, t.micro_batch_size)}")
    need(d.lr_schedule == "constant" or d.total_steps is not None,
         f"diloco.lr_schedule {d.lr_schedule!r} needs diloco.total_steps: the inner step at which it ends "
         "(--total-steps)")
    need(d.total_steps is None or d.total_steps > d.warmup_steps,
         f"diloco.total_steps {d.total_steps} must be above diloco.warmup_steps {d.warmup_steps}")
    try:
        check_schedule(d.local_steps, d.fragments, d.overlap_steps, d.merge_alpha)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    problem = model_source_problem(t.model)
    need(not problem, problem)
    from p2ptrain.observe.log_targets import LogToError, parse_log_to  # light: parsing only

    for spec in config.observe.log_to:
        try:
            parse_log_to(spec)
        except LogToError as e:
            raise ConfigError(str(e)) from None


def _largest_divisor(n: int, at_most: Optional[int]) -> int:
    return max(k for k in range(1, min(n, at_most or n) + 1) if n % k == 0)


FACTORY_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
"""package.module:function"""
HUB_ID_PATTERN = re.compile(r"^[\w.-]+/[\w.-]+$")
"""a Hugging Face hub id: owner/name (the hub's bare legacy names have owner/name aliases: openai-community/gpt2)"""

DATA_SUFFIXES = (".txt", ".jsonl", ".parquet", ".arrow")
"""the files --data reads (tokens/documents.py)"""
_HUB_DATASET = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_hub_dataset(value: str) -> bool:
    """Whether a --data value that is no file or folder here names a Hugging Face dataset (owner/name) rather than a
    missing file: ``./nope.txt`` and ``data/train.jsonl`` are files that are not there."""
    return bool(_HUB_DATASET.fullmatch(value)) and Path(value).suffix not in DATA_SUFFIXES


def model_kind(model: str) -> str:
    """What --model names: "builtin", "factory" (package.module:function), "hf_dir" (an existing folder) or "hub"
    (anything else shaped like a hub id). Cheap: no import, at most a stat."""
    if model in MODEL_SIZES:
        return "builtin"
    if FACTORY_PATTERN.match(model):
        return "factory"
    if os.path.isdir(os.path.expanduser(model)):
        return "hf_dir"
    return "hub"


def model_source_problem(model: str) -> str:
    """Why --model cannot name a model (one line, with the fix), or ''."""
    sizes = ", ".join(MODEL_SIZES)
    kind = model_kind(model)
    path = Path(os.path.expanduser(model))
    if kind == "hf_dir" and not (path / "config.json").is_file():
        return (f"--model {model}: the folder has no config.json; point --model at a Hugging Face model folder "
                f"(config.json, and weights to continue from), or use a built-in size ({sizes})")
    if kind == "hub" and (path.exists() or not HUB_ID_PATTERN.match(model)):
        what = "is a file, not a folder" if path.is_file() else "is unknown"
        return (f"train.model {model!r} {what}; use a built-in size ({sizes}), a Hugging Face model folder, a hub "
                "id (owner/name) or package.module:factory")
    return ""
