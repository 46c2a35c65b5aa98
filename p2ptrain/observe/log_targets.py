"""``--log-to`` specs: ``tensorboard:DIR``, ``wandb`` or ``wandb:PROJECT``, parsed and checked without importing
either library or touching a file, so the CLI and the config check them before anything heavy is imported."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

KINDS = ("tensorboard", "wandb")
USAGE = "use tensorboard:DIR or wandb[:PROJECT]"
DEFAULT_WANDB_PROJECT = "p2ptrain"

WANDB_PROJECT_MAX_CHARS = 128
WANDB_PROJECT_FORBIDDEN = "/\\#?%:"
"""what wandb.Settings.validate_project refuses (wandb 0.31); checked here so the CLI says so before training"""


class LogToError(ValueError):
    """A ``--log-to`` spec or its folder is unusable; the one-line message names the spec and the fix."""


@dataclass(frozen=True)
class LogTarget:
    kind: str
    """``tensorboard`` or ``wandb``"""
    where: Optional[str]
    """tensorboard: the folder (each worker writes a subfolder of it); wandb: the project, None for the default"""

    def __str__(self) -> str:
        return self.kind if self.where is None else f"{self.kind}:{self.where}"


def parse_log_to(spec: str) -> LogTarget:
    """``tensorboard:DIR`` -> LogTarget("tensorboard", DIR); ``wandb`` / ``wandb:PROJECT`` -> LogTarget("wandb", ...).

    Pure: imports neither library and touches no file (the folder is checked in ``TrainingLoggers.open``)."""
    text = spec.strip()
    if not text:
        raise LogToError(f"--log-to {spec!r}: empty; {USAGE}")
    kind, sep, where = text.partition(":")  # the first ':' only: a folder may hold more
    kind = kind.strip().lower()
    if kind not in KINDS:
        raise LogToError(f"--log-to {spec!r}: unknown logger {kind!r}; {USAGE}")
    if kind == "tensorboard":
        if not where.strip():
            raise LogToError(f"--log-to {spec!r}: tensorboard needs a folder; use tensorboard:DIR, e.g. "
                             "tensorboard:runs")
        return LogTarget("tensorboard", os.path.expanduser(where))
    if not sep:
        return LogTarget("wandb", None)
    problem = wandb_project_problem(where)
    if problem:
        raise LogToError(f"--log-to {spec!r}: {problem}; use wandb:PROJECT with a name such as my-project, or wandb "
                         f"for the project {DEFAULT_WANDB_PROJECT!r}")
    return LogTarget("wandb", where)


def wandb_project_problem(project: str) -> Optional[str]:
    """Why W&B would refuse ``project`` as a project name (wandb 0.31's rules, plus empty), or None."""
    if not project.strip():
        return "the W&B project name is empty"
    if len(project) > WANDB_PROJECT_MAX_CHARS:
        return f"the W&B project name has {len(project)} characters, more than W&B's {WANDB_PROJECT_MAX_CHARS}"
    found = sorted({c for c in project if c in WANDB_PROJECT_FORBIDDEN})
    if found:
        return (f"the W&B project name {project!r} holds {' '.join(found)}, which W&B does not allow "
                f"(none of {' '.join(WANDB_PROJECT_FORBIDDEN)})")
    return None
