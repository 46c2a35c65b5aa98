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

Each setting is declared once, as a field below: its type, its default, the docstring under it (the flag's help
text), and through ``setting(...)`` its bounds or choices and its flag name when that is not the field's. ``settings()``
derives from it the TOML key, the flag, the environment variable and the checks ``validate`` runs; the CLI builds its
options from ``settings()`` (cli/options.py). That machinery is settings.py, and the checks that involve several
settings are config_checks.py: this module declares the sections, and loads and validates a RunConfig with them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

# This module imports nothing heavy (no torch, no hivemind): the CLI reads it to build --help, which must start at
# once. What it needs from the heavy modules is spelled out here; tests/unit/test_startup.py checks that they agree.

COMPRESSION_NAMES = ("none", "fp16", "bf16", "int8", "sparse")
"""averaging/compression.py's COMPRESSION_CHOICES (its butterfly codecs, then sparse), in its order"""
AGGREGATION_NAMES = ("mean", "clip", "trim", "mean+check", "clip+check", "trim+check")
"""averaging/robust.py's AGGREGATIONS: how a reducer combines its group's parts"""
NO_GROUP_POLICIES = ("apply_local", "wait")
"""diloco.NO_GROUP_POLICIES: what a peer does when nobody is there to average with"""
REACHABILITY_MODES = ("auto", "public", "client")
"""swarm/reachability.py's MODES"""
LR_SCHEDULES = ("constant", "cosine", "linear")
"""schedules.py's inner learning-rate schedules after the warm-up"""
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
"""train_loop.py's autocast modes; auto: bf16 on CUDA, fp32 on CPU"""

from p2ptrain.config_checks import check_combinations
from p2ptrain.settings import ConfigError, Setting, derive_settings, read_toml, setting


