"""Bad input to the observability options: a taken port, a bad --log-to, a missing extra. One line, exit code 2,
and nothing left running."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.helpers import LOOPBACK, p2ptrain

PEER = "/ip4/127.0.0.1/tcp/9/p2p/QmSXUVsMGJFQBswMvF8D8Fmqy9QgjPzgfoqk3FUZv6ginu"


@pytest.fixture
def taken_port():
    """A port something else listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def one_line_error(result) -> str:
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    return lines[0]


@pytest.mark.parametrize("spec, words", [("tensorbord:runs", "unknown logger 'tensorbord'"),
                                         ("tensorboard", "tensorboard:DIR"), ("", "tensorboard:DIR")])
def test_a_bad_log_to_spec_is_refused_before_anything_starts(spec, words):
    line = one_line_error(p2ptrain("join", "--log-to", spec, "--initial-peers", PEER))
    assert words in line and "--log-to" in line


def refused_before_the_heavy_imports(*args: str) -> str:
    """``p2ptrain ARGS``'s one-line error, which must come before hivemind and torch are imported (``-X importtime``
    lists every module the command imported): a taken port used to be found when its server started, after the
    imports and the DHT (3-7 s on 2 cores)."""
    result = subprocess.run([sys.executable, "-X", "importtime", "-m", "p2ptrain", *args], capture_output=True,
                            text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=120)
    lines = result.stderr.splitlines()
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in lines if line.startswith("import time:")}
    assert not imported & {"torch", "hivemind"}, f"{args[0]} imported {imported & {'torch', 'hivemind'}} first"
    result.stderr = "\n".join(line for line in lines if not line.startswith("import time:"))
    return one_line_error(result)


def test_a_taken_metrics_port_is_refused_by_join_and_bootstrap(taken_port, tmp_path):
    line = refused_before_the_heavy_imports("join", "--metrics-port", str(taken_port), "--model", "tiny",
                                            "--host-maddrs", LOOPBACK, "--threads", "1", "--no-progress")
    assert f"--metrics-port {taken_port}: cannot listen on 127.0.0.1:{taken_port}" in line and "free port" in line
    line = refused_before_the_heavy_imports("bootstrap", "--metrics-port", str(taken_port), "--host-maddrs", LOOPBACK)
    assert f"--metrics-port {taken_port}" in line


def test_a_taken_dashboard_port_is_refused(taken_port):
    line = refused_before_the_heavy_imports("dashboard", "--port", str(taken_port), "--initial-peers", PEER)
    assert f"--port {taken_port}: cannot listen" in line
    line = refused_before_the_heavy_imports("bootstrap", "--dashboard-port", str(taken_port), "--host-maddrs",
                                            LOOPBACK)
    assert f"--dashboard-port {taken_port}: cannot listen" in line


def test_a_port_taken_after_the_commands_check_is_refused_when_its_server_starts(taken_port):
    """The servers' own answer to a taken port, for a port taken between the command's check and the server's start
    (the commands above no longer get that far): the same one-line error."""
    import threading
    from types import SimpleNamespace

    from p2ptrain.config import ObserveConfig, SwarmConfig
    from p2ptrain.observe import PortUnavailable
    from p2ptrain.bootstrap_peer import run_bootstrap
    from p2ptrain.peer import Worker

    observe = ObserveConfig(metrics_port=taken_port)
    worker = SimpleNamespace(config=SimpleNamespace(observe=observe, run_id="taken", diloco=SimpleNamespace(
        compression="fp16")))
    with pytest.raises(PortUnavailable, match=f"--metrics-port {taken_port}: cannot listen on 127.0.0.1"):
        Worker._start_metrics(worker, SimpleNamespace(identity="tiny"))
    swarm = SwarmConfig(host_maddrs=[LOOPBACK])
    with pytest.raises(PortUnavailable, match=f"--metrics-port {taken_port}: cannot listen on 127.0.0.1"):
        run_bootstrap(swarm, maddrs_file=None, stop=threading.Event(), observe=observe)
    with pytest.raises(PortUnavailable, match=f"--dashboard-port {taken_port}: cannot listen on 127.0.0.1"):
        run_bootstrap(swarm, maddrs_file=None, stop=threading.Event(), dashboard=("127.0.0.1", taken_port))


def test_the_dashboard_needs_an_initial_peer():
    line = one_line_error(p2ptrain("dashboard", "--port", "0"))
    assert "--initial-peers" in line


@pytest.mark.parametrize("flags, package, extra", [(("--metrics-port", "0"), "prometheus_client", "metrics"),
                                                   (("--log-to", "wandb"), "wandb", "wandb"),
                                                   (("--log-to", "tensorboard:tb"), "tensorboard", "tensorboard")])
def test_a_missing_extra_names_the_pip_install(flags, package, extra, tmp_path):
    shadow = tmp_path / package
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('not installed (test)')\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    line = one_line_error(subprocess.run([sys.executable, "-m", "p2ptrain", "join", *flags, "--initial-peers", PEER],
                                         capture_output=True, text=True, env=env, timeout=120))
    assert f"pip install 'p2ptrain[{extra}]'" in line and package in line
