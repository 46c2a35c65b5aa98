"""Run configuration: one dataclass per component, loaded from TOML, overridden by flags, validated.

A config file mirrors the dataclasses::

    run_id = "exp1"

    [swarm]
    initial_peers = ["/ip4/203.0.113.7/tcp/31337/p2p/Qm..."]

    [diloco]
    local_steps = 500

    [train]
    model = "small"

Precedence, highest first: command-line flag, P2PTRAIN_* environment variable, config file, default.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

# This module imports nothing heavy (no torch, no hivemind): the CLI reads it to build --help, which must start at
# once. What it needs from the heavy modules is spelled out here; tests/unit/test_config.py checks that they agree.

COMPRESSION_NAMES = ("none", "fp16", "bf16", "int8")
"""the codecs of averaging/compression.py's COMPRESSIONS, in its order"""
NO_GROUP_POLICIES = ("apply_local", "wait")
"""diloco.NO_GROUP_POLICIES: what a peer does when nobody is there to average with"""

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass
class SwarmConfig:
    """How this peer joins the DHT."""

    initial_peers: List[str] = field(default_factory=list)
    """multiaddrs of live peers (a bootstrap peer or any worker), each ending in /p2p/<peer id>"""
    initial_peers_file: Optional[str] = None
    """a file of more initial peers, one multiaddr per line (a bootstrap peer's --maddrs-file on a shared volume);
    waited for up to bootstrap_timeout_s, so a worker may start before its bootstrap peer"""
    host_maddrs: List[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    """where to listen; tcp/0 picks a free port"""
    announce_maddrs: List[str] = field(default_factory=list)
    """addresses others should dial, if not the listening ones (public IP behind port forwarding)"""
    identity_path: Optional[str] = None
    """private key file for a stable peer id; created if missing"""
    reachability: str = "auto"
    """public (a full member: others dial it), client (dials out only: behind NAT without a forwarded port), or
    auto: ask an initial peer to dial this host back and pick (swarm/reachability.py)"""
    use_relay: bool = True
    """let libp2p circuit relays carry traffic to/from peers that cannot be dialled directly"""
    use_auto_relay: bool = False
    """look for relays and advertise relayed addresses automatically (peers behind NAT)"""
    bootstrap_timeout_s: float = 30.0
    """give up joining if no initial peer answers within this time"""
    swarm_key_file: Optional[str] = None
    """the swarm's shared key (``p2ptrain keygen``): only peers holding it take part; None: an open swarm"""


def default_threads() -> int:
    """The CPU cores this process may use (its affinity mask: a container's or taskset's cpuset, else every core):
    what a worker should give torch when ``train.threads`` is unset. K workers sharing one host should each get
    about cores/K instead (``--threads 4`` for 4 workers on 16 cores): more threads than cores slow every one down."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return max(1, os.cpu_count() or 1)


class ConfigError(ValueError):
    """A bad config value or file; the message names the field and the fix."""


@dataclass
class DiLoCoConfig:
    """The DiLoCo optimizer: inner AdamW, outer SGD with Nesterov momentum, averaging."""

    local_steps: int = 500
    """H: inner steps between syncs; more means less communication and more drift between peers"""
    inner_lr: float = 4e-4
    """AdamW learning rate"""
    inner_weight_decay: float = 0.1
    inner_betas: List[float] = field(default_factory=lambda: [0.9, 0.95])
    outer_lr: float = 0.7
    """outer SGD learning rate (0.7 in the DiLoCo paper)"""
    outer_momentum: float = 0.9
    """outer Nesterov momentum"""
    compression: str = "fp16"
    """pseudo-gradients on the wire: "fp16" (half the bytes), "bf16" (half, fp32's range, coarser), "int8" (a
    quarter, per-block scales, with error feedback) or "none" (fp32)"""
    matchmaking_time_s: float = 5.0
    """how long a round looks for peers beyond those the live peers' progress records announce (a round whose
    announced peers are all in starts at once); raise it on slow links or if groups split"""
    late_peer_wait_s: Optional[float] = None
    """how long a round waits for live peers of its outer step still in their inner steps, once another peer is
    ready; unset: this peer's last inner phase / the peers expected (the break-even between idling the ready
    peers and throwing the late one's phase away), at least matchmaking_time_s. A peer alone at the sync
    point waits for the others while they make progress (a solo step would waste their inner steps)"""
    averaging_timeout_s: float = 60.0
    """how long the all-reduce may take once a group formed; raise it for big models on slow links"""
    min_group_size: int = 2
    """a round needs at least this many peers"""
    target_group_size: Optional[int] = None
    """at most this many peers per group; unset: every live peer of the round's outer step"""
    no_group_policy: str = "apply_local"
    """when no group forms: "apply_local" (own pseudo-gradient, only when no other live peer is at this outer
    step or those that are refuse to group) or "wait" (look again until a group forms)"""


