"""The worker's training loop: inner steps (a sync every ``local_steps``, inside ``optimizer.step``) until a limit,
a signal or the end of the data; after each committed round, whatever the worker does then (``after_round``).

One inner step (``train_step``): forward and backward over micro-batches under autocast, the fp16 gradient scaler,
gradient clipping, the optimizer's step. It takes any optimizer with ``step(batch_size=...)`` and ``zero_grad()``,
so it is tested without a swarm.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from typing import Callable, Optional, Tuple

import torch
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from p2ptrain.config import TrainConfig
from p2ptrain.data import ShardedBatches, evaluate
from p2ptrain.ranks import PeerRanks
from p2ptrain.worker_report import WorkerReport

logger = logging.getLogger(__name__)


PRECISIONS = ("auto", "bf16", "fp16", "fp32")
"""the autocast modes (config.PRECISIONS is a light copy)"""

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast(device: torch.device, precision: str):
    """The context of a forward pass in ``precision``: "bf16" or "fp16" autocast on ``device``'s type, "fp32" none,
    "auto" bf16 on CUDA and none elsewhere (most CPUs have no fast bf16 matmul). Parameters stay fp32 either way."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; use one of: {', '.join(PRECISIONS)}")
    if precision == "auto":
        precision = "bf16" if device.type == "cuda" else "fp32"
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[precision])


def grad_scaler(device: torch.device, precision: str) -> Optional[torch.amp.GradScaler]:
    """fp16's gradient scaler (small fp16 gradients underflow to 0 without one); None for the other precisions,
    whose range is fp32's."""
    return torch.amp.GradScaler(device.type) if precision == "fp16" else None


def compile_model(model: torch.nn.Module) -> None:
    """Compile ``model`` with ``torch.compile``, in place (``nn.Module.compile``): its parameters and ``state_dict``
    keys stay those of the plain model (no ``_orig_mod.`` prefix), so checkpoints, the state transfer and exports
    do not change. The first steps are slower while it compiles, and again at a new input shape (the eval batches)."""
    logger.info("--compile: torch.compile compiles the model at its first forward and backward (the first eval and "
                "inner step): a minute or more on a CPU, less on a GPU")
    model.compile()


def evaluate_held_out(model: torch.nn.Module, held_out, device: torch.device, precision: str = "auto") -> float:
    """The mean loss over the held-out batches; on every rank of a multi-rank peer (a sharded forward)."""
    with autocast(device, precision):
        return evaluate(model, [(x.to(device), y.to(device)) for x, y in held_out])


def train_step(model: torch.nn.Module, opt, x: torch.Tensor, y: torch.Tensor, *, micro_batches: int,
               scaler: Optional[torch.amp.GradScaler], grad_clip: Optional[float], device: torch.device,
               precision: str, batch_size: Optional[int] = None) -> Tuple[float, Optional[float]]:
    """One inner step on ``x``, ``y`` (this rank's rows of a batch, on ``device``), then ``opt.zero_grad()``.

    Forward and backward run over ``micro_batches`` slices of the rows (as even as they split), each slice's loss
    weighted by its share of the rows, so the accumulated gradient is the whole batch's (exactly so when every row
    counts the same number of tokens in the loss, as fixed-length blocks do). With a ``scaler`` (fp16),
    the gradients are unscaled before clipping, and a step whose gradients hold inf/NaN is skipped: ``opt.step`` is
    not called, so a DiLoCo optimizer's ``local_step`` (and with it the swarm's sync schedule) does not move.
    ``batch_size``: passed to ``opt.step`` (the samples of the whole peer's batch).

    Returns the batch's mean loss and, with ``grad_clip``, the gradient's global norm before clipping (else None).
    """
    rows = x.shape[0]
    sharded = hasattr(model, "set_requires_gradient_sync")  # an FSDP2 module
    total_loss = torch.zeros((), device=device)
    for i, (xs, ys) in enumerate(zip(x.tensor_split(micro_batches), y.tensor_split(micro_batches))):
        if sharded:
            # accumulate the unsharded gradients locally; reduce them across the ranks once, after the last slice
            model.set_requires_gradient_sync(i == micro_batches - 1)
        with autocast(device, precision):
            _, loss = model(xs, ys)
        loss = loss * (xs.shape[0] / rows)  # one slice: x 1.0, bit for bit the unsplit step
        (scaler.scale(loss) if scaler is not None else loss).backward()
        total_loss += loss.detach()
    if scaler is not None:
        scaler.unscale_(opt)  # clip and measure the true gradients, not the scaled ones
    grad_norm = None
    if grad_clip is not None:
        # torchtitan's split of clip_grad_norm_: a sharded model's norm is a DTensor, reduced over the ranks here
        # (a collective: every rank runs it) so that each clips by the same global norm and reads it as a number
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_norm = torch.nn.utils.get_total_norm(grads)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), grad_clip, grad_norm)
    if scaler is not None:
        # skips opt.step if unscale_ found inf/NaN; with DTensor gradients the finding is reduced over the mesh,
        # so every rank of a sharded peer skips the same steps
        scaler.step(opt, batch_size=batch_size)
        scaler.update()
    else:
        opt.step(batch_size=batch_size)
    opt.zero_grad()
    # read after the step: each .item() is a CPU-GPU sync point
    return total_loss.item(), (grad_norm.item() if grad_norm is not None else None)


