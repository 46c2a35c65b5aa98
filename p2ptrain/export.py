"""Getting the model out of a run: ``export`` a checkpoint to safetensors, ``generate`` text from one.

What is exported is the swarm's model: the global parameters every peer agreed on at its last sync (the
checkpoint's ``optimizer.global_params``), not the peer's parameters part-way through an inner phase. A Hugging
Face model becomes a folder that ``AutoModelForCausalLM.from_pretrained`` loads, with its tokenizer beside it; a
built-in or factory model becomes ``model.safetensors`` plus ``p2ptrain.json`` (what ``generate`` needs to rebuild
it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn

from p2ptrain.checkpoint import CheckpointError, load_checkpoint
from p2ptrain.config import ConfigError
from p2ptrain.model_source import CausalLM, build_from_spec, missing_extra, resolve_model, unwrap
from p2ptrain.tokens import load_tokenizer

EXPORT_META = "p2ptrain.json"


@dataclass
class Loaded:
    """A model ready to sample from, with what encodes and decodes its text."""

    model: nn.Module
    tokenizer: object
    seq_len: int


def _rebuild(meta: dict) -> nn.Module:
    """The checkpoint's model skeleton (its weights are loaded after): from the config it saved, so export needs
    neither the run's config nor the model folder it started from."""
    config = meta.get("hf_config")
    if config:
        try:
            from transformers import AutoConfig, AutoModelForCausalLM
        except ImportError:
            raise missing_extra("transformers") from None
        config = dict(config)
        hf_config = AutoConfig.for_model(config.pop("model_type"), **config)
        return CausalLM(AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32), hf_config.vocab_size,
                        hugging_face=True)
    spec = resolve_model(meta["model_source"], meta.get("seq_len"))
    return build_from_spec(spec, seed=0)


def load_swarm_model(checkpoint: str | Path) -> tuple[nn.Module, dict]:
    """(the model with the swarm's parameters, the checkpoint's meta) from a 1-rank peer's checkpoint file."""
    path = Path(checkpoint)
    if path.is_dir():
        raise CheckpointError(f"{path} is a folder; export takes a 1-rank peer's checkpoint file (<run-id>.pt in "
                              "--checkpoint-dir); for a multi-rank peer, resume it with one rank to write one")
    state = load_checkpoint(path)
    if "model_source" not in state:
        raise CheckpointError(f"checkpoint {path} was written before export existed (it does not say how to rebuild "
                              "its model); resume the run once with this version to write a new one")
    model = _rebuild(state)
    model.load_state_dict(state["model_state"])
    with torch.no_grad():  # the swarm's agreed parameters, in the order of model.parameters()
        for p, g in zip(model.parameters(), state["optimizer"]["global_params"], strict=True):
            p.copy_(g)
    return model, state


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    """Write the checkpoint's swarm model to ``out_dir`` (see the module doc); returns ``out_dir``."""
    model, meta = load_swarm_model(checkpoint)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_name = meta.get("tokenizer") or "bytes"
    if isinstance(model, CausalLM) and model.hugging_face:
        model.inner.save_pretrained(out, safe_serialization=True)
        if tokenizer_name != "bytes":
            load_tokenizer(tokenizer_name).save(out)
    else:
        try:
            from safetensors.torch import save_model
        except ImportError:
            raise missing_extra("safetensors") from None
        save_model(unwrap(model), str(out / "model.safetensors"))  # save_model handles the tied embedding
    (out / EXPORT_META).write_text(json.dumps({
        "model_source": meta["model_source"], "model": meta["model"], "seq_len": meta.get("seq_len"),
        "tokenizer": tokenizer_name, "run_id": meta.get("run_id"), "outer_step": meta["optimizer"]["outer_step"],
    }, indent=2) + "\n")
    return out


def load_for_generation(path: str | Path) -> Loaded:
    """A checkpoint file or an exported folder, ready to sample from."""
    path = Path(path)
    if path.is_file():
        model, meta = load_swarm_model(path)
    elif (path / EXPORT_META).is_file():
        meta = json.loads((path / EXPORT_META).read_text())
        if (path / "config.json").is_file():
            spec = resolve_model(str(path), meta.get("seq_len"))
            model = build_from_spec(spec)  # the folder holds the weights: from_pretrained
        else:
            model = build_from_spec(resolve_model(meta["model_source"], meta.get("seq_len")))
            from safetensors.torch import load_model

            load_model(unwrap(model), str(path / "model.safetensors"))
        tokenizer_name = meta.get("tokenizer") or "bytes"
        meta = {**meta, "tokenizer": str(path) if tokenizer_name != "bytes" else "bytes"}
    else:
        raise ConfigError(f"{path} is neither a checkpoint file nor a folder written by p2ptrain export; pass one")
    seq_len = meta.get("seq_len") or 1024
    return Loaded(model.eval(), load_tokenizer(meta.get("tokenizer") or "bytes"), seq_len)


@torch.no_grad()
def generate(loaded: Loaded, prompt: str, *, max_new_tokens: int = 100, temperature: float = 0.8,
             top_k: Optional[int] = 50, seed: int = 0) -> str:
    """The prompt's continuation, sampled token by token (greedy at temperature 0)."""
    ids = loaded.tokenizer.encode_batch([prompt])[0] or loaded.tokenizer.separator[-1:] or [0]
    idx = torch.tensor([ids], dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(max_new_tokens):
        logits, _ = loaded.model(idx[:, -loaded.seq_len:])
        logits = logits[:, -1, :].float()
        if temperature <= 0:
            nxt = logits.argmax(dim=-1, keepdim=True)
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return loaded.tokenizer.decode(idx[0, len(ids):].tolist())
