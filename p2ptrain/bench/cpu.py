"""A fixed share of the CPU for each benchmark host: a cgroup with a CPU quota per worker (``bench --cpu-per-peer``).

Without it, N workers on fewer cores share them as the scheduler pleases: a worker that leaves the swarm (or sleeps,
as a throttled one does) hands its share to the others, so a run with fewer or slower peers is not a run on the same
hardware. With a quota, each worker and its children (p2pd) get at most ``cores`` CPUs' worth of time whatever the
others do, as a machine of its own would: the comparison the issue asks for ("two fast peers alone", "each peer's
solo throughput") then holds the hardware fixed. cgroup v2 (``cpu.max``) where the unified hierarchy has the cpu
controller, else v1 (``cpu.cfs_quota_us``); root is needed either way.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import List, Optional

PERIOD_US = 100_000
ROOTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
V1_ROOT = Path("/sys/fs/cgroup/cpu")


class CpuQuotaUnavailable(RuntimeError):
    pass


def _v2_root() -> Optional[Path]:
    for root in ROOTS:
        try:
            if "cpu" in (root / "cgroup.controllers").read_text().split():
                return root
        except OSError:
            continue
    return None


class CpuQuota:
    """One cgroup limited to ``cores`` CPUs; ``prefix()`` is a command prefix that runs its command inside it."""

    def __init__(self, name: str, cores: float):
        if cores <= 0:
            raise ValueError(f"a CPU quota of {cores} cores is not positive")
        root = _v2_root()
        quota = max(1000, round(cores * PERIOD_US))
        try:
            if root is not None:
                with open(root / "cgroup.subtree_control", "w") as f:
                    f.write("+cpu")
                self.path = root / name
                self.path.mkdir(exist_ok=True)
                (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            elif V1_ROOT.is_dir():
                self.path = V1_ROOT / name
                self.path.mkdir(exist_ok=True)
                (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
            else:
                raise CpuQuotaUnavailable("no cgroup cpu controller is mounted (cgroup v2 cpu.max or v1 cpu)")
        except OSError as e:
            raise CpuQuotaUnavailable(f"cannot make a cgroup with a CPU quota ({e}): --cpu-per-peer needs root "
                                      "and the cgroup cpu controller") from None

    def prefix(self) -> List[str]:
        """The command joins the cgroup, then becomes the command (its children, p2pd among them, stay in it)."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path)]

    def close(self, timeout_s: float = 10.0) -> None:
        """Remove the cgroup once its processes are gone (they are stopped before this)."""
        remove_cgroup(self.path, timeout_s)


def remove_cgroup(path: Path, timeout_s: float = 10.0) -> None:
    """rmdir ``path`` once its processes have left it; a process that outlives ``timeout_s`` leaves it in place
    (``bench --clean`` removes it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.2)


def leftover_cgroups(prefix: str = "p2ptrain-bench-") -> List[Path]:
    roots = [r for r in (_v2_root(), V1_ROOT) if r is not None and r.is_dir()]
    return [p for root in roots for p in root.glob(f"{prefix}*") if p.is_dir()]
