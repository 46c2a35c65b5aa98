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


def test_a_taken_metrics_port_is_refused_by_join_and_bootstrap(taken_port, tmp_path):
    line = one_line_error(p2ptrain("join", "--metrics-port", str(taken_port), "--model", "tiny", "--host-maddrs",
                                   LOOPBACK, "--threads", "1", "--no-progress"))
    assert f"--metrics-port {taken_port}: cannot listen on 127.0.0.1:{taken_port}" in line and "free port" in line
    line = one_line_error(p2ptrain("bootstrap", "--metrics-port", str(taken_port), "--host-maddrs", LOOPBACK))
    assert f"--metrics-port {taken_port}" in line


def test_a_taken_dashboard_port_is_refused(taken_port):
    line = one_line_error(p2ptrain("dashboard", "--port", str(taken_port), "--initial-peers", PEER))
    assert f"--port {taken_port}: cannot listen" in line
    line = one_line_error(p2ptrain("bootstrap", "--dashboard-port", str(taken_port), "--host-maddrs", LOOPBACK))
    assert f"--dashboard-port {taken_port}: cannot listen" in line


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
