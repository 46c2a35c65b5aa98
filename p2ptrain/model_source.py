"""Where a worker's model comes from: a built-in size, a Hugging Face model (a folder or a hub id), or a user's
``package.module:factory``. ``resolve_model`` reads what ``--model`` names into a ``ModelSpec`` (its shape, context
length, vocabulary and the identity that peers compare); ``build_from_spec`` makes the module, the same in every
process for the same (spec, seed).

Every model trains through one call, ``model(idx, targets) -> (logits, loss)``: the built-in GPT has it, and
``CausalLM`` gives it to the others. The loss is the mean cross-entropy of ``logits`` against ``targets`` (the
tokens shifted by one, made by the data pipeline), computed here in fp32, so a model never shifts labels itself.

The contract of a factory (docs/MODELS.md): ``factory()`` takes no arguments and returns a ``torch.nn.Module`` with
an int ``vocab_size`` attribute and, optionally, ``max_seq_len`` (or ``block_size``); its ``forward(input_ids)``
takes (B, T) int64 token ids and returns (B, T, vocab_size) logits (a tensor, a tuple whose first item is them, or
an object with ``.logits``). It is called under ``torch.manual_seed(seed)``, so every peer gets the same weights.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import os
import socket
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.nn import functional as F

from p2ptrain.config import ConfigError
from p2ptrain.config_checks import model_kind
from p2ptrain.model import GPT, build_model, model_config

HF_EXTRA = "pip install 'p2ptrain[hf]'"
DEFAULT_MAX_SEQ_LEN = 1024
"""a Hugging Face model's sequence length when --seq-len is unset: its context, at most this"""
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# config keys that say how a model was saved or run, not what it is: two peers that differ only in them match
_NOT_ARCHITECTURE = {"transformers_version", "torch_dtype", "dtype", "use_cache", "output_hidden_states",
                     "output_attentions", "return_dict", "name_or_path"}

_INIT_LOCK = threading.Lock()  # the init draws from torch's process-wide RNG: one model at a time


@dataclass(frozen=True)
class ModelSpec:
    """What ``--model`` names, resolved: enough to check a run, size the memory and cut the data, before building."""

    source: str
    """the --model value"""
    kind: str
    """builtin, hf_dir, hub or factory (config.model_kind)"""
    identity: str
    """what the peers of a run compare: the size name, or the architecture and a digest of its full config"""
    seq_len: int
    """tokens per training sequence"""
    vocab_size: int
    n_layer: int = 0
    n_embd: int = 0
    n_head: int = 0
    """the shape in words (0 where a factory's module does not say)"""
    num_parameters: int = 0
    default_tokenizer: Optional[str] = None
    """the tokenizer that comes with the model (its folder or hub id); None: bytes"""
    pretrained: bool = False
    """its weights are loaded (continued pretraining) rather than initialised from the seed"""
    hf_config: Optional[dict] = None
    """a Hugging Face model's config.json, as a dict (export writes it back)"""

    @property
    def builtin(self) -> bool:
        return self.kind == "builtin"

    @property
    def hugging_face(self) -> bool:
        return self.kind in ("hf_dir", "hub")


def missing_extra(package: str) -> ConfigError:
    return ConfigError(f"{package} is not installed, and Hugging Face models need it; {HF_EXTRA}")


def resolve_model(source: str, seq_len: Optional[int] = None) -> ModelSpec:
    """The spec of the model ``source`` names (a ConfigError, one line with the fix, if it names none)."""
    kind = model_kind(source)
    if kind == "builtin":
        shape = model_config(source)
        length = _check_seq_len(seq_len, shape.block_size, source)
        return ModelSpec(source, kind, identity=source, seq_len=length, vocab_size=shape.vocab_size,
                         n_layer=shape.n_layer, n_embd=shape.n_embd, n_head=shape.n_head, num_parameters=_count_builtin(source))
    if kind == "factory":
        return _resolve_factory(source, seq_len)
    return _resolve_hugging_face(source, kind, seq_len)


@functools.lru_cache(maxsize=None)
def _count_builtin(size: str) -> int:
    with torch.device("meta"):  # shapes only: no memory, no init cost
        return GPT(model_config(size)).num_parameters()


