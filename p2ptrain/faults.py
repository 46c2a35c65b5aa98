"""Deterministic fault injection for chaos tests: crash a peer at a chosen point of the protocol.

Killing a process from outside at the right moment is a race: with the tiny model an all-reduce lasts ~0.1 s.
So the chaos tests tell the victim where to die, through one environment variable read at start-up::

    P2PTRAIN_FAULT=kill-mid-allreduce@<outer_step>[:<parts>]
    P2PTRAIN_FAULT=kill-mid-allreduce@any[:<parts>]
    P2PTRAIN_FAULT=kill-mid-state-transfer[:<chunks>]

The peer then dies (SIGKILL of its main process and every child: DHT, averager, p2pd, as when the host crashes):

* ``kill-mid-allreduce``: while it reduces the first round it takes part in from ``outer_step`` on, right after it
  has answered ``parts`` (default 1) tensor parts to its senders: some senders hold its averages, the others never
  will. From that step on, not at it alone: a victim that came late to that round was left out of it by design, and
  lived (CI, test_chaos_swarm). ``@any``: in the first round it reduces, whatever its outer step (a newcomer's,
  which starts where the swarm is);
* ``kill-mid-state-transfer``: as a donor, right after it has served ``chunks`` (default 1) chunks of its state
  to newcomers, so a transfer has to resume from other donors.

Unset, nothing happens.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Optional

import psutil

ENV_VAR = "P2PTRAIN_FAULT"
_PATTERNS = {
    "allreduce": re.compile(r"kill-mid-allreduce@(?P<step>\d+|any)(?::(?P<count>\d+))?"),
    "state": re.compile(r"kill-mid-state-transfer(?::(?P<count>\d+))?"),
}


@dataclass(frozen=True)
class Fault:
    kind: str
    """"allreduce" or "state" """
    outer_step: int = -1
    """allreduce: the round (by the outer step its members start from) in which the peer dies; -1: any round"""
    count: int = 1
    """allreduce: averaged parts this peer answers as a reducer before it dies; state: chunks it serves"""


def fault_from_env() -> Optional[Fault]:
    """The fault this process was asked to inject, or None. A malformed value is an error, not a silent no-op."""
    value = os.environ.get(ENV_VAR, "").strip()
    if not value:
        return None
    for kind, pattern in _PATTERNS.items():
        match = pattern.fullmatch(value)
        if match:
            fields = match.groupdict()
            step = fields.get("step") or "any"
            return Fault(kind, outer_step=-1 if step == "any" else int(step), count=int(fields["count"] or 1))
    raise ValueError(
        f"{ENV_VAR}={value!r} is not understood; use kill-mid-allreduce@<outer_step>[:<parts>] or "
        "kill-mid-state-transfer[:<chunks>], e.g. kill-mid-allreduce@2:1 or kill-mid-allreduce@any, or unset it"
    )


def kill_this_peer() -> None:
    """SIGKILL the whole peer at once, from any of its processes: its main process (hivemind's children are forks,
    so they share its command line; its own parent does not), everything under it, and finally this process."""
    me = psutil.Process()
    root = me
    while root.parent() is not None and _cmdline(root.parent()) == _cmdline(me):
        root = root.parent()
    victims = [root, *root.children(recursive=True)]
    for proc in victims:  # stop first, so nobody notices the others dying and reacts
        if proc.pid != me.pid:
            _signal(proc, "suspend")
    for proc in victims:
        if proc.pid != me.pid:
            _signal(proc, "kill")
    me.kill()


def _cmdline(proc: psutil.Process) -> list:
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []


def _signal(proc: psutil.Process, action: str) -> None:
    try:
        getattr(proc, action)()
    except psutil.NoSuchProcess:
        pass
