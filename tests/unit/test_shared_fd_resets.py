"""A DHT process killed while it fetches a command's pipe resets the resource sharer's connection: the peer logs it
instead of printing the traceback the stdlib's sharer thread hands to sys.excepthook (swarm/pipe.py)."""

from __future__ import annotations

import sys

from p2ptrain.swarm.pipe import quiet_shared_fd_resets


def raised_in(filename: str, error: BaseException) -> tuple:
    try:
        exec(compile("raise error", filename, "exec"), {"error": error})
    except BaseException:
        return sys.exc_info()


def test_a_reset_in_the_resource_sharer_is_logged_and_anything_else_still_reaches_the_hook(monkeypatch):
    reached = []
    monkeypatch.setattr(sys, "excepthook", lambda *info: reached.append(info[1]))
    quiet_shared_fd_resets()
    quiet_shared_fd_resets()  # once is enough: a second call wraps nothing more
    sharer = "/usr/lib/python3.11/multiprocessing/resource_sharer.py"
    sys.excepthook(*raised_in(sharer, ConnectionResetError(104, "Connection reset by peer")))
    assert reached == []
    other = [raised_in(sharer, ValueError("a bug")), raised_in("/somewhere/else.py", ConnectionResetError())]
    for info in other:
        sys.excepthook(*info)
    assert [type(e) for e in reached] == [ValueError, ConnectionResetError]
