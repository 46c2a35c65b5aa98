"""The progress-bar default: a bar on a terminal, periodic log lines in a file."""

from __future__ import annotations

import os

from p2ptrain.cli import draw_bars


def test_bars_only_on_a_terminal(tmp_path):
    with open(tmp_path / "log", "w") as log_file:
        assert draw_bars(None, log_file) is False  # systemd, docker, `> file`
        assert draw_bars(True, log_file) is True  # --progress insists
    leader, follower = os.openpty()
    try:
        with os.fdopen(follower, "w", closefd=False) as terminal:
            assert draw_bars(None, terminal) is True
            assert draw_bars(False, terminal) is False  # --no-progress
    finally:
        os.close(leader)
        os.close(follower)
    assert draw_bars(None, object()) is False  # a stream replaced by something without isatty
