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


def test_a_log_line_is_one_write_with_its_newline(monkeypatch):
    """Forked hivemind processes share stderr: a line written in two pieces (text, then newline) let another
    process's line land between them, and the CLI's one-line error was glued to a warning (CI)."""
    import io
    import logging
    import sys

    from p2ptrain.cli import _TqdmHandler

    writes = []

    class Recording(io.StringIO):
        def write(self, s):
            writes.append(s)
            return super().write(s)

    monkeypatch.setattr(sys, "stderr", Recording())
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))  # (level names are renamed by the CLI's setup)
    handler.emit(logging.LogRecord("p2ptrain", logging.WARNING, __file__, 1, "the loop is closed", None, None))
    assert [w for w in writes if w] == ["p2ptrain: the loop is closed\n"]
