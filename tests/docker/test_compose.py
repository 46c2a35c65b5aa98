"""The compose swarm for real: the image built through the offline path, a bootstrap peer and 3 workers from
docker/docker-compose.yml, one worker killed, one added, then `down` with the checkpoint volume left readable.

Needs a Docker engine (root here). Without one the test skips and says why, unless P2PTRAIN_REQUIRE_DOCKER=1
(what `.ci/run` sets once it has an engine up): then a missing engine is a failure like any other.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Dict, List

import pytest

from tests.helpers import own_round

REPO = Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker" / "docker-compose.yml"
IMAGE = "p2ptrain:compose-test"

pytestmark = [pytest.mark.docker, pytest.mark.timeout(2400)]


def run(*args: str, timeout: float = 300, check: bool = True, env=None) -> subprocess.CompletedProcess:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=env)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args[:4])}... exited {result.returncode}:\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="module")
def engine():
    try:
        answered = run("docker", "info", "--format", "{{.ServerVersion}}", check=False, timeout=30).returncode == 0
    except (FileNotFoundError, subprocess.TimeoutExpired):
        answered = False
    if not answered:
        if os.environ.get("P2PTRAIN_REQUIRE_DOCKER") == "1":
            pytest.fail("no Docker engine answers, but P2PTRAIN_REQUIRE_DOCKER=1 says one was started")
        pytest.skip("no Docker engine answers `docker info`; start dockerd (as root) to run the compose test")


@pytest.fixture(scope="module")
def image(engine):
    """Built through docker/build-offline.sh: the base image and the wheelhouse are cached between runs."""
    started = time.monotonic()
    result = subprocess.run(["bash", str(REPO / "docker" / "build-offline.sh"), IMAGE], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=2400)
    assert result.returncode == 0, f"build-offline.sh failed:\n{result.stdout[-5000:]}"
    print(f"image {IMAGE} built in {time.monotonic() - started:.0f}s")
    return IMAGE


class Compose:
    """docker-compose (1.29, or the v2 plugin) on docker/docker-compose.yml under a project name of its own."""

    def __init__(self, project: str, settings: Dict[str, str]):
        self.project = project
        self.env = {**os.environ, **settings}
        compose = ["docker-compose"] if shutil.which("docker-compose") else ["docker", "compose"]
        self.base = compose + ["-p", project, "-f", str(COMPOSE_FILE)]

    def __call__(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        return run(*self.base, *args, timeout=timeout, check=check, env=self.env)

    def containers(self, service: str, all_states: bool = False) -> List[str]:
        result = run("docker", "ps", "-q", "--no-trunc", *(["-a"] if all_states else []),
                     "--filter", f"label=com.docker.compose.project={self.project}",
                     "--filter", f"label=com.docker.compose.service={service}")
        return result.stdout.split()

    def volume_dir(self, name: str) -> Path:
        volume = f"{self.project}_{name}"
        return Path(run("docker", "volume", "inspect", "-f", "{{.Mountpoint}}", volume).stdout.strip())


def hostname(container: str) -> str:
    return run("docker", "inspect", "-f", "{{.Config.Hostname}}", container).stdout.strip()


def reports(compose: Compose, containers: List[str]) -> Dict[str, dict]:
    """Each container's `--report`, read from the checkpoint volume ({} before it first wrote one)."""
    root = compose.volume_dir("checkpoints")
    out = {}
    for c in containers:
        path = root / hostname(c) / "report.json"
        try:
            out[c] = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            out[c] = {}
    return out


def wait_for(condition, what: str, timeout_s: float, compose: Compose) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(2)
    logs = compose("logs", "--tail", "30", check=False).stdout
    raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}; the last log lines:\n{logs[-6000:]}")


