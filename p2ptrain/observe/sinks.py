"""The ``--log-to`` destinations: TensorBoard event files (a folder per worker) and a Weights & Biases run (one per
worker, grouped by the run id). Each imports its library in ``prepare``; TrainingLoggers (observe/loggers.py) turns
what they raise while training into one error line."""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import tempfile
from typing import Any, Dict, Optional

from p2ptrain.observe import require
from p2ptrain.observe.log_targets import DEFAULT_WANDB_PROJECT, LogTarget, LogToError

logger = logging.getLogger(__name__)

TENSORBOARD_FLUSH_S = 5
"""a live TensorBoard sees a step at most this late (torch's default, 120 s, looks like a stalled run)"""
TENSORBOARD_MAX_QUEUE = 100
"""events held before an add_* call writes them itself: a step's dozen scalars never block the training thread"""

def worker_run_name(run_id: str, peer_id: str) -> str:
    """One worker's name in a shared TensorBoard folder or W&B group: the run, then the peer id's last 8 characters
    (base58 peer ids differ at the end, their start is a fixed multihash prefix)."""
    return f"{run_id}-{peer_id[-8:]}"


def one_line(error: BaseException) -> str:
    """``Type: message`` on one line, for a log line that says what went wrong."""
    text = " ".join(str(error).split()) or "no message"
    return f"{type(error).__name__}: {text}"


