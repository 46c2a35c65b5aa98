"""p2ptrain: DiLoCo training over a hivemind DHT."""

from typing import Any

__version__ = "0.1.0"

__all__ = ["DiLoCoOptimizer", "SyncRecord", "__version__"]

_LAZY = {"DiLoCoOptimizer": "p2ptrain.diloco", "SyncRecord": "p2ptrain.diloco"}


def __getattr__(name: str) -> Any:
    # the optimizer pulls in torch and hivemind (~2 s): import it on first use, so `p2ptrain --help` and the
    # commands that need neither start at once, while `from p2ptrain import DiLoCoOptimizer` works as before
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