@dataclass
class TrainConfig:
    """The local training loop of a worker."""

    model: str = "tiny"
    """built-in model size: tiny, small, 124m"""
    batch_size: int = 16
    """sequences per inner step"""
    seed: int = 0
    """model initialisation seed; every peer of a run must use the same one"""
    data: List[str] = field(default_factory=list)
    """text files or folders of .txt files to train on; empty: the built-in corpus"""
    num_shards: int = 16
    """the training text is cut into this many disjoint shards; peers claim different ones"""
    shard_index: Optional[int] = None
    """train on this shard; unset: claim a free one through the DHT"""
    shard_size: Optional[int] = None
    """with several ranks per peer (join --nproc-per-node): ranks that shard the model (FSDP2); the rest replicate
    it (HSDP). Unset: all ranks shard"""
    activation_checkpointing: bool = False
    """recompute each block's activations in the backward pass instead of keeping them: less memory, ~1/3 more
    compute"""
    memory_check: bool = True
    """at start-up, refuse to train when the estimated memory (per rank, host, /dev/shm) exceeds what is free"""
    device: str = "auto"
    """auto, cpu or cuda (bf16 autocast on CUDA)"""
    max_outer_steps: Optional[int] = None
    """leave cleanly after taking part in this many syncs (rounds this peer averaged in, or stepped alone in; taking
    the swarm's state after it was left out of a round is not one), wherever the swarm was when it joined; unset:
    no limit"""
    until_outer_step: Optional[int] = None
    """leave cleanly once the swarm's outer step that this peer holds reaches this number (an absolute step of the
    run: a peer that joins or resumes at or past it leaves without training); unset: no limit"""
    eval_batches: int = 8
    """held-out batches for the eval loss, measured at start and after every sync"""
    log_interval_s: float = 10.0
    """seconds between log lines"""
    threads: Optional[int] = None
    """torch CPU threads; unset: the cores this process may use (config.default_threads()). When K workers share
    one host, give each about cores/K (e.g. 4 for 4 workers on 16 cores)"""
    checkpoint_dir: Optional[str] = None
    """write <run_id>.pt here atomically every checkpoint_every syncs and at exit; unset: no checkpoints"""
    checkpoint_every: int = 10
    """syncs between checkpoints"""


@dataclass
class RunConfig:
    run_id: str = "p2ptrain"
    """namespaces every DHT key of a training run; peers of one run must share it"""
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {"swarm": SwarmConfig, "diloco": DiLoCoConfig, "train": TrainConfig}


def load_config(path: Optional[str | Path] = None, overrides: Optional[Dict[str, Any]] = None) -> RunConfig:
    """Defaults, then the TOML file at ``path``, then ``overrides`` ({"diloco.local_steps": 20, "run_id": ...})."""
    config = RunConfig()
    if path is not None:
        _apply(config, _read_toml(Path(path)), source=str(path))
    for dotted, value in (overrides or {}).items():
        section, _, name = dotted.rpartition(".")
        _set(config, section, name, value, source="command line")
    config.train.checkpoint_dir = expand_hostname(config.train.checkpoint_dir)
    validate(config)
    return config


def expand_hostname(path: Optional[str]) -> Optional[str]:
    """``{hostname}`` in a path becomes this host's name: peers that share a volume (containers of one compose
    service) each keep their files apart, and a restarted container finds its own again. None stays None."""
    return path.replace("{hostname}", socket.gethostname()) if path else path


def _read_toml(path: Path) -> Dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist; pass an existing TOML file to --config")
    try:
        return tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid TOML ({e}); fix the syntax at that spot") from None


def _apply(config: RunConfig, table: Dict[str, Any], source: str) -> None:
    for key, value in table.items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: [{key}] must be a table")
            for name, item in value.items():
                _set(config, key, name, item, source)
        else:
            _set(config, "", key, value, source)


def _set(config: RunConfig, section: str, name: str, value: Any, source: str) -> None:
    target = getattr(config, section) if section else config
    if section and section not in SECTIONS:
        raise ConfigError(f"{source}: unknown section [{section}]; sections are {', '.join(SECTIONS)}")
    fields = {f.name: f for f in dataclasses.fields(target)}
    where = f"{section}.{name}" if section else name
    if name not in fields or (not section and name in SECTIONS):
        known = ", ".join(f for f in fields if f not in SECTIONS)
        raise ConfigError(f"{source}: unknown setting {where!r}; known settings here: {known}")
    setattr(target, name, _coerce(fields[name], value, where, source))


