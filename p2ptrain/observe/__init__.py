"""Seeing the swarm: Prometheus metrics (metrics.py), training loggers (loggers.py: TensorBoard, W&B), the records
peers publish for the dashboard (telemetry.py), the dashboard itself (dashboard/) and plots of reports (plot.py).

Every library these use is an optional extra: the core install stays small, and a missing one is a one-line error
naming the ``pip install`` (``require``)."""

from __future__ import annotations

import importlib
from types import ModuleType


class MissingExtra(RuntimeError):
    """An optional dependency is not installed; the message names the feature and the ``pip install`` that adds it."""


def require(module: str, *, extra: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature``, or raise ``MissingExtra`` naming ``pip install 'p2ptrain[extra]'``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        raise MissingExtra(f"{feature} needs the {top} package, which is not installed: "
                           f"pip install 'p2ptrain[{extra}]'") from None


class PortUnavailable(OSError):
    """A server of ours (metrics, dashboard) cannot listen where it was told; the message names the flag and the fix."""


def listen_problem(flag: str, host: str, port: int, error: OSError) -> PortUnavailable:
    """The one-line error for ``flag``'s server failing to bind ``host:port``."""
    why = error.strerror or str(error)
    fix = "pick a free port, or 0 for any free one" if port else "check the address"
    return PortUnavailable(f"{flag} {port}: cannot listen on {host}:{port} ({why}); {fix}")
