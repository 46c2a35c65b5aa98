"""Training loggers (``--log-to``): a worker's scalars (train/loss, train/inner_lr, sync/seconds, eval/loss, ...) also
go to TensorBoard event files or a Weights & Biases run.

``parse_log_to`` only parses (the CLI and config check specs before anything heavy is imported); ``TrainingLoggers``
imports and starts the sinks in ``open()``. A sink that fails while training (disk full, a W&B error) logs one error
line and is switched off: logging is never worth stopping a worker that is averaging with others.

Several workers can log into one place: TensorBoard gets a folder per worker, ``DIR/<run_id>-<peer id's last 8>``
(TensorBoard shows them as runs side by side); W&B gets one run per worker named the same, grouped by ``run_id``.

The spec parsing is observe/log_targets.py, the TensorBoard and W&B writers observe/sinks.py; this module fans a
worker's scalars out to them.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, List, Optional, Sequence

from p2ptrain.observe.log_targets import LogTarget, LogToError
from p2ptrain.observe.sinks import Sink, TensorBoardSink, WandbSink, one_line

logger = logging.getLogger(__name__)


def _scalar(value: Any) -> Optional[float]:
    """A loggable number, or None: ints stay ints (W&B shows bytes exactly), the rest becomes a float (tensors,
    numpy). None and what will not convert are skipped, never raised."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


class TrainingLoggers:
    """The worker's ``--log-to`` sinks. ``open()`` once, ``scalars(...)`` every step or round, ``close()`` at the
    end (also a context manager). Thread-safe: the training loop and a round callback may log at once."""

    def __init__(self, targets: Sequence[LogTarget], *, run_id: str, peer_id: str, config: Dict[str, Any]):
        if sum(t.kind == "wandb" for t in targets) > 1:
            raise LogToError(f"--log-to {' '.join(repr(str(t)) for t in targets if t.kind == 'wandb')}: one W&B "
                             "run per worker; give --log-to wandb[:PROJECT] once")
        sink_types = {"tensorboard": TensorBoardSink, "wandb": WandbSink}
        self._sinks: List[Sink] = [sink_types[t.kind](t, run_id=run_id, peer_id=peer_id, config=dict(config))
                                    for t in targets]
        self._active: List[Sink] = []
        self._lock = threading.Lock()
        self._opened = False
        self._skipped_tags: set = set()

    @property
    def active(self) -> List[str]:
        """the names of the sinks still logging"""
        return [sink.name for sink in self._active]

    def open(self) -> "TrainingLoggers":
        """Import and start every sink. Raises MissingExtra (a package is missing) or LogToError (a folder is not
        writable) before any sink starts. A W&B run that cannot start (no network, a refused key) is logged as an
        error and left out: training goes on."""
        with self._lock:
            if self._opened:
                return self
            for sink in self._sinks:
                sink.prepare()
            self._opened = True
            try:
                for sink in self._sinks:
                    if isinstance(sink, TensorBoardSink):
                        sink.start()  # a LogToError here is the user's folder: raise it
                        self._active.append(sink)
                    elif self._try(sink, "could not start", sink.start):
                        self._active.append(sink)
            except BaseException:
                self._close_locked()
                raise
        return self

    def scalars(self, values: Dict[str, float], step: int, wall_time: Optional[float] = None) -> None:
        """Log each value as a scalar named by its key (``train/loss``) at ``step``. Never raises: a sink that
        fails is logged once and switched off; values that are not numbers (None) are skipped."""
        numbers: Dict[str, float] = {}
        for tag, value in values.items():
            number = _scalar(value)
            if number is None:
                if value is not None and tag not in self._skipped_tags:
                    self._skipped_tags.add(tag)
                    logger.warning(f"--log-to: {tag} = {value!r} is not a number; not logged")
                continue
            numbers[tag] = number
        try:
            step = int(step)
        except (TypeError, ValueError):
            logger.warning(f"--log-to: step {step!r} is not a whole number; {sorted(numbers)} not logged")
            return
        if not numbers:
            return
        with self._lock:
            for sink in list(self._active):
                if not self._try(sink, "stopped", sink.write, numbers, step, wall_time):
                    self._active.remove(sink)
                    try:  # the one error line is logged: whatever else is wrong with a broken sink is noise
                        sink.close()
                    except Exception as e:  # noqa: BLE001
                        logger.debug(f"--log-to {sink.name}: closing after the failure: {one_line(e)}")

    def close(self) -> None:
        """Flush and shut every sink down (W&B: finish the run, stop its service process). Idempotent."""
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        active, self._active = self._active, []
        for sink in active:
            self._try(sink, "did not close cleanly", sink.close)

    @staticmethod
    def _try(sink: Sink, what: str, fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except Exception as e:  # noqa: BLE001: a logger's failure must never reach the training loop
            logger.error(f"--log-to {sink.name} {what}: {one_line(e)}; training goes on without it")
            return False

    def __enter__(self) -> "TrainingLoggers":
        return self.open()

    def __exit__(self, *exc_info) -> None:
        self.close()


__all__ = ["TrainingLoggers"]