def _check_seq_len(seq_len: Optional[int], longest: Optional[int], source: str) -> int:
    if seq_len is None:
        if longest is None:
            raise ConfigError(f"--model {source} does not say how long its sequences may be (no max_seq_len or "
                              "block_size attribute); pass --seq-len")
        return longest
    if longest is not None and seq_len > longest:
        raise ConfigError(f"--seq-len {seq_len} is longer than the {longest} tokens --model {source} takes; use "
                          f"--seq-len {longest} or less")
    return seq_len


def _resolve_hugging_face(source: str, kind: str, seq_len: Optional[int]) -> ModelSpec:
    config = _auto_config(source, kind)
    values = config.to_dict()
    longest = next((values[k] for k in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length")
                    if isinstance(values.get(k), int)), None)
    length = _check_seq_len(seq_len if seq_len is not None else min(longest or DEFAULT_MAX_SEQ_LEN,
                                                                      DEFAULT_MAX_SEQ_LEN), longest, source)
    folder = Path(os.path.expanduser(source))
    pretrained = kind == "hub" or any((folder / name).is_file() for name in WEIGHT_FILES)
    has_tokenizer = kind == "hub" or any((folder / name).is_file() for name in TOKENIZER_FILES)
    architecture = {k: v for k, v in values.items() if not k.startswith("_") and k not in _NOT_ARCHITECTURE}
    digest = hashlib.blake2b(json.dumps(architecture, sort_keys=True, default=str).encode(), digest_size=6)
    n = _count_hf(config)

    def first(*names: str) -> int:
        return next((int(values[k]) for k in names if isinstance(values.get(k), int)), 0)

    return ModelSpec(
        source, kind, identity=f"{values.get('model_type', 'hf')}-{digest.hexdigest()}", seq_len=length,
        vocab_size=int(values["vocab_size"]), n_layer=first("num_hidden_layers", "n_layer"),
        n_embd=first("hidden_size", "n_embd", "d_model"), n_head=first("num_attention_heads", "n_head"),
        num_parameters=n, default_tokenizer=(source if kind == "hub" else str(folder)) if has_tokenizer else None,
        pretrained=pretrained, hf_config=values,
    )


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection: asked before going online, because a host without
    internet otherwise spends half a minute in huggingface_hub's retries before it fails."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    url = urllib.parse.urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s).close()
        return True
    except OSError:
        return False


def from_hub_or_folder(load: Callable[..., Any], source: str) -> Any:
    """``load(source)`` for a folder; for a hub id, from the local Hugging Face cache first, then online if the hub
    can be reached (an OSError otherwise, as transformers raises for a model it cannot find)."""
    source = os.path.expanduser(source)
    if os.path.isdir(source):
        return load(source)
    try:
        return load(source, local_files_only=True)
    except OSError:
        if not hub_reachable():
            raise OSError(f"{source} is not in the local Hugging Face cache and the hub cannot be reached") from None
        return load(source)


def _auto_config(source: str, kind: str):
    try:
        from transformers import AutoConfig
    except ImportError:
        raise missing_extra("transformers") from None
    try:
        return from_hub_or_folder(AutoConfig.from_pretrained, source)
    except OSError as e:  # transformers says "not a local folder and the hub cannot be reached" as an OSError
        if kind == "hub":
            raise ConfigError(f"--model {source}: not a folder here, and the Hugging Face hub cannot be reached or "
                              "has no such model; download the model where there is internet and pass its folder"
                              ) from None
        raise ConfigError(f"--model {source}: its config.json cannot be read ({_first_line(e)}); fix or replace "
                          "it") from None
    except ValueError as e:  # an unknown model_type, a malformed field
        raise ConfigError(f"--model {source}: its config.json is not one transformers can build "
                          f"({_first_line(e)}); fix model_type or upgrade transformers") from None


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__


def _count_hf(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return _unique_parameters(model)


def _unique_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields a tied tensor once


def _factory(source: str) -> Callable[[], Any]:
    module_name, _, function = source.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"--model {source}: cannot import {module_name} ({_first_line(e)}); put its package on "
                          "PYTHONPATH or install it") from None
    factory = getattr(module, function, None)
    if not callable(factory):
        raise ConfigError(f"--model {source}: {module_name} has no function {function}; name a function that "
                          "returns a torch.nn.Module")
    return factory


