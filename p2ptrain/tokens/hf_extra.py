"""The ``hf`` extra's packages (transformers, tokenizers, pyarrow, datasets), imported only when a source or a
tokenizer needs them, so the byte-level path works without them."""

from __future__ import annotations

import importlib

from p2ptrain.data import DataError

HF_EXTRA = "pip install 'p2ptrain[hf]'"


def require_package(module: str, needed_for: str):
    """``module``, imported now; DataError naming the pip command if the ``hf`` extra is not installed."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise DataError(f"{needed_for} needs the {module.split('.')[0]} package, which is not installed; "
                        f"{HF_EXTRA}") from None


def first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]
