"""--model beyond the built-in sizes: Hugging Face folders, hub ids and module:factory, resolved and built."""

from __future__ import annotations

import json

import pytest
import torch

from p2ptrain.config import ConfigError, load_config
from p2ptrain.model_source import CausalLM, build_from_spec, decoder_blocks, resolve_model
from tests.hf_fixtures import make_llama

FACTORY = "tests.models.factories:tiny_recurrent_lm"


def test_a_folder_with_a_config_is_a_fresh_model_the_same_in_every_build(tmp_path):
    spec = resolve_model(str(make_llama(tmp_path / "llama")))
    assert (spec.kind, spec.n_layer, spec.n_embd, spec.vocab_size, spec.seq_len) == ("hf_dir", 2, 64, 320, 128)
    assert not spec.pretrained and spec.identity.startswith("llama-")
    first, second = build_from_spec(spec, seed=3), build_from_spec(spec, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(first.state_dict().values(), second.state_dict().values()))
    other = build_from_spec(spec, seed=4)
    assert not torch.equal(first.inner.lm_head.weight, other.inner.lm_head.weight)
    assert spec.num_parameters == first.num_parameters() and len(decoder_blocks(first)) == 2


def test_the_identity_covers_the_architecture_not_the_folder(tmp_path):
    one = resolve_model(str(make_llama(tmp_path / "a")))
    moved = resolve_model(str(make_llama(tmp_path / "elsewhere" / "b")))
    assert one.identity == moved.identity
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5  # the same tensors, another model
    (tmp_path / "a" / "config.json").write_text(json.dumps(config))
    assert resolve_model(str(tmp_path / "a")).identity != one.identity


def test_a_folder_with_weights_continues_from_them(tmp_path):
    spec = resolve_model(str(make_llama(tmp_path / "fresh")))
    model = build_from_spec(spec, seed=1)
    model.inner.save_pretrained(tmp_path / "trained")
    loaded_spec = resolve_model(str(tmp_path / "trained"))
    assert loaded_spec.pretrained
    loaded = build_from_spec(loaded_spec, seed=99)  # the seed does not matter: the weights are loaded
    assert torch.equal(loaded.inner.lm_head.weight, model.inner.lm_head.weight)


def test_the_loss_is_the_cross_entropy_of_the_next_token(tmp_path):
    model = build_from_spec(resolve_model(str(make_llama(tmp_path / "llama"))))
    x = torch.randint(0, 320, (2, 16))
    y = torch.randint(0, 320, (2, 16))
    logits, loss = model(x, y)
    assert logits.shape == (2, 16, 320)
    assert torch.allclose(loss, torch.nn.functional.cross_entropy(logits.reshape(-1, 320), y.reshape(-1)))


def test_a_factory_model_follows_the_contract():
    spec = resolve_model(FACTORY)
    assert (spec.kind, spec.vocab_size, spec.seq_len) == ("factory", 256, 32)
    model = build_from_spec(spec, seed=0)
    assert isinstance(model, CausalLM) and spec.num_parameters == model.num_parameters()
    assert torch.equal(model.inner.head.weight, build_from_spec(spec, seed=0).inner.head.weight)
    _, loss = model(torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    loss.backward()
    assert resolve_model(FACTORY, seq_len=16).seq_len == 16


@pytest.mark.parametrize("model, words", [
    ("tests.models.factories:not_a_module", "returned a dict, not a torch.nn.Module"),
    ("tests.models.factories:without_vocab_size", "no int vocab_size attribute"),
    ("tests.models.factories:nothing_here", "has no function nothing_here"),
    ("tests.models.no_such_module:f", "cannot import tests.models.no_such_module"),
])
def test_a_broken_factory_is_one_line_naming_the_fix(model, words):
    with pytest.raises(ConfigError, match=words) as refused:
        resolve_model(model)
    assert "\n" not in str(refused.value)


def test_bad_model_sources_are_refused_with_the_fix(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="the folder has no config.json"):
        load_config(overrides={"train.model": str(tmp_path / "empty")})
    with pytest.raises(ConfigError, match="is unknown; use a built-in size"):
        load_config(overrides={"train.model": "huge"})
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # this host has no internet; offline says so at once
    with pytest.raises(ConfigError, match="the Hugging Face hub cannot be reached"):
        resolve_model("someone/no-such-model")
    with pytest.raises(ConfigError, match="longer than the 128 tokens"):
        resolve_model(str(make_llama(tmp_path / "llama")), seq_len=256)