def _check_writable_folder(path: str, spec: str, fix: str) -> None:
    """Create ``path`` and write a scratch file in it: mode bits lie (root, read-only mounts, quotas), a write
    does not. Raises LogToError naming ``spec`` and ``fix``."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise LogToError(f"--log-to {spec!r}: {path} is a file, not a folder; {fix}")
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        reason = e.strerror or one_line(e)
        raise LogToError(f"--log-to {spec!r}: cannot write in {path} ({reason}); {fix}") from None



class Sink:
    """One destination. ``prepare`` imports and checks (raising MissingExtra / LogToError), ``start`` opens it,
    ``write`` and ``close`` may raise anything: TrainingLoggers turns that into one error line."""

    name: str

    def prepare(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def write(self, values: Dict[str, float], step: int, wall_time: Optional[float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


class TensorBoardSink(Sink):
    def __init__(self, target: LogTarget, *, run_id: str, peer_id: str, config: Dict[str, Any]):
        assert target.where is not None  # parse_log_to requires a folder
        self.spec = str(target)
        # a run id with '/' or spaces would nest or split folders
        folder = re.sub(r"[^\w.\-]", "_", worker_run_name(run_id, peer_id))
        self.log_dir = os.path.join(target.where, folder)
        self.name = f"tensorboard:{self.log_dir}"
        self.config = config
        self.writer = None

    def prepare(self) -> None:
        require("tensorboard", extra="tensorboard", feature="--log-to tensorboard")
        _check_writable_folder(self.log_dir, self.spec, "give a folder this user can write in (it is created if "
                                                        "missing)")

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter

        try:
            self.writer = SummaryWriter(self.log_dir, max_queue=TENSORBOARD_MAX_QUEUE, flush_secs=TENSORBOARD_FLUSH_S)
        except OSError as e:  # the folder went away between prepare and start
            raise LogToError(f"--log-to {self.spec!r}: cannot write in {self.log_dir} ({one_line(e)}); give a "
                             "folder this user can write in") from None
        if self.config:
            # 4-space indent: TensorBoard's text tab renders markdown, this keeps it a code block
            text = json.dumps(self.config, indent=2, sort_keys=True, default=str)
            self.writer.add_text("config", "\n".join("    " + line for line in text.splitlines()))
        logger.info(f"TensorBoard: writing to {self.log_dir} (tensorboard --logdir {os.path.dirname(self.log_dir)})")

    def write(self, values: Dict[str, float], step: int, wall_time: Optional[float]) -> None:
        # the writer's thread keeps a write error and re-raises it here, at the next add_scalar or flush
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step, walltime=wall_time)

    def close(self) -> None:
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close()  # flushes


class WandbSink(Sink):
    def __init__(self, target: LogTarget, *, run_id: str, peer_id: str, config: Dict[str, Any]):
        self.spec = str(target)
        self.project = target.where or DEFAULT_WANDB_PROJECT
        self.run_id, self.run_name = run_id, worker_run_name(run_id, peer_id)
        self.config = config
        self.name = f"wandb:{self.project}/{self.run_name}"
        self.root_dir = ""
        self.wandb = self.run = None
        self.last_step: Optional[int] = None
        self.saved_hooks = (sys.excepthook, sys.exit)

    def prepare(self) -> None:
        self.wandb = require("wandb", extra="wandb", feature="--log-to wandb")
        # W&B's own default, read as W&B reads it; W&B itself would fall back to /tmp if this is not writable,
        # where an offline run (the only copy of the numbers) is easily lost
        self.root_dir = os.path.abspath(os.environ.get("WANDB_DIR") or os.getcwd())
        _check_writable_folder(self.root_dir, self.spec, "set WANDB_DIR to a folder this user can write in (W&B "
                                                         "writes its runs under WANDB_DIR/wandb)")

    def start(self) -> None:
        wandb = self.wandb
        if wandb_needs_offline():
            mode, why = "offline", "no W&B API key is configured"
        else:  # W&B decides: online, or offline as the user set it
            mode, why = None, "W&B is set to offline: WANDB_MODE or wandb offline"
        run_name = self.run_name

        def stop_requested() -> None:  # W&B's default: SIGINT to the main thread, which would stop the worker
            logger.warning(f"W&B: the run {run_name} was stopped from the W&B app; training goes on")

        settings = dict(
            console="off",  # our stderr is the daemon's log: W&B must not capture or rewrite it
            disable_git=True, disable_code=True, save_code=False,  # start-up time and run dir size
            x_disable_stats=True, x_disable_meta=True, x_disable_machine_info=True, x_save_requirements=False,
            stop_fn=stop_requested)  # a plain function: W&B deep-copies its settings
        if "WANDB_SILENT" not in os.environ:
            settings["silent"] = True
        self.saved_hooks = (sys.excepthook, sys.exit)
        try:
            self.run = self._init(mode, settings)
        except Exception as e:
            comm_error = getattr(getattr(wandb, "errors", None), "CommError", ())
            if mode is not None or not isinstance(e, comm_error):
                raise
            # a key but no server (no network, a firewall): keep the numbers on disk for `wandb sync` rather
            # than lose them; this costs W&B's init_timeout (90 s, WANDB_INIT_TIMEOUT) once, at start
            logger.warning(f"W&B: cannot reach the W&B server ({one_line(e)}); recording offline instead")
            mode, why = "offline", "the W&B server did not answer"
            self.run = self._init(mode, settings)
        if getattr(self.run, "offline", False):
            run_dir = self.run.settings.sync_dir
            logger.info(f"W&B: recording run {self.run_name} offline ({why}) in {run_dir}; upload it later with: "
                        f"wandb sync {run_dir}")
        else:
            logger.info(f"W&B: logging to project {self.project}, run {self.run_name} (group {self.run_id})")

    def _init(self, mode: Optional[str], settings: Dict[str, Any]):
        wandb = self.wandb
        # process-wide too, not only for this run: W&B 0.31 reads the global mode to decide whether wandb.init
        # may send its own usage analytics to the W&B server (an offline run must not), and prints its login
        # line unless silent globally
        process_wide = {key: settings[key] for key in ("silent",) if key in settings}
        if mode == "offline":
            process_wide["mode"] = "offline"
        try:
            if process_wide:
                wandb.setup(settings=wandb.Settings(**process_wide))
            return wandb.init(project=self.project, group=self.run_id, name=self.run_name, config=self.config,
                              dir=self.root_dir, mode=mode, reinit="create_new", settings=wandb.Settings(**settings))
        except BaseException:
            self._stop_service()  # init starts wandb-core before it can fail
            raise

    def write(self, values: Dict[str, float], step: int, wall_time: Optional[float]) -> None:
        # W&B drops (with a printed warning) a step below the last one; the same step again adds to that row. A
        # worker that took the swarm's state can go back in steps: those points are dropped here, quietly.
        # W&B stamps each row itself: wall_time is not passed on.
        if self.last_step is not None and step < self.last_step:
            logger.debug(f"W&B: dropped step {step} of {self.run_name}: W&B steps only go up, {self.last_step} "
                         "is logged already")
            return
        self.run.log(dict(values), step=step)  # a copy: the same dict goes to every sink
        self.last_step = step

    def close(self) -> None:
        run, self.run = self.run, None
        if run is None:
            return
        try:
            run.finish()
        finally:
            self._stop_service()

    def _stop_service(self) -> None:
        # run.finish leaves W&B's wandb-core service process running until interpreter exit; the daemon has no
        # other W&B run, so it stops here and no process outlives the loggers
        if self.wandb is not None and getattr(self.wandb, "run", None) is None:
            self.wandb.teardown()
        # wandb.init wraps sys.excepthook and sys.exit (to mark a crashed run) and leaves them wrapped: put back
        # the daemon's own, unless something else replaced them since
        excepthook, exit_fn = self.saved_hooks
        if getattr(sys.excepthook, "__module__", "").startswith("wandb"):
            sys.excepthook = excepthook
        if getattr(sys.exit, "__module__", "").startswith("wandb"):
            sys.exit = exit_fn


def wandb_needs_offline() -> bool:
    """True when ``wandb.init`` would find no credentials and no mode chosen by the user: it would then prompt for
    a key or fail, so the run is recorded offline instead. Mirrors wandb 0.31's lookup
    (``wbauth.authenticate._use_system_auth``): WANDB_API_KEY or WANDB_IDENTITY_TOKEN_FILE, a .netrc entry for the
    W&B host (NETRC, else ~/.netrc), an api_key in W&B's settings file, a ``wandb.login()`` earlier in this
    process. A mode the user set (WANDB_MODE, ``wandb offline``) is left to W&B."""
    if os.environ.get("WANDB_MODE") or os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return False
    try:
        from wandb.errors import AuthenticationError
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth

        # W&B's own settings (WANDB_BASE_URL, ~/.config/wandb/settings); loading them starts no process
        settings = wandb_setup.singleton().settings
        if settings.mode in ("offline", "dryrun", "disabled") or settings.api_key:
            return False
        host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
        return wbauth.session_credentials(host=host) is None and wbauth.read_netrc_auth(host=host) is None
    except (ImportError, AttributeError, TypeError):  # W&B moved its internals: offline beats a login prompt
        return True
    except AuthenticationError:  # a key is there but malformed: the online start says so
        return False
