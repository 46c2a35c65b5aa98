"""The training controls of one inner step (micro-batches, clipping, precision and the fp16 scaler, compile) and
the loop's periodic eval, with the built-in tiny model and a plain AdamW standing in for the DiLoCo optimizer."""

from __future__ import annotations

import math
import shutil
import threading
from types import SimpleNamespace

import pytest
import torch

from p2ptrain import config
from p2ptrain.config import TrainConfig
from p2ptrain.model import build_model
from p2ptrain.ranks import LocalRanks, OneProcess
from p2ptrain.train_loop import PRECISIONS, TrainLoop, autocast, compile_model, grad_scaler, train_step
from p2ptrain.worker_report import WorkerReport, perplexity

CPU = torch.device("cpu")


class StandIn:
    """What the loop needs of a DiLoCo optimizer, around a plain AdamW: ``step(batch_size=...)`` and its counters,
    ``zero_grad``, and the ``param_groups`` the GradScaler unscales. It keeps the gradients each step saw."""

    def __init__(self, params, lr: float = 1e-3):
        self.inner = torch.optim.AdamW(params, lr=lr)
        self.param_groups = self.inner.param_groups
        self.local_step, self.outer_step, self.local_steps = 0, 0, 1000
        self.history, self.samples_per_s = [], 0.0
        self.seen_grads = None
        self.batch_sizes = []

    def step(self, batch_size=None):
        self.seen_grads = [p.grad.clone() for group in self.param_groups for p in group["params"]]
        self.batch_sizes.append(batch_size)
        self.inner.step()
        self.local_step += 1

    def zero_grad(self):
        self.inner.zero_grad()


def batch(rows: int = 8, seq: int = 16, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (rows, seq), generator=generator)
    return x, torch.roll(x, -1, dims=1)


def step(model, opt, x, y, *, micro_batches=1, scaler=None, grad_clip=None, precision="fp32"):
    return train_step(model, opt, x, y, micro_batches=micro_batches, scaler=scaler, grad_clip=grad_clip,
                      device=CPU, precision=precision, batch_size=x.shape[0])


def test_config_names_the_precisions_the_loop_has():
    assert tuple(config.PRECISIONS) == PRECISIONS


@pytest.mark.parametrize("micro_batches", [4, 3])  # 3: slices of 3, 3 and 2 rows, weighted by their rows
def test_micro_batches_accumulate_the_whole_batchs_gradient(micro_batches):
    x, y = batch()
    whole_model = build_model("tiny")
    whole = StandIn(whole_model.parameters())
    whole_loss, _ = step(whole_model, whole, x, y)
    split_model = build_model("tiny")
    split = StandIn(split_model.parameters())
    split_loss, _ = step(split_model, split, x, y, micro_batches=micro_batches)
    assert split_loss == pytest.approx(whole_loss, rel=1e-5)
    for a, b in zip(split.seen_grads, whole.seen_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert split.batch_sizes == [8] and split.local_step == 1
    assert all(p.grad is None for p in split_model.parameters()), "the step zeroes the gradients"


def test_clipping_bounds_the_norm_and_reports_it_before_clipping():
    x, y = batch()
    reference_model = build_model("tiny")
    reference = StandIn(reference_model.parameters())
    step(reference_model, reference, x, y)
    unclipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in reference.seen_grads]))
    max_norm = float(unclipped) / 10
    model = build_model("tiny")
    opt = StandIn(model.parameters())
    _, grad_norm = step(model, opt, x, y, grad_clip=max_norm)
    assert grad_norm == pytest.approx(float(unclipped), rel=1e-5)
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in opt.seen_grads]))
    assert float(clipped) == pytest.approx(max_norm, rel=1e-4)
    assert step(model, opt, x, y)[1] is None, "without grad_clip no norm is measured"


def test_fp16_scaler_skips_a_step_with_inf_gradients_without_advancing_local_step():
    x, y = batch()
    model = build_model("tiny")
    opt = StandIn(model.parameters())
    scaler = grad_scaler(CPU, "fp16")
    assert scaler is not None and grad_scaler(CPU, "bf16") is None
    scale = scaler.get_scale()
    first = next(model.parameters())
    hook = first.register_hook(lambda grad: torch.full_like(grad, math.inf))
    step(model, opt, x, y, scaler=scaler, precision="fp16")
    assert opt.seen_grads is None and opt.local_step == 0, "a skipped step must not reach the optimizer"
    assert scaler.get_scale() == scale / 2
    assert all(p.grad is None for p in model.parameters())
    hook.remove()
    step(model, opt, x, y, scaler=scaler, precision="fp16")
    assert opt.local_step == 1 and opt.seen_grads is not None


def test_fp16_steps_and_clipping_see_unscaled_gradients():
    x, y = batch()
    fp32_model = build_model("tiny")
    fp32 = StandIn(fp32_model.parameters())
    step(fp32_model, fp32, x, y)
    model = build_model("tiny")
    opt = StandIn(model.parameters())
    _, grad_norm = step(model, opt, x, y, scaler=grad_scaler(CPU, "fp16"), grad_clip=1e9, precision="fp16")
    norms = [float(torch.linalg.vector_norm(g)) for g in fp32.seen_grads]
    assert grad_norm == pytest.approx(math.hypot(*norms), rel=1e-2)
    for fp16_grad, fp32_grad in zip(opt.seen_grads, fp32.seen_grads, strict=True):
        error = torch.linalg.vector_norm(fp16_grad - fp32_grad) / torch.linalg.vector_norm(fp32_grad)
        assert error < 2e-2, "fp16 rounding only: the scaler's factor is gone"