class TrainLoop:
    """Trains ``model`` with ``ranks.optimizer`` on ``batches``, keeping ``report``'s counters current.

    :param after_round: called on every rank after each round that moved the outer step (averaged, stepped alone or
      caught up), before the loop checks its limits
    :param started: ``time.monotonic()`` when the worker started: start-up ends at the first inner step
    :param evaluate: the held-out loss of the model as it is, called on every rank every ``cfg.eval_every`` inner
      steps (the optimizer's ``local_step``); needed when ``eval_every`` is set
    """

    def __init__(self, cfg: TrainConfig, ranks: PeerRanks, report: WorkerReport, *, stop: threading.Event,
                 after_round: Callable[[], None], show_progress: bool, started: float,
                 evaluate: Optional[Callable[[], float]] = None, telemetry=None):
        if cfg.eval_every is not None and evaluate is None:
            raise ValueError("train.eval_every is set but the TrainLoop was given no evaluate hook")
        self.cfg, self.ranks, self.report, self.stop = cfg, ranks, report, stop
        self.after_round, self.show_progress, self.started = after_round, show_progress, started
        self.evaluate = evaluate
        self.telemetry = telemetry
        """observe.telemetry.Telemetry on the leader (metrics, loggers, the dashboard record), or None"""

    def run(self, model: torch.nn.Module, batches: ShardedBatches, device: torch.device) -> None:
        cfg, ranks, report, opt = self.cfg, self.ranks, self.report, self.ranks.optimizer
        peer = report.peer_id
        max_syncs, until = cfg.max_outer_steps, cfg.until_outer_step
        if until is not None and opt.outer_step >= until:
            logger.info(f"[{peer}] already at outer step {opt.outer_step}, at or past --until-outer-step {until}: "
                        "leaving without training")
            report.stopped_by = "until_outer_step"
            report.train_ended_at = time.time()
            return
        # inner steps until the first sync, then H per sync (a catch-up may jump further: the bar is a plan)
        first_sync_in = opt.local_steps - opt.local_step % opt.local_steps
        planned = [n for n in (max_syncs, until - opt.outer_step if until is not None else None) if n is not None]
        total = (min(planned) - 1) * opt.local_steps + first_sync_in if planned else None
        syncs = 0
        self._tell_last_outer_step(syncs)
        bar = tqdm(total=total, desc=f"{peer[-8:]} train", unit="step", leave=False,
                   disable=not (self.show_progress and ranks.leader))
        last_log, loss_value = time.monotonic(), float("nan")
        last_eval_step = opt.local_step  # the worker measured the start already
        rows = ranks.batch_rows(cfg.batch_size)
        # batch_size / micro_batch_size passes per step, each rank taking its rows of each (at least one row a pass);
        # the same number on every rank, as FSDP's collectives need
        micro_batches = min(cfg.batch_size // (cfg.micro_batch_size or cfg.batch_size), rows.stop - rows.start)
        scaler = grad_scaler(device, cfg.precision)
        model.train()
        try:
            for x, y in batches:
                if ranks.any_rank(self.stop.is_set()):  # every rank leaves at the same step, or a collective hangs
                    report.stopped_by = "signal"
                    break
                if report.startup_s is None:
                    report.startup_s = time.monotonic() - self.started
                    report.train_started_at = time.time()
                step_started = time.perf_counter()
                synced_before = opt.outer_step
                blocked_before = getattr(opt, "blocked_s", None)  # DiLoCoOptimizer's: syncs, catch-ups
                loss_value, grad_norm = train_step(
                    model, opt, x[rows].to(device), y[rows].to(device), micro_batches=micro_batches, scaler=scaler,
                    grad_clip=cfg.grad_clip, device=device, precision=cfg.precision, batch_size=cfg.batch_size)
                step_s = time.perf_counter() - step_started
                if blocked_before is not None:
                    step_s -= opt.blocked_s - blocked_before  # the sync work this step held up training for
                elif opt.outer_step != synced_before and opt.history:
                    step_s -= opt.history[-1].seconds  # the sync this step ended with is not compute
                if cfg.throttle > 1.0 and step_s > 0:  # a slower peer, for tests and benchmarks (--throttle)
                    time.sleep((cfg.throttle - 1.0) * step_s)
                    step_s *= cfg.throttle
                report.compute_s += max(step_s, 0.0)
                if report.first_loss is None:
                    report.first_loss = loss_value
                report.local_steps = opt.local_step
                report.grad_norm = grad_norm
                report.samples += cfg.batch_size
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.3f}", outer=opt.outer_step)
                if self.telemetry is not None and ranks.leader:
                    self._tell_step(loss_value, cfg.batch_size * x.shape[1])

                if opt.outer_step != synced_before:
                    # a sync this peer took part in (averaged, or stepped alone); taking the swarm's state instead
                    # (it was left out of a round) is not one: a newcomer asked for n syncs averages n times
                    took_part = ranks.broadcast(bool(opt.history) and not opt.history[-1].caught_up
                                                if ranks.leader else None)
                    syncs += took_part
                    report.syncs = syncs
                    self._tell_last_outer_step(syncs)
                    self.after_round()
                # by local_step, which every rank of the peer shares; a step the fp16 scaler skipped leaves it where
                # it was, measured already
                if cfg.eval_every and opt.local_step % cfg.eval_every == 0 and opt.local_step != last_eval_step:
                    last_eval_step = opt.local_step
                    self._evaluate()
                log_due = time.monotonic() - last_log >= cfg.log_interval_s or opt.outer_step != synced_before
                if ranks.leader and log_due:
                    self._log_line(loss_value)
                    last_log = time.monotonic()
                if max_syncs and syncs >= max_syncs:
                    report.stopped_by = "max_outer_steps"
                    break
                if until is not None and opt.outer_step >= until:
                    report.stopped_by = "until_outer_step"
                    break
        finally:
            bar.close()
            report.train_ended_at = time.time()

    def _tell_last_outer_step(self, syncs: int) -> None:
        """The outer step this peer leaves at, as far as this loop knows it now: its last round waits longer for late
        peers, who could take the state from nobody after it (``round_policy.late_peer_wait_s``)."""
        opt, cfg = self.ranks.optimizer, self.cfg
        outer = getattr(opt, "diloco", opt)  # a sharded peer's leader holds the swarm-side optimizer
        if outer is None or not hasattr(outer, "last_outer_step"):
            return  # a plain torch optimizer (tests), or a rank that does not average
        ends = [opt.outer_step + cfg.max_outer_steps - syncs if cfg.max_outer_steps else None, cfg.until_outer_step]
        outer.last_outer_step = min((step for step in ends if step is not None), default=None)

    def _evaluate(self) -> None:
        """The held-out loss now (on every rank: a sharded forward), into the report and the log."""
        opt = self.ranks.optimizer
        entry = self.report.add_eval(local_step=opt.local_step, outer_step=opt.outer_step, eval_loss=self.evaluate())
        if self.telemetry is not None and self.ranks.leader:
            self.telemetry.eval(entry)
        if self.ranks.leader:
            logger.info(f"[{self.report.peer_id}] outer_step={opt.outer_step} local_step={opt.local_step} "
                        f"eval_loss={entry['eval_loss']:.4f} perplexity={entry['perplexity']:.2f}")

    def _tell_step(self, loss_value: float, tokens: int) -> None:
        """One inner step to the telemetry: loss, throughput, where the run is, the learning rates."""
        opt = self.ranks.optimizer
        outer = getattr(opt, "diloco", opt)  # a sharded peer's leader holds the swarm-side optimizer
        outer_optimizer = getattr(outer, "outer_optimizer", None)
        samples_per_s = getattr(opt, "samples_per_s", 0.0)
        self.telemetry.step(local_step=opt.local_step, outer_step=opt.outer_step, loss=loss_value,
                            samples=self.cfg.batch_size, tokens=tokens,
                            tokens_per_s=samples_per_s * tokens / max(self.cfg.batch_size, 1),
                            inner_lr=opt.param_groups[0]["lr"],
                            outer_lr=outer_optimizer.param_groups[0]["lr"] if outer_optimizer is not None else None)

    def _log_line(self, loss_value: float) -> None:
        opt = self.ranks.optimizer
        last = opt.history[-1] if opt.history else None
        sync = f"last sync: group_size={last.group_size} {last.seconds:.2f}s" if last else "last sync: none yet"
        grad_norm = self.report.grad_norm
        logger.info(
            f"[{self.report.peer_id}] outer_step={opt.outer_step} local_step={opt.local_step} loss={loss_value:.4f} "
            + (f"grad_norm={grad_norm:.3f} " if grad_norm is not None else "")
            + f"samples/s={opt.samples_per_s:.1f} {sync}"
        )
