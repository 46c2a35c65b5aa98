"""The built-in byte-level GPT: sizes, reproducible init, shapes, and that it learns."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from p2ptrain.model import GPT, MODEL_SIZES, GPTConfig, build_model, model_config


def _num_parameters_on_meta(size: str) -> int:
    # the meta device allocates nothing, so even the 124m model is counted in milliseconds
    with torch.device("meta"):
        return GPT(model_config(size)).num_parameters()


@pytest.mark.parametrize(
    "size, low, high",
    [("tiny", 300_000, 1_500_000), ("small", 20_000_000, 30_000_000), ("124m", 110_000_000, 140_000_000)],
)
def test_named_sizes_have_the_advertised_parameter_counts(size, low, high):
    assert low <= _num_parameters_on_meta(size) <= high


def test_tiny_count_matches_the_built_model_and_ties_the_embedding():
    model = build_model("tiny")
    assert model.num_parameters() == _num_parameters_on_meta("tiny")
    assert model.transformer.wte.weight is model.lm_head.weight
    # counted once: the tied matrix appears in named_parameters() a single time
    assert model.num_parameters() == sum(p.numel() for _, p in model.named_parameters())
    assert model.num_parameters(non_embedding=True) == model.num_parameters() - model.transformer.wpe.weight.numel()


def test_unknown_size_is_a_value_error_that_lists_the_sizes():
    with pytest.raises(ValueError, match="tiny.*small.*124m"):
        model_config("huge")
    with pytest.raises(ValueError, match="huge"):
        build_model("huge")


def test_config_rejects_a_width_that_heads_do_not_divide():
    with pytest.raises(ValueError, match="n_head"):
        GPTConfig(block_size=8, n_embd=30, n_head=4)


def test_same_seed_builds_bit_identical_parameters():
    a, b = build_model("tiny", seed=3), build_model("tiny", seed=3)
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def test_same_seed_builds_the_same_parameters_in_another_process():
    # peers start from the same point only if a fresh interpreter builds the same bits
    def digest(model: GPT) -> str:
        h = hashlib.sha256()
        for name, tensor in sorted(model.state_dict().items()):
            h.update(name.encode() + tensor.numpy().tobytes())
        return h.hexdigest()

    code = (
        "import hashlib, torch\n"
        "from p2ptrain.model import build_model\n"
        "torch.manual_seed(99)\n"  # a different global seed must not matter
        "h = hashlib.sha256()\n"
        "for name, t in sorted(build_model('tiny', seed=4).state_dict().items()):\n"
        "    h.update(name.encode() + t.numpy().tobytes())\n"
        "print(h.hexdigest())\n"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == digest(build_model("tiny", seed=4))


def test_different_seeds_build_different_parameters():
    a, b = build_model("tiny", seed=0), build_model("tiny", seed=1)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)
    assert not torch.equal(a.transformer.h[0].attn.c_attn.weight, b.transformer.h[0].attn.c_attn.weight)


def test_build_model_leaves_the_global_rng_alone():
    torch.manual_seed(1234)
    expected = torch.rand(5)
    torch.manual_seed(1234)
    before = torch.get_rng_state()
    build_model("tiny", seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(torch.rand(5), expected)


def test_build_model_does_not_depend_on_the_global_rng():
    torch.manual_seed(1)
    a = build_model("tiny", seed=5)
    torch.manual_seed(2)
    torch.rand(100)
    b = build_model("tiny", seed=5)
    assert torch.equal(a.transformer.wpe.weight, b.transformer.wpe.weight)


def test_residual_projections_get_the_scaled_init():
    model = build_model("small")  # 8 layers: std 0.02 / sqrt(16) = 0.005, well apart from 0.02
    n_layer = model.config.n_layer
    proj_std = model.transformer.h[0].mlp.c_proj.weight.std().item()
    fc_std = model.transformer.h[0].mlp.c_fc.weight.std().item()
    assert proj_std == pytest.approx(0.02 / math.sqrt(2 * n_layer), rel=0.05)
    assert fc_std == pytest.approx(0.02, rel=0.05)


def test_forward_shapes_and_initial_loss_near_uniform():
    model = build_model("tiny")
    cfg = model.config
    generator = torch.Generator().manual_seed(0)
    idx = torch.randint(0, cfg.vocab_size, (3, cfg.block_size), generator=generator)
    targets = torch.randint(0, cfg.vocab_size, (3, cfg.block_size), generator=generator)
    logits, loss = model(idx)
    assert logits.shape == (3, cfg.block_size, cfg.vocab_size)
    assert loss is None
    # targets independent of the input: with tied weights, targets == idx would score well above chance
    logits, loss = model(idx, targets)
    assert loss.shape == ()
    # small init: the predicted distribution is close to uniform over 256 bytes
    assert abs(loss.item() - math.log(256)) < 0.3


def test_forward_is_causal():
    model = build_model("tiny").eval()
    idx = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 256
    a, _ = model(idx)
    b, _ = model(changed)
    assert torch.equal(a[:, :10], b[:, :10])  # positions before the change cannot see it
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_a_sequence_longer_than_block_size_is_refused():
    model = build_model("tiny")
    with pytest.raises(ValueError, match="block_size"):
        model(torch.zeros(1, model.config.block_size + 1, dtype=torch.long))


def test_no_dropout_modules_when_dropout_is_zero():
    model = build_model("tiny")
    assert model.config.dropout == 0.0
    assert not any(isinstance(m, torch.nn.Dropout) for m in model.modules())
    # hence train mode is deterministic too
    idx = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    model.train()
    assert torch.equal(model(idx)[0], model(idx)[0])


def test_a_few_steps_on_one_batch_reduce_the_loss():
    torch.manual_seed(0)
    model = build_model("tiny")
    text = b"the quick brown fox jumps over the lazy dog. " * 4
    chunk = torch.tensor(list(text[: 4 * 33]), dtype=torch.long).view(4, 33)
    x, y = chunk[:, :-1], chunk[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    _, first = model(x, y)
    for _ in range(10):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _, last = model(x, y)
    assert last.item() < first.item() - 1.0


def test_model_sizes_are_configs():
    assert set(MODEL_SIZES) == {"tiny", "small", "124m"}
    for cfg in MODEL_SIZES.values():
        assert cfg.vocab_size == 256
    assert MODEL_SIZES["small"].block_size == 256
    assert MODEL_SIZES["124m"].block_size == 1024


def test_same_seed_builds_the_same_parameters_in_concurrent_threads():
    # peers driven from threads of one process (tests, benchmarks, notebooks) build their models at the same time
    models: dict = {}
    threads = [threading.Thread(target=lambda i=i: models.__setitem__(i, build_model("tiny", seed=0)))
               for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    reference = list(build_model("tiny", seed=0).parameters())
    for model in models.values():
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference))


def test_activation_checkpointing_gives_the_same_loss_and_gradients():
    x = torch.randint(0, 256, (4, 64))
    grads = []
    for checkpointing in (False, True):
        model = build_model("tiny", seed=3)
        model.activation_checkpointing = checkpointing
        _, loss = model(x, x)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    (loss_plain, plain), (loss_ckpt, ckpt) = grads
    assert torch.equal(loss_plain, loss_ckpt)
    for a, b in zip(plain, ckpt):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_activation_checkpointing_keeps_fewer_activations_for_backward():
    # count the bytes autograd saves for the backward pass: checkpointing keeps only each block's input
    def saved_bytes(checkpointing: bool) -> int:
        model = build_model("tiny", seed=0)
        model.activation_checkpointing = checkpointing
        total = 0

        def pack(t):
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        x = torch.randint(0, 256, (8, 64))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(x, x)
        return total

    assert saved_bytes(True) < 0.6 * saved_bytes(False)