def test_compose_swarm_survives_a_killed_worker_and_takes_a_new_one(image, tmp_path):
    project = f"p2ptest{os.getpid()}"
    compose = Compose(project, {
        "P2PTRAIN_IMAGE": image, "P2PTRAIN_RUN_ID": "composetest", "P2PTRAIN_LOCAL_STEPS": "20",
        "P2PTRAIN_CHECKPOINT_EVERY": "2", "P2PTRAIN_BOOTSTRAP_PORT": "0",  # a free host port: 31337 may be taken
    })
    try:
        compose("up", "-d", "--no-build", "--scale", "worker=3", timeout=600)
        first = compose.containers("worker")
        assert len(first) == 3

        def together(c: str, n: int, since: float = 0.0, group: int = 3) -> bool:
            rounds = reports(compose, [c])[c].get("rounds", [])
            return sum(own_round(r, group) and r["finished_at"] > since for r in rounds) >= n

        wait_for(lambda: all(together(c, 2) for c in first), "3 workers to commit 2 rounds together", 300, compose)
        assert run("docker", "inspect", "-f", "{{.State.Health.Status}}", compose.containers("bootstrap")[0]
                   ).stdout.strip() == "healthy"

        victim, survivors = first[0], first[1:]
        run("docker", "kill", victim)
        killed_at = time.time()
        wait_for(lambda: all(together(c, 2, since=killed_at, group=2) for c in survivors),
                 "the 2 survivors to commit 2 rounds after the kill", 300, compose)

        compose("up", "-d", "--no-build", "--no-recreate", "--scale", "worker=4", timeout=600)
        newcomers = [c for c in compose.containers("worker") if c not in first]
        assert len(newcomers) == 1, newcomers
        newcomer = newcomers[0]
        wait_for(lambda: together(newcomer, 1, group=3), "the newcomer to average in a round of its own", 300,
                 compose)
        joined = reports(compose, [newcomer])[newcomer]
        assert joined["state_download"]["bytes"] > 0 and joined["start_outer_step"] >= 3, joined
        assert joined["initial_eval_loss"] < 4.0, "the newcomer must start from the swarm's model, not from scratch"

        # graceful stop: SIGTERM, then each worker leaves with an exit checkpoint and exit code 0
        live = compose.containers("worker")
        compose("stop", timeout=600)
        logs = compose("logs", "--no-color", check=False).stdout
        assert "Traceback" not in logs, logs[-6000:]
        for c in live:
            code = run("docker", "inspect", "-f", "{{.State.ExitCode}}", c).stdout.strip()
            assert code == "0", f"worker {c[:12]} exited {code} on SIGTERM"
        final = reports(compose, compose.containers("worker", all_states=True))
        # every peer that committed an outer step holds the same global parameters at it
        digests: Dict[int, set] = {}
        for rep in final.values():
            for r in rep.get("rounds", []):
                if r["averaged"]:
                    digests.setdefault(r["outer_step"], set()).add(r["digest"])
        assert digests and all(len(d) == 1 for d in digests.values()), digests
        assert all(final[c]["stopped_by"] == "signal" for c in live), {c[:12]: final[c]["stopped_by"] for c in live}

        # `down` leaves the checkpoint volume; the image's own loader reads every checkpoint in it, and each
        # worker's exit checkpoint holds the outer step it last reported
        last_step = {hostname(c): final[c]["outer_steps"] for c in live}
        compose("down", timeout=300)
        probe = run("docker", "run", "--rm", "-v", f"{project}_checkpoints:/data/checkpoints", "--entrypoint",
                    "python", image, "-c",
                    "import json, pathlib; from p2ptrain.checkpoint import load_checkpoint as load; "
                    "print(json.dumps({p.parent.name: load(p)['optimizer']['outer_step'] "
                    "for p in pathlib.Path('/data/checkpoints').glob('*/composetest.pt')}))")
        steps = json.loads(probe.stdout.strip().splitlines()[-1])
        assert {host: steps.get(host) for host in last_step} == last_step, (steps, last_step)
    finally:
        compose("down", "-v", "--remove-orphans", "-t", "30", timeout=300, check=False)
