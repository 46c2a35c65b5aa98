"""The worker's training loop: inner steps (a sync every ``local_steps``, inside ``optimizer.step``) until a limit,
a signal or the end of the data; after each committed round, whatever the worker does then (``after_round``)."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import nullcontext
from typing import Callable

import torch
from tqdm import tqdm

from p2ptrain.config import TrainConfig
from p2ptrain.data import ShardedBatches, evaluate
from p2ptrain.ranks import PeerRanks
from p2ptrain.worker_report import WorkerReport

logger = logging.getLogger(__name__)


def autocast(device: torch.device):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()


def evaluate_held_out(model: torch.nn.Module, held_out, device: torch.device) -> float:
    """The mean loss over the held-out batches; on every rank of a multi-rank peer (a sharded forward)."""
    with autocast(device):
        return evaluate(model, [(x.to(device), y.to(device)) for x, y in held_out])


class TrainLoop:
    """Trains ``model`` with ``ranks.optimizer`` on ``batches``, keeping ``report``'s counters current.

    :param after_round: called on every rank after each round that moved the outer step (averaged, stepped alone or
      caught up), before the loop checks its limits
    :param started: ``time.monotonic()`` when the worker started: start-up ends at the first inner step
    """

    def __init__(self, cfg: TrainConfig, ranks: PeerRanks, report: WorkerReport, *, stop: threading.Event,
                 after_round: Callable[[], None], show_progress: bool, started: float):
        self.cfg, self.ranks, self.report, self.stop = cfg, ranks, report, stop
        self.after_round, self.show_progress, self.started = after_round, show_progress, started

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
        bar = tqdm(total=total, desc=f"{peer[-8:]} train", unit="step", leave=False,
                   disable=not (self.show_progress and ranks.leader))
        last_log, loss_value = time.monotonic(), float("nan")
        rows = ranks.batch_rows(cfg.batch_size)
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
                x, y = x[rows], y[rows]
                with autocast(device):
                    _, loss = model(x.to(device), y.to(device))
                loss.backward()
                synced_before = opt.outer_step
                opt.step(batch_size=cfg.batch_size)
                opt.zero_grad()
                loss_value = loss.item()
                step_s = time.perf_counter() - step_started
                if opt.outer_step != synced_before and opt.history:
                    step_s -= opt.history[-1].seconds  # the sync this step ended with is not compute
                report.compute_s += max(step_s, 0.0)
                if report.first_loss is None:
                    report.first_loss = loss_value
                report.local_steps = opt.local_step
                report.samples += cfg.batch_size
                bar.update(1)
                bar.set_postfix(loss=f"{loss_value:.3f}", outer=opt.outer_step)

                if opt.outer_step != synced_before:
                    # a sync this peer took part in (averaged, or stepped alone); taking the swarm's state instead
                    # (it was left out of a round) is not one: a newcomer asked for n syncs averages n times
                    took_part = ranks.broadcast(bool(opt.history) and not opt.history[-1].caught_up
                                                if ranks.leader else None)
                    syncs += took_part
                    report.syncs = syncs
                    self.after_round()
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

    def _log_line(self, loss_value: float) -> None:
        opt = self.ranks.optimizer
        last = opt.history[-1] if opt.history else None
        sync = f"last sync: group_size={last.group_size} {last.seconds:.2f}s" if last else "last sync: none yet"
        logger.info(
            f"[{self.report.peer_id}] outer_step={opt.outer_step} local_step={opt.local_step} loss={loss_value:.4f} "
            f"samples/s={opt.samples_per_s:.1f} {sync}"
        )