@dataclass
class SwarmConfig:
    """How this peer joins the DHT."""

    initial_peers: List[str] = setting(factory=list)
    """multiaddrs of live peers (a bootstrap peer or any worker), each ending in /p2p/<peer id>"""
    initial_peers_file: Optional[str] = setting(None, file=True)
    """a file of more initial peers, one multiaddr per line (a bootstrap peer's --maddrs-file on a shared volume);
    waited for up to bootstrap_timeout_s, so a worker may start before its bootstrap peer"""
    host_maddrs: List[str] = setting(factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    """multiaddrs to listen on; tcp/0 picks a free port"""
    announce_maddrs: List[str] = setting(factory=list)
    """multiaddrs others should dial, if not the listening ones (a public IP and a forwarded port)"""
    identity_path: Optional[str] = setting(None, flag="--identity")
    """private key file for a stable peer id; created if missing"""
    swarm_key_file: Optional[str] = setting(None, flag="--swarm-key", file=True)
    """the swarm's shared key file (p2ptrain keygen): only peers holding it take part; unset: an open swarm"""
    reachability: str = setting("auto", choices=REACHABILITY_MODES)
    """how others reach this peer: public (a full member: others dial it), client (dials out only: behind NAT
    without a forwarded port), or auto: ask an initial peer to dial this host back, then pick"""
    use_relay: bool = True
    """let libp2p circuit relays carry traffic to/from peers that cannot be dialled directly"""
    use_auto_relay: bool = False
    """look for relays and advertise relayed addresses automatically (peers behind NAT)"""
    bootstrap_timeout_s: float = setting(30.0, above=0)
    """give up joining if no initial peer answers within this many seconds"""
    relays: int = setting(4, at_least=0)
    """bootstrap peer: relay daemons it runs (a p2pd each) so that workers behind NAT can reach each other when no
    worker is public; 0 turns relaying off (fewer than 4 makes a newcomer wait 3 minutes for its relay slot)"""


def default_threads() -> int:
    """The CPU cores this process may use (its affinity mask: a container's or taskset's cpuset, else every core):
    what a worker should give torch when ``train.threads`` is unset. K workers sharing one host should each get
    about cores/K instead (``--threads 4`` for 4 workers on 16 cores): more threads than cores slow every one down."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no sched_getaffinity (macOS, Windows)
        return max(1, os.cpu_count() or 1)


@dataclass
class DiLoCoConfig:
    """The DiLoCo optimizer: inner AdamW, outer SGD with Nesterov momentum, averaging."""

    local_steps: int = setting(500, at_least=1)
    """H: inner steps between syncs; more means less communication and more drift between peers"""
    inner_lr: float = setting(4e-4, above=0)
    """AdamW learning rate"""
    inner_weight_decay: float = setting(0.1, at_least=0)
    """AdamW weight decay"""
    inner_betas: List[float] = setting(factory=lambda: [0.9, 0.95], at_least=0, below=1)
    """AdamW's two betas"""
    outer_lr: float = setting(0.7, above=0)
    """outer SGD (Nesterov) learning rate (0.7 in the DiLoCo paper)"""
    outer_momentum: float = setting(0.9, at_least=0, below=1)
    """outer Nesterov momentum"""
    compression: str = setting("fp16", choices=COMPRESSION_NAMES)
    """pseudo-gradients on the wire: "fp16" (half the bytes), "bf16" (half, fp32's range, coarser), "int8" (a
    quarter, per-block scales, with error feedback), "none" (fp32), or "sparse" (SparseLoCo: each peer sends the
    top sparse_k of every 4096 values of its decayed error-feedback accumulator in 2 bits, 2.8% of fp16's bytes at
    k = 128; the outer step is plain SGD at sparse_outer_lr, outer_lr and outer_momentum are not used; sync more
    often with it, e.g. H = 15-50; docs/streaming-and-sparse.md, "Sparse 2-bit messages")"""
    aggregation: str = setting("mean", choices=AGGREGATION_NAMES)
    """how each reducer combines its group's pseudo-gradients: "mean" (weighted by samples), "clip" (centered
    clipping: one insider moves the result by a bounded step, and an honest group gets its mean) or "trim" (the
    coordinate-wise trimmed mean, which also drops honest values); needs groups of 3 or more to do anything, and a
    butterfly codec (not sparse). "+check" (e.g. "trim+check") also convicts a sender whose pseudo-gradient points
    away from the others' or is far larger, 3 rounds in a row, in groups of 4 or more (docs/security.md, "Catching a
    poisoning sender"). Every peer of a run must agree (docs/security.md, "Robust aggregation")"""
    audit_parts: int = setting(1, at_least=0)
    """parts of other reducers' ranges this peer recomputes after each round from their inputs (audit: a reducer that
    signed a wrong average is excluded, swarm-wide where the proof fits in the DHT); 0 turns audits off. Each costs
    about group size x 512 KiB of download (docs/security.md, "Verifying reducers")"""
    replay_rate: float = setting(0.0, at_least=0)
    """the replay check: the chance that this peer redoes each other sender's phase of a round from the claim it
    gathered (its inner optimizer's state and data position at the phase's start) and compares the pseudo-gradient
    with the one it sent; a sender more than 1% of its norm off is excluded by every member of its group from the
    round after next. Costs this peer rate x (group size - 1) phases of compute a round; 0 turns it off, and then no
    peer gathers claims. Blocking sync with a butterfly codec only; every peer of a run must agree
    (docs/security.md, "Replaying a sender's work")"""
    sparse_k: int = setting(128, at_least=1, below=4097)
    """--compression sparse: values each peer sends of every chunk of 4096 (a 64x64 tile, or a run of the flattened
    tensor); 128: SparseLoCo's reference setting. Every peer of a run must agree"""
    sparse_decay: float = setting(0.95, at_least=0, below=1)
    """--compression sparse: the error-feedback accumulator's decay per sync (e <- decay * e + pseudo-gradient)"""
    sparse_outer_lr: float = setting(1.0, above=0)
    """--compression sparse: the outer SGD's learning rate on the averaged messages (no momentum: the decayed
    accumulator takes its place)"""
    fragments: int = setting(1, at_least=1)
    """streaming sync: cut the parameters into this many fragments (runs of consecutive layers of about equal size),
    each averaged at its own inner step of the phase while training goes on, so a peer sends about 1/fragments of
    the model at a time (docs/streaming-and-sparse.md, "Streaming sync"); 1: all at once. Every peer of a run
    must agree"""
    overlap_steps: int = setting(0, at_least=0)
    """streaming sync: inner steps that go on while a fragment's round runs before its average is applied (tau in
    Streaming DiLoCo); 0: training waits for each round. At most local_steps // fragments - 1"""
    merge_alpha: float = setting(0.5, at_least=0)
    """streaming sync with overlap_steps > 0: when a fragment's average is applied, the share of the model's own
    values of it (trained on during the overlap) kept: local = alpha x local + (1 - alpha) x global (the Streaming
    DiLoCo paper's mixing factor, 0.5; 0 drops the overlap's local progress), at most 1"""
    max_extra_steps: Optional[int] = setting(None, at_least=0)
    """streaming sync: when a fragment's round is still running at its apply step (a peer of the group launched it
    later), take up to this many inner steps per phase beyond the schedule instead of idling; they do not move the
    local step (the swarm's clock) and their samples weigh in this peer's next pseudo-gradients. Unset: local_steps
    // 2; 0: wait for the round"""
    adaptive_steps: bool = True
    """a worker persistently slower than the fastest live peer (an inner step 1.15x as long or more) takes fewer inner
    steps per phase, H over that ratio (its local step advances by 1 or 2 or more a step), so it reaches each sync
    with the others instead of holding them up or being left out; its pseudo-gradient is weighted by the samples it
    trained on"""
    matchmaking_time_s: float = setting(5.0, above=0)
    """seconds a round looks for peers beyond those the live peers' progress records announce (a round whose
    announced peers are all in starts at once); raise it on slow links or if groups split"""
    late_peer_wait_s: Optional[float] = setting(None, at_least=0)
    """seconds a round waits for live peers of its outer step still in their inner steps, once another peer is
    ready; unset: this peer's last inner phase / the peers expected (the break-even between idling the ready
    peers and throwing the late one's phase away), at least matchmaking_time_s. A peer alone at the sync
    point waits for the others while they make progress (a solo step would waste their inner steps)"""
    averaging_timeout_s: float = setting(60.0, above=0)
    """seconds the all-reduce may take once a group formed; raise it for big models on slow links"""
    min_group_size: int = setting(2, at_least=1)
    """a round needs at least this many peers"""
    target_group_size: Optional[int] = setting(None, at_least=1)
    """at most this many peers per group; unset: every live peer of the round's outer step. The swarm's first
    round waits up to 30 s for this many peers, as peers started together arrive seconds apart. Below the swarm's
    size, the groups change every round and average the parameters too where their members differ (mixing groups,
    docs/rounds.md), at 4x the bytes of an fp16 round then"""
    no_group_policy: str = setting("apply_local", choices=NO_GROUP_POLICIES)
    """when no group forms: "apply_local" (own pseudo-gradient, only when no other live peer is at this outer
    step or those that are refuse to group) or "wait" (look again until a group forms)"""
    lr_schedule: str = setting("constant", choices=LR_SCHEDULES)
    """the inner learning rate after the warm-up: constant, or a cosine or linear decay to min_lr_ratio x inner_lr
    at total_steps. It follows the swarm's inner step count, which newcomers take with the state, so every peer is
    at the same point of it"""
    warmup_steps: int = setting(0, at_least=0)
    """inner steps (the swarm's count) of linear inner learning-rate warm-up from 0"""
    total_steps: Optional[int] = setting(None, at_least=1)
    """inner steps (the swarm's count) at which a cosine or linear schedule reaches its end; it stays there after"""
    min_lr_ratio: float = setting(0.1, at_least=0, below=1)
    """the inner learning rate at the end of a cosine or linear schedule, as a fraction of inner_lr"""
    outer_warmup_steps: int = setting(0, at_least=0)
    """outer steps of linear outer learning-rate warm-up (outer_lr x (outer step + 1) / this)"""


@dataclass
class TrainConfig:
    """The local training loop of a worker."""

    model: str = "tiny"
    """the model: a built-in size (tiny, small, 124m), a folder with a Hugging Face config.json (a fresh model; with
    weights beside it, continued pretraining), a Hugging Face hub id (hosts with internet), or package.module:factory
    (a function returning a torch.nn.Module; see docs/MODELS.md)"""
    tokenizer: Optional[str] = None
    """a Hugging Face tokenizer folder or hub id, or "bytes" (one token per byte); unset: the model folder's own
    tokenizer if it has one, else bytes"""
    text_field: str = "text"
    """the field of each record that holds its text, in .jsonl, .parquet and .arrow data and Hugging Face datasets"""
    seq_len: Optional[int] = setting(None, at_least=2)
    """tokens per training sequence; unset: the built-in model's block size, or a Hugging Face model's context length
    up to 1024"""
    data_cache: Optional[str] = None
    """folder where tokenized data is cached (reused by later runs on the same data and tokenizer); unset:
    ~/.cache/p2ptrain/tokens"""
    batch_size: int = setting(16, at_least=1)
    """sequences per inner step"""
    micro_batch_size: Optional[int] = setting(None, at_least=1)
    """sequences per forward and backward pass: an inner step accumulates the gradients of batch_size /
    micro_batch_size of them (less memory, the same step); unset: the whole batch at once"""
    grad_clip: Optional[float] = setting(None, above=0)
    """clip the gradient's global norm to this before each inner step; unset: no clipping"""
    precision: str = setting("auto", choices=PRECISIONS)
    """autocast: bf16, fp16 (with a gradient scaler), fp32, or auto (bf16 on CUDA, fp32 on CPU); parameters, the
    optimizers and the sync stay fp32"""
    throttle: float = setting(1.0, at_least=1)
    """make this worker this many times slower: after each inner step it sleeps (throttle - 1) x that step's compute
    time, counted as compute (a test and benchmark hook for peers of different speeds); 1: full speed"""
    compile: bool = False
    """compile the model with torch.compile (faster steps after a slower first one)"""
    seed: int = 0
    """model initialisation seed; every peer of a run must use the same one"""
    data: List[str] = setting(factory=list)
    """what to train on: .txt, .jsonl, .parquet or .arrow files, folders of them, or a Hugging Face dataset name
    (hosts with internet); empty: the built-in corpus"""
    num_shards: int = setting(16, at_least=1)
    """the training text is cut into this many disjoint shards; peers claim different ones"""
    shard_index: Optional[int] = setting(None, at_least=0)
    """train on this shard; unset: claim a free one through the DHT"""
    shard_size: Optional[int] = setting(None, at_least=1)
    """with several ranks per peer (join --nproc-per-node): ranks that shard the model (FSDP2); the rest replicate
    it (HSDP). Unset: all ranks shard"""
    activation_checkpointing: bool = False
    """recompute each block's activations in the backward pass instead of keeping them: less memory, ~1/3 more
    compute"""
    memory_check: bool = True
    """at start-up, refuse to train when the estimated memory (per rank, host, /dev/shm) exceeds what is free"""
    device: str = "auto"
    """the device to train on: auto, cpu, cuda or cuda:N (bf16 autocast on CUDA)"""
    max_outer_steps: Optional[int] = setting(None, at_least=1)
    """leave cleanly after taking part in this many syncs (rounds this peer averaged in, or stepped alone in; taking
    the swarm's state after it was left out of a round is not one), wherever the swarm was when it joined; unset:
    no limit"""
    until_outer_step: Optional[int] = setting(None, at_least=1, fix="it is the run's outer step to stop at "
                                                                    "(--max-outer-steps counts this peer's syncs instead)")
    """leave cleanly once the swarm's outer step that this peer holds reaches this number (an absolute step of the
    run: a peer that joins or resumes at or past it leaves without training); unset: no limit"""
    wait_for_peers: Optional[int] = setting(None, at_least=1)
    """start training only once this many peers of the run (this one included) are ready to train, for a fleet
    started together: its first round then draws its groups from all of them, instead of forming without the ones
    still starting up; unset: train at once"""
    eval_batches: int = setting(8, at_least=1)
    """held-out batches for the eval loss, measured at start and after every sync"""
    eval_every: Optional[int] = setting(None, at_least=1)
    """also measure the held-out loss and perplexity every this many inner steps; unset: only at start and after
    every sync"""
    log_interval_s: float = 10.0
    """seconds between log lines"""
    threads: Optional[int] = setting(None, at_least=1)
    """CPU threads for torch; unset: the cores this process may use. When K workers share one host, give each about
    cores/K (e.g. 4 for 4 workers on 16 cores)"""
    checkpoint_dir: Optional[str] = None
    """write <run_id>.pt here atomically every checkpoint_every syncs and at exit; unset: no checkpoints"""
    checkpoint_every: int = setting(10, at_least=1)
    """syncs between checkpoints"""


@dataclass
class ObserveConfig:
    """What a daemon shows of itself besides its log: Prometheus metrics and training loggers (p2ptrain/observe)."""

    metrics_port: Optional[int] = setting(None, at_least=0, below=65536)
    """serve Prometheus metrics at http://<metrics_host>:<port>/metrics (0: a free port, logged); unset: off. Needs
    pip install 'p2ptrain[metrics]'"""
    metrics_host: str = "127.0.0.1"
    """the address the metrics endpoint binds to: 127.0.0.1 (this host only) or 0.0.0.0 (every interface, for a
    Prometheus server elsewhere)"""
    log_to: List[str] = setting(factory=list)
    """also log training scalars (loss, learning rates, eval loss, sync time and bytes) to tensorboard:DIR or
    wandb[:PROJECT] (offline without an API key); each needs its extra: pip install 'p2ptrain[tensorboard]' or
    'p2ptrain[wandb]'"""


@dataclass
class RunConfig:
    run_id: str = "p2ptrain"
    """the training run's name: it namespaces every DHT key of the run, so its peers must share it"""
    swarm: SwarmConfig = field(default_factory=SwarmConfig)
    diloco: DiLoCoConfig = field(default_factory=DiLoCoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    observe: ObserveConfig = field(default_factory=ObserveConfig)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = {"swarm": SwarmConfig, "diloco": DiLoCoConfig, "train": TrainConfig, "observe": ObserveConfig}


@functools.lru_cache(maxsize=None)
def settings() -> Tuple[Setting, ...]:
    """Every setting of a RunConfig, in the order of the fields: run_id, then [swarm], [diloco], [train]."""
    return derive_settings(RunConfig, SECTIONS)


# ----------------------------------------------------------------------------------------- load and validate


def load_config(path: Optional[str | Path] = None, overrides: Optional[Dict[str, Any]] = None) -> RunConfig:
    """Defaults, then the TOML file at ``path``, then ``overrides`` ({"diloco.local_steps": 20, "run_id": ...})."""
    config = RunConfig()
    if path is not None:
        _apply(config, read_toml(Path(path)), source=str(path))
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
    if section and section not in SECTIONS:
        raise ConfigError(f"{source}: unknown section [{section}]; sections are {', '.join(SECTIONS)}")
    where = f"{section}.{name}" if section else name
    known = {s.key: s for s in settings() if s.key.rpartition(".")[0] == section}
    if where not in known:
        names = ", ".join(key.rpartition(".")[2] for key in known)
        raise ConfigError(f"{source}: unknown setting {where!r}; known settings here: {names}")
    setattr(getattr(config, section) if section else config, name, known[where].coerce(value, source))


def validate(config: RunConfig) -> None:
    """Raise ConfigError for values that cannot work, naming the setting and the fix: first each setting's declared
    bounds and choices, then what involves several settings or another module."""
    for s in settings():
        section, _, name = s.key.rpartition(".")
        problem = s.problem(getattr(getattr(config, section) if section else config, name))
        if problem:
            raise ConfigError(problem)
    check_combinations(config)
