"""DiLoCo for a peer whose model is sharded over its local ranks with FSDP2 (``fully_shard`` on an HSDP mesh).

Inside the peer, every rank trains its shards with an ordinary inner optimizer (FSDP2 all-gathers a block's
parameters for its forward and backward and reduce-scatters the gradients). Across peers the peer is one member
of the swarm: only the leader (rank 0) has a DHT identity and a ``DiLoCoOptimizer``. Every ``local_steps`` steps:

1. every rank all-gathers the full parameters, one tensor at a time; the leader copies each into its *proxy*, a
   full fp32 CPU copy of the model (the other ranks drop it at once), and the inner AdamW moments the same way
   into the proxy's optimizer state, which is what the leader serves to newcomers;
2. the leader's ``DiLoCoOptimizer`` syncs over the proxy as over any model: pseudo-gradient = its global copy minus
   the proxy, average with the swarm, outer step; the proxy becomes the new global parameters;
3. the leader broadcasts the new global parameters (and the step counters) to the other ranks, and every rank
   copies its own shard out of them.

So a 2-rank peer and a 1-rank peer hold bit-identical global parameters after every round. A peer made of ranks
takes the swarm's state only at a sync or at start (``catch_up_if_behind``), never between syncs: the leader takes
it and every rank copies its shards of the parameters and AdamW moments out of it. Memory: docs/hsdp-and-containers.md.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable, Dict, List, NoReturn, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from p2ptrain.checkpoint import latest_sharded_or_raise, load_checkpoint, point_latest_at, save_checkpoint
from p2ptrain.config import ConfigError
from p2ptrain.diloco import DiLoCoOptimizer
from p2ptrain.lifeline import exit_now, run_forced_exit_callbacks
from p2ptrain.model_source import decoder_blocks
from p2ptrain.schedules import Schedule, scale_lrs

def gpu_count_problem(train, nproc: int) -> str:
    """Why ``nproc`` ranks cannot each have a GPU of their own on this host (CUDA devices only), or ''."""
    if not (train.device.startswith("cuda") or (train.device == "auto" and torch.cuda.is_available())):
        return ""
    gpus = torch.cuda.device_count()
    if nproc > gpus:
        return (f"--nproc-per-node {nproc} needs {nproc} GPUs but this host has {gpus}; use --nproc-per-node "
                f"{max(gpus, 1)} or --device cpu")
    return ""


def init_ranks(world: int, local_rank: int, device: torch.device, shard_size: Optional[int]):
    """Start the process group of the peer's ``world`` ranks and the (replicate, shard) mesh; ``shard_size`` ranks
    shard the model (default: all of them), the rest replicate it."""
    shard = shard_size or world
    if shard < 1 or world % shard:
        raise ConfigError(f"--shard-size {shard} does not divide the peer's {world} ranks; use a divisor")
    if device.type == "cuda":
        if local_rank >= torch.cuda.device_count():
            raise ConfigError(f"local rank {local_rank} has no GPU: this host has {torch.cuda.device_count()}; "
                              "start at most that many ranks per node")
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    global _ranks_started
    _ranks_started = True
    return init_device_mesh(device.type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))


_ranks_started = False
"""whether this process started a process group (``init_ranks``): it must then end through ``exit_rank``"""


def ranks_started() -> bool:
    return _ranks_started


def exit_rank(code: int) -> NoReturn:
    """End a rank's process with ``code`` without finalizing the interpreter. Call after everything of ours is
    closed (DHT, averager, ``destroy_process_group``). ``join`` ends this way after training, with one rank too.

    Why: gloo never joins its worker threads (neither ``destroy_process_group`` nor dropping every reference does),
    and a worker may still be releasing its last collective's tensors when the main thread returns. Releasing a
    tensor that has a Python object takes the GIL, and a thread that asks for the GIL while the interpreter
    finalizes is ended by a forced unwind, which meets a ``noexcept`` frame: std::terminate, "terminate called
    without an active exception", SIGABRT, and torchrun reports the whole peer failed (gdb on the core:
    ``~AsyncAllgatherCoalescedWork -> TensorImpl::decref_pyobject -> take_gil -> pthread_exit``; 8 exits in 30 on
    2 loaded cores). Nothing of ours needs finalizing: logs and stdio are flushed here, files are written
    atomically and closed, and the child processes were stopped."""
    run_forced_exit_callbacks()  # the files in TMPDIR that atexit and multiprocessing's finalizers would remove
    logging.shutdown()
    exit_now(code)


def shard_model(model: torch.nn.Module, mesh) -> None:
    """``fully_shard`` every transformer block (a Hugging Face model's decoder layers), then the root; on CUDA, bf16
    parameters and fp32 gradient reduction."""
    mp = MixedPrecisionPolicy()
    if mesh.device_type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)


def broadcast_object(obj: Any) -> Any:
    """The leader's ``obj`` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


MOMENTS = ("exp_avg", "exp_avg_sq")
"""the inner AdamW's per-parameter state tensors, which state transfers carry"""


def _full(p: torch.Tensor) -> torch.Tensor:
    """The full value of a (possibly sharded) parameter; a collective for a DTensor."""
    return p.full_tensor() if isinstance(p, DTensor) else p.detach()


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _like(p: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """``full`` (the same on every rank) laid out like ``p``: this rank's shard of it if ``p`` is a DTensor."""
    if isinstance(p, DTensor):
        return distribute_tensor(full, p.device_mesh, p.placements, src_data_rank=None)
    return full.clone()


def _downloaded_step(proxy_state: dict, proxy: List[torch.Tensor]) -> Optional[float]:
    """The inner step count of the moments a download left in the proxy's optimizer state, or None if the donor sent
    none (it had not trained yet, or it was a peer with another inner optimizer)."""
    first = proxy_state.get(proxy[0], {})
    if not all(name in first for name in MOMENTS):
        return None
    return float(first.get("step", 0.0))


def _of_leader(name: str, default: Any) -> property:
    """An attribute of the leader's ``DiLoCoOptimizer``; ``default`` on the other ranks."""
    return property(lambda self: getattr(self.diloco, name) if self.diloco else default)


class ShardedDiLoCo:
    """The DiLoCo optimizer of one peer made of several ranks. Call it on every rank, in the same order.

    :param model: the model, already ``fully_shard``-ed (its parameters are DTensors; plain tensors work too)
    :param inner_optimizer: builds each rank's inner optimizer from the model's (sharded) parameters
    :param local_steps: H, inner steps between syncs
    :param diloco: on the leader only: builds the swarm-side ``DiLoCoOptimizer`` from (proxy parameters, inner
      optimizer factory); every other ``DiLoCoOptimizer`` argument is the caller's, with
      ``options.catch_up_mid_phase=False`` (a ``ValueError`` says so). None on the other ranks.
    :param inner_lr_schedule: ``local_step -> factor`` of the inner LRs (``p2ptrain/schedules.py``), applied to every
      rank's inner optimizer before each inner step and whenever the counters are taken from the leader (a sync, a
      catch-up, a checkpoint load). Give it here, not to the leader's ``DiLoCoOptimizer``: that one's inner
      optimizer is the proxy's, which never steps; ``_mirror_lrs`` copies the LRs used into it for newcomers.
    """

    def __init__(self, model: torch.nn.Module, *, inner_optimizer: Callable[..., torch.optim.Optimizer],
                 local_steps: int, diloco: Optional[Callable[..., DiLoCoOptimizer]] = None,
                 inner_lr_schedule: Optional[Schedule] = None):
        self.rank = dist.get_rank()
        self.is_leader = self.rank == 0
        if self.is_leader != (diloco is not None):
            raise ValueError("pass `diloco` on rank 0 and only there: the leader is the peer's member of the swarm")
        self.params: List[torch.Tensor] = list(model.parameters())
        self.inner = inner_optimizer(self.params)
        self.local_steps = local_steps
        self.local_step = 0
        self.outer_step = 0
        self.inner_lr_schedule = inner_lr_schedule
        self._apply_lr_schedule()  # records the base LRs before anything else can change them
        self.proxy: List[torch.Tensor] = []
        self.diloco: Optional[DiLoCoOptimizer] = None
        with torch.no_grad():
            for p in self.params:
                full = _full(p)
                if self.is_leader:
                    self.proxy.append(torch.nn.Parameter(full.to("cpu", torch.float32, copy=True)))
        if self.is_leader:
            # The proxy never takes a gradient or a step: its "inner optimizer" is an AdamW that holds the full
            # moments of the ranks' inner AdamW as of the last sync (``_gather_moments``), and the LRs, so that a
            # newcomer downloads them like a 1-rank peer's; and takes them from a donor (``_scatter_moments``).
            lrs = [group["lr"] for group in self.inner.param_groups]

            def proxy_inner(params):
                optimizer = torch.optim.AdamW(params, lr=lrs[0])
                for q in params:
                    optimizer.state[q] = {name: torch.zeros_like(q) for name in MOMENTS}
                    optimizer.state[q]["step"] = torch.tensor(0.0)
                return optimizer

            leader = diloco(self.proxy, proxy_inner)
            if leader.options.catch_up_mid_phase:  # built, not started: nothing to stop
                raise ValueError("ShardedDiLoCo: build the leader's DiLoCoOptimizer with catch_up_mid_phase=False "
                                 "(DiLoCoOptions): the ranks take the swarm's state together, at a sync")
            self.diloco = leader.start()

    # the leader's sync records, throughput and last state download (the other ranks have none)
    history, samples_per_s, last_download = _of_leader("history", []), _of_leader("samples_per_s", 0.0), \
        _of_leader("last_download", None)

    def interrupt(self) -> None:
        if self.diloco is not None:
            self.diloco.interrupt()

    def catch_up_if_behind(self) -> bool:
        """If the swarm is at a later outer step, the leader takes its state and every rank its shards of it.
        Returns True if the peer caught up. Call on every rank."""
        behind = broadcast_object(self.diloco.swarm_outer_step() > self.outer_step if self.is_leader else None)
        if not behind:
            return False
        caught_up = broadcast_object(self.diloco.catch_up() if self.is_leader else None)
        if caught_up:
            self.broadcast_global()
            self._scatter_moments()
        return caught_up

    @property
    def param_groups(self) -> List[dict]:
        """This rank's inner optimizer's groups (of its shards): what ``torch.amp.GradScaler`` unscales and checks for
        inf/NaN (DTensor gradients agree on that across the mesh, so every rank skips the same steps) and what
        gradient clipping sees."""
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)

    def step(self, batch_size: Optional[int] = None) -> None:
        """One inner step on every rank; every ``local_steps`` steps, a sync of the whole peer with the swarm.
        ``batch_size``: the samples the whole peer (all ranks together) trained on in this step."""
        self._apply_lr_schedule()
        self.inner.step()
        self.local_step += 1
        if self.local_step % self.local_steps == 0:
            self._gather_into_proxy()
            if self.is_leader:
                self._mirror_lrs()
                self.diloco.step(batch_size=batch_size)  # its local step hits H too: this step syncs
            self.broadcast_global()
        elif self.is_leader:
            self._mirror_lrs()
            self.diloco.step(batch_size=batch_size)  # counters, samples and progress records only

    @torch.no_grad()
    def _gather_into_proxy(self) -> None:
        for i, p in enumerate(self.params):
            full = _full(p)
            if self.is_leader:
                self.proxy[i].copy_(full)
            del full
        self._gather_moments()

    @torch.no_grad()
    def _gather_moments(self) -> None:
        """Copy the ranks' inner AdamW moments (full, one tensor at a time) into the proxy's optimizer state, where
        the leader serves them to newcomers. Done at every sync: they then belong to the same moment as the global
        parameters a newcomer starts from. A collective."""
        proxy_state = self.diloco.inner_optimizer.state if self.is_leader else None
        for i, p in enumerate(self.params):
            state = self.inner.state.get(p, {})
            for name in MOMENTS:
                if name not in state:  # before the first inner step: nothing to gather (same on every rank)
                    continue
                full = _full(state[name])
                if self.is_leader:
                    # a download may have left another layout here (a donor that sent no moments)
                    proxy_state[self.proxy[i]][name] = full.to("cpu", torch.float32, copy=True)
                del full
            if self.is_leader and "step" in state:
                proxy_state[self.proxy[i]]["step"] = torch.as_tensor(state["step"], dtype=torch.float32).clone()

    @torch.no_grad()
    def _scatter_moments(self) -> None:
        """Every rank takes its shards of the inner AdamW moments the leader downloaded into the proxy's state (if
        the donor sent any). A collective."""
        device = _local(self.params[0]).device
        proxy_state = self.diloco.inner_optimizer.state if self.is_leader else None
        step = broadcast_object(_downloaded_step(proxy_state, self.proxy) if self.is_leader else None)
        if step is None:
            return
        for i, p in enumerate(self.params):
            state = {"step": torch.tensor(step, dtype=torch.float32)}
            for name in MOMENTS:
                full = proxy_state[self.proxy[i]][name].to(device) if self.is_leader else \
                    torch.empty(p.shape, dtype=torch.float32, device=device)
                dist.broadcast(full, src=0)
                state[name] = _like(p, full)
            self.inner.state[p] = state

    def _mirror_lrs(self) -> None:
        """The LRs this rank's inner optimizer used into the proxy's, which newcomers download."""
        for group, mirror in zip(self.inner.param_groups, self.diloco.param_groups):
            mirror["lr"] = group["lr"]

    def _apply_lr_schedule(self) -> None:
        """The inner LRs for ``local_step`` (the next step's); the same on every rank, whose counters agree."""
        if self.inner_lr_schedule is not None:
            scale_lrs(self.inner.param_groups, self.inner_lr_schedule(self.local_step))

    @torch.no_grad()
    def broadcast_global(self) -> None:
        """Every rank takes the leader's global parameters into its shards, and the leader's step counters. Call
        after the leader synced or took the swarm's state (``DiLoCoOptimizer.catch_up``)."""
        device = _local(self.params[0]).device
        self._broadcast_counters()
        if self.is_leader:
            flat = torch.cat([g.detach().reshape(-1) for g in self.diloco.global_params]).to(device)
        else:
            flat = torch.empty(sum(p.numel() for p in self.params), dtype=torch.float32, device=device)
        dist.broadcast(flat, src=0)
        offset = 0
        for p in self.params:
            full = flat[offset:offset + p.numel()].view(p.shape)
            offset += p.numel()
            p.copy_(_like(p, full.to(p.dtype)))

    # ------------------------------------------------------------------------------------- sharded checkpoints

    def save_checkpoint(self, directory: str | Path, model: torch.nn.Module, extra: Optional[dict] = None) -> Path:
        """Write a checkpoint that any number of ranks can load (``torch.distributed.checkpoint``): every rank
        writes its shards of the model and of the inner optimizer's state into ``<directory>/step-<outer>-<local>``,
        the leader adds its DiLoCo state (global parameters, outer momentum, counters) and then, after every rank
        finished, points ``<directory>/latest`` at it (atomically) and removes the previous one. A crash mid-write
        leaves ``latest`` on the previous, complete checkpoint. ``extra`` (the leader's) is stored beside the DiLoCo
        state and read back by ``checkpoint.read_sharded_meta``. Call on every rank."""
        directory = Path(directory)
        target = directory / f"step-{self.outer_step}-{self.local_step}"
        model_state, optim_state = get_state_dict(model, self.inner)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(target / "shards"))
        if self.is_leader:
            # the proxy's copy of the inner moments is left out: the ranks' shards above hold them
            diloco_state = {**self.diloco.state_dict(), "inner": None}
            save_checkpoint(target / "diloco.pt", {**(extra or {}), "diloco": diloco_state,
                                                   "ranks": dist.get_world_size()})
        dist.barrier()
        if self.is_leader:
            point_latest_at(directory, target)
        dist.barrier()
        return target

    def load_checkpoint(self, directory: str | Path, model: torch.nn.Module) -> None:
        """Load the checkpoint ``<directory>/latest`` points at, whatever number of ranks wrote it: the model's and
        the inner optimizer's shards into this peer's layout, the DiLoCo state into the leader. The model keeps
        the local progress it had at save time. Call on every rank."""
        target = latest_sharded_or_raise(directory)
        load_shards(target, model, self.inner)
        if self.is_leader:
            self.diloco.load_state_dict(load_checkpoint(target / "diloco.pt")["diloco"])
        self._broadcast_counters()
        self._gather_moments()

    @torch.no_grad()
    def load_full_state(self, model: torch.nn.Module, model_state: dict, optimizer_state: dict) -> None:
        """Load a 1-rank peer's checkpoint (``<run-id>.pt``: full tensors, read by every rank): each rank keeps its
        shards of the parameters and of the inner AdamW state; the leader takes the DiLoCo state. Call on every
        rank."""
        device = _local(self.params[0]).device
        for name, p in model.named_parameters():
            p.copy_(_like(p, model_state[name].to(device, p.dtype)))
        inner = optimizer_state["inner"]
        for i, p in enumerate(self.params):
            saved = inner["state"].get(i)
            if saved:
                state = {name: _like(p, saved[name].to(device)) for name in MOMENTS}
                state["step"] = torch.as_tensor(saved["step"], dtype=torch.float32).clone()
                self.inner.state[p] = state
        for group, saved in zip(self.inner.param_groups, inner["param_groups"]):
            group["lr"] = saved["lr"]
        if self.is_leader:
            self.diloco.load_state_dict({**optimizer_state, "inner": None})
        self._broadcast_counters()
        self._gather_moments()

    def _broadcast_counters(self) -> None:
        counters = torch.zeros(2, dtype=torch.long)
        if self.is_leader:
            counters[:] = torch.tensor([self.diloco.local_step, self.diloco.outer_step])
        dist.broadcast(counters, src=0)
        self.local_step, self.outer_step = int(counters[0]), int(counters[1])
        self._apply_lr_schedule()  # the LRs follow the counters (a catch-up or a load may have moved them)

    def global_state(self) -> Dict[str, Any]:
        """The leader's global parameters (full, fp32, CPU); empty on the other ranks."""
        return {"global_params": [g.detach().clone() for g in self.diloco.global_params]} if self.is_leader else {}

    def close(self) -> None:
        if self.diloco is not None:
            self.diloco.close()


def load_shards(target: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The model's and the optimizer's state from ``target/shards`` into their current layout (any number of ranks,
    or none)."""
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(target / "shards"))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
