"""tests/conftest.py fails a pytest run that leaves new files in the git working tree, or processes running,
also ones orphaned by a child that died."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


def _repo(tmp_path: Path, test_body: str) -> Path:
    """A git checkout holding this suite's conftest.py and one test."""
    repo = tmp_path / "repo"
    repo.mkdir()
    shutil.copy(CONFTEST, repo / "conftest.py")
    (repo / ".gitignore").write_text("__pycache__/\n.pytest_cache/\nignored.log\n")
    (repo / "test_it.py").write_text(f"from pathlib import Path\n\n\ndef test_it():\n    {test_body}\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "."], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "init"], cwd=repo, check=True)
    return repo


def _pytest(repo: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider", "-p", "no:randomly",
                           *args],
                          cwd=repo, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "P2PTRAIN_TREE_CHECK": "1", **env})


def test_a_stray_file_fails_a_passing_run(tmp_path):
    repo = _repo(tmp_path, "Path(__file__).with_name('f_1.log').write_text('oops')")
    result = _pytest(repo)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 passed" in result.stdout
    assert "left 1 new entry in the working tree" in result.stdout and "?? f_1.log" in result.stdout


def test_a_clean_run_and_ignored_files_pass(tmp_path):
    repo = _repo(tmp_path, "Path(__file__).with_name('ignored.log').write_text('fine')")
    result = _pytest(repo)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "working tree" not in result.stdout


def test_files_there_before_the_run_do_not_count_and_the_check_can_be_off(tmp_path):
    repo = _repo(tmp_path, "Path(__file__).with_name('new.txt').write_text('x')")
    (repo / "draft.py").write_text("# someone's work in progress\n")
    result = _pytest(repo)
    assert result.returncode == 1 and "?? new.txt" in result.stdout and "draft.py" not in result.stdout
    (repo / "new.txt").unlink()
    assert _pytest(repo, P2PTRAIN_TREE_CHECK="0").returncode == 0


ORPHAN_TEST = """import subprocess, sys, time

def test_it():
    # a child that starts a grandchild and dies at once: the grandchild is an orphan
    code = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
    subprocess.run([sys.executable, "-c", code], check=True)
    time.sleep(0.5)
"""


def test_a_process_orphaned_by_a_dead_child_fails_the_test_that_leaked_it(tmp_path):
    repo = _repo(tmp_path, "pass")
    (repo / "test_it.py").write_text(ORPHAN_TEST)
    result = _pytest(repo, P2PTRAIN_TREE_CHECK="0", P2PTRAIN_REAP_GRACE_S="1")  # the sleeper will not leave by itself
    assert result.returncode == 1, result.stdout + result.stderr
    assert "the test left 1 child process(es) running" in result.stdout, result.stdout


LEAVING_TESTS = """import tempfile
from pathlib import Path

import pytest


def _leave(name):
    (Path(tempfile.gettempdir()) / f"p2ptrain-identity-{name}").mkdir()  # a key's folder no p2pd uses


@pytest.mark.slow
def test_slow():
    _leave("slow")


def test_default():
    _leave("default")
"""


def test_under_two_workers_a_default_tests_leftover_fails_it_and_a_slow_ones_is_reported(tmp_path):
    # `make test` runs the tests on 2 workers: what a slow test left must reach the report of the whole run
    repo = _repo(tmp_path, "pass")
    (repo / "test_it.py").write_text(LEAVING_TESTS)
    result = _pytest(repo, "-n", "2", P2PTRAIN_TREE_CHECK="0")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ERROR test_it.py::test_default - Failed: the test left 1 file(s) behind" in result.stdout, result.stdout
    assert "files left by slow tests" in result.stdout, result.stdout
    assert "test_it.py::test_slow: " in result.stdout and "p2ptrain-identity-slow" in result.stdout, result.stdout