def _coerce(f: dataclasses.Field, value: Any, where: str, source: str) -> Any:
    """Check a value against the field's declared type, with the one-line message the user needs."""
    kind = str(f.type)
    if value is None:
        if "Optional" in kind:
            return None
        raise ConfigError(f"{source}: {where} cannot be empty")
    if kind.startswith("List"):
        if isinstance(value, (str, int, float)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{source}: {where} must be a list, got {value!r}")
        return list(value)
    expected = {"int": int, "float": float, "str": str, "bool": bool}
    for name, typ in expected.items():
        if name in kind:
            if typ is float and isinstance(value, int) and not isinstance(value, bool):
                return float(value)
            if typ is not bool and isinstance(value, bool) or not isinstance(value, typ):
                raise ConfigError(f"{source}: {where} must be {'a' if name != 'int' else 'an'} {name}, got {value!r}")
            return value
    return value


def validate(config: RunConfig) -> None:
    """Raise ConfigError for values that cannot work, naming the setting and the fix."""
    d, t, s = config.diloco, config.train, config.swarm

    def need(ok: bool, message: str) -> None:
        if not ok:
            raise ConfigError(message)

    need(bool(config.run_id) and "." not in config.run_id and " " not in config.run_id,
         f"run_id {config.run_id!r} must be non-empty without dots or spaces; e.g. --run-id exp1")
    need(d.local_steps >= 1, f"diloco.local_steps must be at least 1, got {d.local_steps}")
    need(d.inner_lr > 0 and d.outer_lr > 0, "diloco.inner_lr and diloco.outer_lr must be positive")
    need(0 <= d.outer_momentum < 1, f"diloco.outer_momentum must be in [0, 1), got {d.outer_momentum}")
    need(len(d.inner_betas) == 2 and all(0 <= b < 1 for b in d.inner_betas),
         f"diloco.inner_betas must be two numbers in [0, 1), got {d.inner_betas}")
    need(d.compression in COMPRESSION_NAMES,
         f"diloco.compression {d.compression!r} is unknown; use one of: {', '.join(COMPRESSION_NAMES)}")
    need(d.matchmaking_time_s > 0 and math.isfinite(d.matchmaking_time_s),
         f"diloco.matchmaking_time_s must be a positive number of seconds, got {d.matchmaking_time_s}")
    need(d.late_peer_wait_s is None or (d.late_peer_wait_s >= 0 and math.isfinite(d.late_peer_wait_s)),
         f"diloco.late_peer_wait_s must be a non-negative number of seconds, got {d.late_peer_wait_s}")
    need(d.averaging_timeout_s > 0, f"diloco.averaging_timeout_s must be positive, got {d.averaging_timeout_s}")
    need(d.min_group_size >= 1, f"diloco.min_group_size must be at least 1, got {d.min_group_size}")
    need(d.target_group_size is None or d.target_group_size >= d.min_group_size,
         "diloco.target_group_size must be at least diloco.min_group_size")
    need(d.no_group_policy in NO_GROUP_POLICIES,
         f"diloco.no_group_policy {d.no_group_policy!r} is unknown; use one of: {', '.join(NO_GROUP_POLICIES)}")
    need(t.batch_size >= 1, f"train.batch_size must be at least 1, got {t.batch_size}")
    need(t.num_shards >= 1, f"train.num_shards must be at least 1, got {t.num_shards}")
    need(t.shard_size is None or t.shard_size >= 1, f"train.shard_size must be at least 1, got {t.shard_size}")
    need(t.shard_index is None or 0 <= t.shard_index < t.num_shards,
         f"train.shard_index {t.shard_index} must be in [0, {t.num_shards}); or leave it unset to claim one")
    need(t.device in ("auto", "cpu", "cuda") or t.device.startswith("cuda:"),
         f"train.device {t.device!r} is unknown; use auto, cpu, cuda or cuda:N")
    need(t.max_outer_steps is None or t.max_outer_steps >= 1,
         f"train.max_outer_steps must be at least 1, got {t.max_outer_steps}")
    need(t.until_outer_step is None or t.until_outer_step >= 1,
         f"train.until_outer_step must be at least 1, got {t.until_outer_step}; it is the run's outer step to stop "
         "at (--max-outer-steps counts this peer's syncs instead)")
    need(t.checkpoint_every >= 1, f"train.checkpoint_every must be at least 1, got {t.checkpoint_every}")
    need(t.eval_batches >= 1, f"train.eval_batches must be at least 1, got {t.eval_batches}")
    need(s.reachability in ("auto", "public", "client"),
         f"swarm.reachability {s.reachability!r} is unknown; use one of: auto, public, client")
    need(s.bootstrap_timeout_s > 0, f"swarm.bootstrap_timeout_s must be positive, got {s.bootstrap_timeout_s}")
    from p2ptrain.swarm.dht import check_maddrs  # late: it parses with hivemind's multiaddr, which loads torch

    try:
        check_maddrs(s.initial_peers, "--initial-peers", need_peer_id=True)
        check_maddrs(s.host_maddrs, "--host-maddrs")
        check_maddrs(s.announce_maddrs, "--announce-maddrs")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    from p2ptrain.model import MODEL_SIZES  # late: the model module pulls in nothing the config needs otherwise

    need(t.model in MODEL_SIZES, f"train.model {t.model!r} is unknown; use one of: {', '.join(MODEL_SIZES)}")
