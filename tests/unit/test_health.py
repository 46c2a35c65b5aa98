"""The health file and the initial-peers file: what supervisors and containers read to start and watch peers."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

from p2ptrain.config import load_config
from p2ptrain.health import Heartbeat, check_health
from p2ptrain.swarm.dht import SwarmError, read_maddrs_file

MADDR = "/ip4/10.0.0.2/tcp/31337/p2p/QmVwb5Z5NJfMpTnYKDFV8qNifkXyojTAD4zUFADDX2VdgN"


def test_heartbeat_rewrites_the_file_and_the_check_reads_it(tmp_path):
    path = tmp_path / "health.json"
    assert "no health file" in check_health(str(path), 30)
    step = {"n": 0}
    beat = Heartbeat(str(path), lambda: dict(phase="training", outer_step=step["n"], dht_alive=True),
                     interval_s=0.05).start()
    try:
        step["n"] = 7
        deadline = time.monotonic() + 5
        while json.loads(path.read_text())["outer_step"] != 7:
            assert time.monotonic() < deadline, "the heartbeat did not pick up the new state"
            time.sleep(0.02)
        assert check_health(str(path), 30) is None
        assert json.loads(path.read_text())["pid"] > 0
    finally:
        beat.stop("left")
    assert check_health(str(path), 30) == "the daemon is left"


@pytest.mark.parametrize("record, problem", [
    (dict(phase="training", dht_alive=True, updated_at=0.0), "last written"),
    (dict(phase="failed", dht_alive=True, error="boom"), "the daemon is failed: boom"),
    (dict(phase="leaving", dht_alive=True), "the daemon is leaving"),
    (dict(phase="training", dht_alive=False), "DHT process is not running"),
    (dict(phase="joining", dht_alive=None), None),
])
def test_check_health_names_what_is_wrong(tmp_path, record, problem):
    path = tmp_path / "health.json"
    path.write_text(json.dumps({"updated_at": time.time(), **record}))
    result = check_health(str(path), 30)
    assert (result is None) if problem is None else (problem in result), result


def test_check_health_on_a_garbled_file_says_so(tmp_path):
    path = tmp_path / "health.json"
    path.write_text("{not json")
    assert "unreadable" in check_health(str(path), 30)


def test_initial_peers_file_is_waited_for(tmp_path):
    path = tmp_path / "maddrs"
    writer = threading.Timer(0.5, lambda: path.write_text(f"# the bootstrap peer\n{MADDR}\n\n"))
    writer.start()
    try:
        assert read_maddrs_file(str(path), timeout_s=10, poll_s=0.05) == [MADDR]
    finally:
        writer.cancel()


@pytest.mark.parametrize("content, message", [
    (None, "did not appear in 0s"),
    ("\n# nothing\n", "holds no multiaddr"),
    ("/ip4/10.0.0.2/tcp/31337\n", "has no /p2p/<peer id> part"),
    ("10.0.0.2:31337\n", "is not a multiaddr"),
])
def test_bad_initial_peers_file_is_one_clear_error(tmp_path, content, message):
    path = tmp_path / "maddrs"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SwarmError, match="--initial-peers-file") as e:
        read_maddrs_file(str(path), timeout_s=0.1, poll_s=0.05)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_hostname_in_checkpoint_dir_keeps_peers_on_one_volume_apart(tmp_path):
    config = load_config(None, {"train.checkpoint_dir": str(tmp_path / "{hostname}" / "ckpt")})
    assert config.train.checkpoint_dir == str(tmp_path / socket.gethostname() / "ckpt")