def _call_factory(source: str) -> nn.Module:
    try:
        module = _factory(source)()
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"--model {source}: the factory raised {type(e).__name__}: {_first_line(e)}") from None
    if not isinstance(module, nn.Module):
        raise ConfigError(f"--model {source}: the factory returned a {type(module).__name__}, not a torch.nn.Module; "
                          "return the model itself (see docs/MODELS.md)")
    return module


def _resolve_factory(source: str, seq_len: Optional[int]) -> ModelSpec:
    with torch.device("meta"):  # shapes only; a factory that cannot build on meta is built for real
        try:
            module = _call_factory(source)
        except ConfigError as e:
            if "raised" not in str(e):
                raise
            module = _call_factory(source)
    vocab = getattr(module, "vocab_size", None)
    if not isinstance(vocab, int) or vocab < 1:
        raise ConfigError(f"--model {source}: the module has no int vocab_size attribute; set it to the size of "
                          "its output layer (see docs/MODELS.md)")
    longest = next((v for v in (getattr(module, "max_seq_len", None), getattr(module, "block_size", None))
                    if isinstance(v, int)), None)
    schema = hashlib.blake2b(digest_size=6)
    for name, p in module.named_parameters():
        schema.update(f"{name}:{tuple(p.shape)}:{p.dtype};".encode())
    return ModelSpec(source, "factory", identity=f"{source}-{schema.hexdigest()}",
                     seq_len=_check_seq_len(seq_len, longest, source), vocab_size=vocab,
                     num_parameters=_unique_parameters(module))


# ------------------------------------------------------------------------------------------------------- build


class CausalLM(nn.Module):
    """A Hugging Face causal LM or a factory's module, trained through the built-in model's call:
    ``forward(idx, targets) -> (logits, loss)``. ``inner`` is the wrapped module; its state dict is ours without
    the ``inner.`` prefix (export writes it that way)."""

    def __init__(self, inner: nn.Module, vocab_size: int, hugging_face: bool):
        super().__init__()
        self.inner = inner
        self.vocab_size = vocab_size
        self.hugging_face = hugging_face

    @property
    def activation_checkpointing(self) -> bool:
        return bool(getattr(self.inner, "is_gradient_checkpointing", False))

    @activation_checkpointing.setter
    def activation_checkpointing(self, on: bool) -> None:
        if not on:
            return
        if not hasattr(self.inner, "gradient_checkpointing_enable"):
            raise ConfigError("--activation-checkpointing: this model has no gradient_checkpointing_enable(); drop "
                              "the flag or add it to the model")
        self.inner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def blocks(self) -> list:
        """The model's repeated layers (what HSDP shards one by one): its longest ModuleList."""
        lists = [m for m in self.inner.modules() if isinstance(m, nn.ModuleList)]
        return list(max(lists, key=len)) if lists else []

    def num_parameters(self) -> int:
        return _unique_parameters(self)

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        out = self.inner(input_ids=idx, use_cache=False) if self.hugging_face else self.inner(idx)
        logits = out.logits if hasattr(out, "logits") else out[0] if isinstance(out, (tuple, list)) else out
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss


def decoder_blocks(model: nn.Module) -> list:
    """The repeated blocks of any model this module builds: HSDP shards each, then the root."""
    return list(model.transformer.h) if isinstance(model, GPT) else model.blocks()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a CausalLM (the built-in GPT is its own)."""
    return model.inner if isinstance(model, CausalLM) else model


def build_from_spec(spec: ModelSpec, seed: int = 0) -> nn.Module:
    """The model of ``spec``: bit-identical parameters for the same (spec, seed) in any process (or the pretrained
    weights), fp32, on CPU. The caller's global RNG state is left as it was."""
    if spec.builtin:
        return build_model(spec.source, seed=seed)
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if spec.kind == "factory":
            return CausalLM(_call_factory(spec.source), spec.vocab_size, hugging_face=False)
        from transformers import AutoConfig, AutoModelForCausalLM

        if spec.pretrained:
            inner = from_hub_or_folder(functools.partial(AutoModelForCausalLM.from_pretrained, dtype=torch.float32), spec.source)
        else:
            config = from_hub_or_folder(AutoConfig.from_pretrained, spec.source)
            inner = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        return CausalLM(inner, spec.vocab_size, hugging_face=True)