@pytest.mark.parametrize("precision, enabled, dtype", [
    ("auto", False, None), ("fp32", False, None), ("bf16", True, torch.bfloat16), ("fp16", True, torch.float16),
])
def test_autocast_on_cpu(precision, enabled, dtype):
    with autocast(CPU, precision):
        assert torch.is_autocast_enabled("cpu") == enabled
        if enabled:
            assert torch.get_autocast_dtype("cpu") == dtype
    with pytest.raises(ValueError, match="precision"):
        autocast(CPU, "fp8")


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on CPU needs a C compiler")
@pytest.mark.slow  # Inductor's first compile and C build: 12 s of the 10-minute default suite
def test_compile_keeps_state_dict_keys_and_outputs():
    model = build_model("tiny")
    x, y = batch(rows=2)
    keys = list(model.state_dict())
    with torch.no_grad():
        _, eager = model(x, y)
    compile_model(model)
    assert list(model.state_dict()) == keys, "checkpoints and the state transfer rely on the plain model's keys"
    with torch.no_grad():
        _, compiled = model(x, y)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)


def _loop(cfg: TrainConfig, opt, evaluate=None) -> TrainLoop:
    ranks = OneProcess(LocalRanks())
    ranks.optimizer = opt
    return TrainLoop(cfg, ranks, WorkerReport(peer_id="peer"), stop=threading.Event(), after_round=lambda: None,
                     show_progress=False, started=0.0, evaluate=evaluate)


def test_the_loop_evaluates_every_n_inner_steps_with_every_control_on():
    cfg = TrainConfig(batch_size=8, micro_batch_size=4, grad_clip=1.0, precision="fp16", eval_every=2,
                      log_interval_s=0.0)
    model = build_model("tiny")
    opt = StandIn(model.parameters())
    losses = iter([3.0, 2.0, 1.0])
    loop = _loop(cfg, opt, evaluate=lambda: next(losses))
    loop.run(model, [batch(seed=i) for i in range(6)], CPU)
    report = loop.report
    # fp16 on CPU with a fresh scaler may skip a step or two: evals follow local_step, not batches
    steps = [entry["local_step"] for entry in report.evals]
    assert steps == list(range(2, opt.local_step + 1, 2)) and steps
    first = report.evals[0]
    assert first == {"local_step": 2, "outer_step": 0, "eval_loss": 3.0, "perplexity": pytest.approx(math.exp(3.0))}
    assert report.grad_norm is not None and report.grad_norm > 0
    assert report.samples == 6 * 8


def test_eval_every_needs_an_evaluate_hook():
    opt = StandIn(build_model("tiny").parameters())
    with pytest.raises(ValueError, match="eval_every"):
        _loop(TrainConfig(eval_every=5), opt)


def test_the_report_gives_perplexity_next_to_every_eval_loss():
    report = WorkerReport(initial_eval_loss=2.0, final_eval_loss=1.0)
    record = SimpleNamespace(to_dict=lambda: {"outer_step": 1})
    report.add_round(record, SimpleNamespace(shard_index=0, epoch=0, position=8), eval_loss=1.5)
    out = report.to_dict()
    assert out["initial_perplexity"] == pytest.approx(math.exp(2.0))
    assert out["final_perplexity"] == pytest.approx(math.exp(1.0))
    assert out["rounds"][0]["perplexity"] == pytest.approx(math.exp(1.5))
    assert out["evals"] == [] and out["grad_norm"] is None
    assert perplexity(1e6) == math.inf and math.isnan(perplexity(math.nan))


class Syncing(StandIn):
    """A StandIn that syncs every 2 inner steps; ``caught_up`` at the outer steps named (a state taken instead of a
    round: not one of this peer's syncs). It notes the ``last_outer_step`` the loop had told it at each sync."""

    def __init__(self, params, caught_up=()):
        super().__init__(params)
        self.local_steps, self.caught_up, self.told = 2, set(caught_up), []
        self.last_outer_step = None

    def step(self, batch_size=None):
        super().step(batch_size)
        if self.local_step % self.local_steps == 0:
            self.told.append(self.last_outer_step)
            self.outer_step += 1
            self.history.append(SimpleNamespace(caught_up=self.outer_step in self.caught_up, seconds=0.0,
                                                group_size=2))


@pytest.mark.parametrize("limits, caught_up, told", [
    (dict(max_outer_steps=3), (), [3, 3, 3]),
    # a state taken is not a sync of its own: the peer leaves a step later
    (dict(max_outer_steps=3), (2,), [3, 3, 4, 4]),
    (dict(until_outer_step=2), (), [2, 2]),
    (dict(max_outer_steps=5, until_outer_step=2), (), [2, 2]),
])
def test_the_loop_tells_the_optimizer_the_outer_step_it_leaves_at(limits, caught_up, told):
    """The optimizer's last round waits longer for late peers (round_policy.late_peer_wait_s); it learns which round
    is its last from the loop, at the start and after every sync."""
    model = build_model("tiny")
    opt = Syncing(model.parameters(), caught_up)
    loop = _loop(TrainConfig(batch_size=8, log_interval_s=60.0, **limits), opt)
    loop.run(model, [batch(seed=i) for i in range(20)], CPU)
    assert opt.told == told
