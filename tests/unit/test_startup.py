"""`p2ptrain --help` starts at once: the CLI and the config import neither torch nor hivemind until a command runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

HELP_THEN_REPORT = """
import sys
from p2ptrain.cli import cli
for args in {argvs!r}:
    try:
        cli.main(args=args, prog_name="p2ptrain", standalone_mode=False)
    except SystemExit:
        pass
print("HEAVY", "torch" in sys.modules, "hivemind" in sys.modules)
"""


def _heavy_after(*argvs: list) -> str:
    out = subprocess.run([sys.executable, "-c", HELP_THEN_REPORT.format(argvs=list(argvs))], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Usage: p2ptrain" in out.stdout  # the help was really printed
    return out.stdout.strip().splitlines()[-1]


def test_help_imports_neither_torch_nor_hivemind():
    commands = [["--help"], ["join", "--help"], ["bootstrap", "--help"], ["status", "--help"], ["demo", "--help"],
                ["bench", "--help"], ["keygen", "--help"], ["health", "--help"]]
    assert _heavy_after(*commands) == "HEAVY False False"


def test_config_imports_neither_torch_nor_hivemind():
    code = ("import sys; from p2ptrain.config import RunConfig, SwarmConfig, default_threads; "
            "import p2ptrain; print('torch' in sys.modules, 'hivemind' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr


def test_lazy_exports_still_work():
    import p2ptrain
    from p2ptrain import DiLoCoOptimizer, SyncRecord
    from p2ptrain.diloco import DiLoCoOptimizer as direct

    assert DiLoCoOptimizer is direct and SyncRecord.__module__ == "p2ptrain.diloco.records"
    assert set(p2ptrain.__all__) <= set(dir(p2ptrain)) | {"DiLoCoOptimizer", "SyncRecord"}


def test_light_copies_agree_with_the_heavy_modules():
    """config spells out the names it checks so that it need not import the modules that define them."""
    from p2ptrain import config, diloco
    from p2ptrain.averaging.compression import COMPRESSION_CHOICES
    from p2ptrain.averaging.robust import AGGREGATIONS
    from p2ptrain.swarm import dht

    assert list(config.COMPRESSION_NAMES) == list(COMPRESSION_CHOICES)
    assert tuple(config.NO_GROUP_POLICIES) == tuple(diloco.NO_GROUP_POLICIES)
    assert tuple(config.AGGREGATION_NAMES) == tuple(AGGREGATIONS)
    assert dht.SwarmConfig is config.SwarmConfig  # the old import path still works


def test_default_threads_is_the_cores_this_process_may_use():
    import os

    from p2ptrain.config import default_threads

    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert default_threads() == expected >= 1
    if hasattr(os, "sched_setaffinity"):  # a process pinned to one core (taskset, a container's cpuset) gets 1
        code = ("import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
                "from p2ptrain.config import default_threads; print(default_threads())")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "1", out.stderr


REFUSE_THEN_REPORT = """
import sys
import click
from p2ptrain.cli import cli
try:
    cli.main(args={args!r}, prog_name="p2ptrain", standalone_mode=False)
except click.ClickException as e:
    print("EXIT", e.exit_code, e.format_message())
print("HEAVY", "torch" in sys.modules, "hivemind" in sys.modules)
"""


@pytest.mark.parametrize("args, fragment", [
    (["join", "--initial-peers", "bootstrap.example.org:4001"], "is not a multiaddr"),
    (["join", "--initial-peers", "/ip4/127.0.0.1/tcp/4001"], "has no /p2p/<peer id>"),
    (["bootstrap", "--host-maddrs", "0.0.0.0:4001"], "is not a multiaddr"),
    (["join", "--model", "gigantic"], "train.model 'gigantic' is unknown"),
    (["join", "--data", "/nonexistent/corpus"], "no such file or folder"),
    (["status"], "needs --initial-peers"),
])
def test_a_bad_flag_is_reported_before_torch_or_hivemind_is_imported(args, fragment):
    """A typo costs a fraction of a second, not the 3-5 s of importing torch and hivemind first."""
    out = subprocess.run([sys.executable, "-c", REFUSE_THEN_REPORT.format(args=args)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    refused, heavy = out.stdout.strip().splitlines()[-2:]
    assert refused.startswith("EXIT 2 ") and fragment in refused, out.stdout
    assert heavy == "HEAVY False False"
