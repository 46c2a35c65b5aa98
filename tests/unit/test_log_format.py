"""`--log-format json` (cli/logs.py): one JSON object a line from p2ptrain's, hivemind's and asyncio's loggers, the
traceback in ``exception`` with -v, and libraries' records still one line without it; the human format as before."""

from __future__ import annotations

import json
import logging
import os
import re

import pytest

from p2ptrain.cli.logs import LOG_FORMATS, setup_hivemind_logging, setup_logging

KEYS = {"time", "level", "logger", "message", "process"}
ISO_UTC_MS = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def json_lines(capsys) -> list:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines, "nothing was logged"
    return [json.loads(line) for line in lines]  # every line one object: fails on a traceback's extra lines


def failure() -> BaseException:
    try:
        raise ConnectionError("stream closed\nby the remote peer")
    except ConnectionError as e:
        return e


def test_json_lines_from_p2ptrain_and_hivemind(capsys):
    assert LOG_FORMATS == ("human", "json")
    setup_logging(verbose=False, log_format="json")
    setup_hivemind_logging()
    logging.getLogger("p2ptrain.peer").info("[peer1] outer step 3:\nsynced")
    logging.getLogger("hivemind.dht.node").warning("a peer did not answer")
    logging.getLogger("hivemind.dht.node").info("below the level without -v")
    p2ptrain_line, hivemind_line = json_lines(capsys)
    for entry, name, level in ((p2ptrain_line, "p2ptrain.peer", "INFO"), (hivemind_line, "hivemind.dht.node",
                                                                         "WARNING")):
        assert set(entry) == KEYS
        assert ISO_UTC_MS.match(entry["time"]), entry["time"]
        assert (entry["logger"], entry["level"], entry["process"]) == (name, level, os.getpid())
    assert p2ptrain_line["message"] == "[peer1] outer step 3:\nsynced"  # the newline escaped, inside the object


def test_a_traceback_in_exception_with_verbose(capsys):
    setup_logging(verbose=True, log_format="json")
    setup_hivemind_logging()
    error = failure()
    logging.getLogger("hivemind.averaging.allreduce").error("all-reduce failed", exc_info=error)
    logging.getLogger("p2ptrain.peer").exception("round failed", exc_info=error)
    logging.getLogger("p2ptrain.peer").debug("debug with -v")
    hivemind_line, p2ptrain_line, debug_line = json_lines(capsys)
    for entry in (hivemind_line, p2ptrain_line):
        assert set(entry) == KEYS | {"exception"} and entry["level"] == "ERROR"
        assert entry["exception"].startswith("Traceback (most recent call last):")
        assert "ConnectionError: stream closed\nby the remote peer" in entry["exception"]
        assert "failed" in entry["message"] and "Traceback" not in entry["message"]
    assert debug_line["level"] == "DEBUG" and "exception" not in debug_line


def test_without_verbose_a_library_traceback_is_summarized_in_the_message(capsys):
    setup_logging(verbose=False, log_format="json")
    setup_hivemind_logging()
    error = failure()
    logging.getLogger("hivemind.averaging.allreduce").error("all-reduce failed", exc_info=error)
    logging.getLogger("asyncio").error("Task exception was never retrieved", exc_info=error)
    logging.getLogger("p2ptrain.peer").error("round failed", exc_info=error)
    hivemind_line, asyncio_line, p2ptrain_line = json_lines(capsys)
    for entry in (hivemind_line, asyncio_line):
        assert "exception" not in entry
        assert entry["level"] == "WARNING"  # _OneLineFromLibraries, as in the human format
        assert entry["message"].endswith("(ConnectionError: by the remote peer)"), entry["message"]
    # p2ptrain's own records keep their traceback without -v, as they do in the human format
    assert "ConnectionError" in p2ptrain_line["exception"] and p2ptrain_line["level"] == "ERROR"


def test_human_format_unchanged(capsys):
    setup_logging(verbose=False)
    logging.getLogger("p2ptrain.peer").info("[peer1] synced")
    setup_logging(verbose=False, log_format="human")
    logging.getLogger("p2ptrain.peer").warning("late")
    err = capsys.readouterr().err
    # WARN once hivemind is imported (it renames the level process-wide), as before
    assert re.fullmatch(r"\d\d:\d\d:\d\d INFO p2ptrain\.peer: \[peer1\] synced\n"
                        r"\d\d:\d\d:\d\d WARN(ING)? p2ptrain\.peer: late\n", err), err


def test_an_unknown_format_names_the_choices():
    with pytest.raises(ValueError, match="human, json"):
        setup_logging(verbose=False, log_format="xml")
