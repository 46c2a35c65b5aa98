"""Logging for the commands: one handler that writes around progress bars, and hivemind's records in one line each,
as text for a person or as one JSON object a line for a log collector (``--log-format``).

Only the CLI configures handlers; every other module just logs to ``logging.getLogger(__name__)``.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from datetime import datetime, timezone
from typing import Optional

LOG_FORMATS = ("human", "json")


class _TqdmHandler(logging.Handler):
    """Writes log lines around a running progress bar instead of through it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            # the line and its newline in one write: tqdm.write makes two, and a forked hivemind process writing to
            # the same stderr between them glued its line to ours ("...is closedError: could not join", in CI)
            tqdm.write(self.format(record) + "\n", file=sys.stderr, end="")
        except Exception:
            self.handleError(record)


_CLOSED_LOOP_CHILD = re.compile(r"^Loop .* that handles pid \d+ is closed$")


class _OneLineFromLibraries(logging.Filter):
    """Without -v, a record of hivemind (its host, DHT and averager processes, p2pd's output it relays) or asyncio
    is one line: the exception's type and last line in place of the traceback, and an ERROR becomes a warning.
    p2ptrain handles every failure these report (a round without a group, a peer that vanished mid-round, a stream
    that broke) and logs what it did about it; -v shows them in full."""

    LIBRARIES = ("hivemind", "asyncio")

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.name.startswith(self.LIBRARIES):
            return True
        message = record.getMessage()
        if record.name == "asyncio" and _CLOSED_LOOP_CHILD.search(message):
            # p2pd exited after hivemind closed the event loop that started it (a join that could not reach its
            # initial peers): asyncio's child watcher says so, but nothing is wrong and the error line said why
            return False
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            lines = str(error).strip().splitlines()
            summary = f"{type(error).__name__}: {lines[-1]}" if lines else type(error).__name__
            message = message if lines and lines[-1] in message else f"{message} ({summary})"
        record.msg, record.args = " | ".join(line for line in message.splitlines() if line.strip()), None
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        if record.levelno >= logging.ERROR:
            record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)
        return True


_HANDLER: Optional[logging.Handler] = None
_VERBOSE = False


class _JsonFormatter(logging.Formatter):
    """One JSON object a line: ``time`` (ISO 8601 UTC, milliseconds), ``level``, ``logger``, ``message``, ``process``
    (pid: the DHT and averager are forked processes writing to the same stream), and ``exception`` (the traceback)
    where the record still carries one after ``_OneLineFromLibraries``. json.dumps escapes the newlines of a
    multi-line message or traceback, so a collector that splits on lines never sees half an object."""

    # by number, not record.levelname: importing hivemind renames WARNING to WARN process-wide, so the same level
    # would go out under two names depending on whether a command had imported hivemind yet
    LEVELS = {logging.DEBUG: "DEBUG", logging.INFO: "INFO", logging.WARNING: "WARNING", logging.ERROR: "ERROR",
              logging.CRITICAL: "CRITICAL"}

    def format(self, record: logging.LogRecord) -> str:
        created = datetime.fromtimestamp(record.created, tz=timezone.utc)
        entry = {
            "time": created.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": self.LEVELS.get(record.levelno, record.levelname),
            "logger": record.name,
            "message": record.getMessage(),
            "process": record.process,
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


def setup_logging(verbose: bool, log_format: str = "human") -> None:
    """Send p2ptrain's and asyncio's records (and hivemind's, after ``setup_hivemind_logging``) through one handler
    that writes around progress bars, in ``log_format`` (one of LOG_FORMATS); ``verbose``: debug level, and the
    libraries' records with their tracebacks."""
    global _HANDLER, _VERBOSE
    if log_format not in LOG_FORMATS:
        raise ValueError(f"unknown log format {log_format!r}: use one of {', '.join(LOG_FORMATS)}")
    handler = _TqdmHandler()
    if log_format == "json":
        handler.setFormatter(_JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    if not verbose:
        handler.addFilter(_OneLineFromLibraries())
    _HANDLER, _VERBOSE = handler, verbose
    root = logging.getLogger("p2ptrain")
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    root.propagate = False
    # asyncio reports a task nobody awaited (in hivemind's processes too) through the root logger's last resort,
    # traceback and all: through our handler instead, one line without -v
    asyncio_logger = logging.getLogger("asyncio")
    asyncio_logger.handlers[:] = [handler]
    asyncio_logger.propagate = False
    if not verbose:
        logging.getLogger("hivemind").setLevel(logging.WARNING)
        # hivemind logs every round without a group as an ERROR with a traceback; DiLoCoOptimizer reports the
        # outcome of every round itself (a warning naming the policy), so only -v shows hivemind's version
        logging.getLogger("hivemind.averaging.averager").setLevel(logging.CRITICAL)


def setup_hivemind_logging() -> None:
    """Send hivemind's log records through our handler (one format, one line each without -v). Call after hivemind
    is imported (the commands that use it import it late, to keep --help fast): importing it installs its own
    handler and level, which this replaces. Processes forked later (the DHT, the averager) inherit the setting."""
    from hivemind.utils.logging import use_hivemind_log_handler

    if _HANDLER is None:
        return
    use_hivemind_log_handler("nowhere")  # removes hivemind's handler
    hivemind_logger = logging.getLogger("hivemind")
    hivemind_logger.handlers[:] = [_HANDLER]
    hivemind_logger.propagate = False
    hivemind_logger.setLevel(logging.DEBUG if _VERBOSE else logging.WARNING)


