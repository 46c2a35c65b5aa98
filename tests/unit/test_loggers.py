"""--log-to: spec parsing, TensorBoard event files and an offline W&B run read back with each tool's own reader, a sink
that fails while training, and the one-line errors for a missing extra or an unusable folder."""

from __future__ import annotations

import json
import logging
import struct
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Dict, List

import psutil
import pytest

from p2ptrain.observe import MissingExtra
from p2ptrain.observe import sinks as sinks_module
from p2ptrain.observe.log_targets import LogTarget, LogToError, parse_log_to
from p2ptrain.observe.loggers import TrainingLoggers
from p2ptrain.observe.sinks import wandb_needs_offline

PEER_ID = "12D3KooWQxk1pQsPr2ej9UBrfA5UWfngQVgq2Sv8VfMpeFgs4Jh5"
RUN = "run-a"
WORKER = f"{RUN}-{PEER_ID[-8:]}"
CONFIG = {"model": "tiny", "inner_lr": 3e-4, "local_steps": 5}
TAGS = ("train/loss", "train/inner_lr", "sync/bytes_sent")


def _values(step: int) -> Dict[str, float]:
    return {"train/loss": 4.0 / step, "train/inner_lr": 1e-4 * step, "sync/bytes_sent": 1000 * step}


def _loggers(*targets: LogTarget) -> TrainingLoggers:
    return TrainingLoggers(list(targets), run_id=RUN, peer_id=PEER_ID, config=CONFIG)


def _tensorboard_scalars(log_dir: Path, tag: str):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)] if tag in events.Tags()["scalars"] else []


# ---------------------------------------------------------------------------------------------- parse_log_to


@pytest.mark.parametrize("spec, kind, where", [
    ("tensorboard:/abs/dir", "tensorboard", "/abs/dir"),
    ("tensorboard:rel/dir", "tensorboard", "rel/dir"),
    ("TensorBoard:runs", "tensorboard", "runs"),
    ("tensorboard:dir:with:colons", "tensorboard", "dir:with:colons"),
    ("wandb", "wandb", None),
    ("wandb:myproj", "wandb", "myproj"),
    (" wandb:my-proj_2.b ", "wandb", "my-proj_2.b"),
])
def test_parse_good_specs(spec, kind, where):
    assert parse_log_to(spec) == LogTarget(kind, where)


@pytest.mark.parametrize("spec, problem", [
    ("tensorbord:runs", "unknown logger 'tensorbord'"),
    ("tb:runs", "unknown logger 'tb'"),
    ("", "empty"),
    ("   ", "empty"),
    ("tensorboard", "needs a folder"),
    ("tensorboard:", "needs a folder"),
    ("wandb:", "project name is empty"),
    ("wandb:team/proj", "/"),
    ("wandb:a#b", "#"),
    ("wandb:what?", "?"),
    ("wandb:100%", "%"),
    ("wandb:a:b", ":"),
    ("wandb:a\\b", "\\"),
    ("wandb:" + "p" * 129, "more than W&B's 128"),
])
def test_parse_bad_specs_name_the_spec_and_the_fix(spec, problem):
    with pytest.raises(LogToError) as caught:
        parse_log_to(spec)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"--log-to {spec!r}: ")
    assert problem in message
    assert "use " in message  # the fix


def test_parse_imports_neither_library():
    # the CLI checks specs before anything heavy is loaded: parsing must not pull them in
    code = ("import sys; from p2ptrain.observe.log_targets import parse_log_to; parse_log_to('wandb:x'); "
            "parse_log_to('tensorboard:d'); print(sorted(m for m in ('wandb', 'tensorboard') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_one_wandb_run_per_worker():
    with pytest.raises(LogToError, match="give --log-to wandb\\[:PROJECT\\] once"):
        _loggers(LogTarget("wandb", None), LogTarget("wandb", "other"))


# ---------------------------------------------------------------------------------------------- TensorBoard


def test_tensorboard_scalars_read_back(tmp_path):
    loggers = _loggers(parse_log_to(f"tensorboard:{tmp_path}")).open()
    for step in range(1, 6):
        loggers.scalars(_values(step), step=step, wall_time=1_000_000.0 + step)
    loggers.scalars({"eval/loss": None}, step=5)  # no eval this round: skipped, not an error
    loggers.close()
    loggers.close()  # idempotent
    loggers.scalars(_values(6), step=6)  # after close: nothing, no error

    log_dir = tmp_path / WORKER  # one folder per worker, so several can share DIR
    assert log_dir.is_dir() and list(log_dir.glob("events.out.tfevents.*"))
    for tag in TAGS:
        got = _tensorboard_scalars(log_dir, tag)
        assert [step for step, _ in got] == [1, 2, 3, 4, 5]
        assert [value for _, value in got] == pytest.approx([_values(s)[tag] for s in range(1, 6)], rel=1e-6)
    assert _tensorboard_scalars(log_dir, "eval/loss") == []


def test_tensorboard_dir_that_is_a_file(tmp_path):
    taken = tmp_path / "runs"
    taken.write_text("not a folder")
    loggers = _loggers(parse_log_to(f"tensorboard:{taken}"))
    with pytest.raises(LogToError) as caught:
        loggers.open()
    message = str(caught.value)
    assert "\n" not in message and f"tensorboard:{taken}" in message and "give a folder" in message


def test_a_failing_sink_is_switched_off_and_the_other_goes_on(tmp_path, monkeypatch, caplog):
    from torch.utils.tensorboard import SummaryWriter

    full, fine = tmp_path / "full", tmp_path / "fine"
    add_scalar = SummaryWriter.add_scalar
    calls = {"full": 0}

    def disk_full(self, *args, **kwargs):
        if str(full) in self.log_dir:
            calls["full"] += 1
            raise OSError(28, "No space left on device")
        return add_scalar(self, *args, **kwargs)

    monkeypatch.setattr(SummaryWriter, "add_scalar", disk_full)
    loggers = _loggers(parse_log_to(f"tensorboard:{full}"), parse_log_to(f"tensorboard:{fine}")).open()
    with caplog.at_level(logging.DEBUG, logger="p2ptrain.observe"):
        for step in range(1, 4):
            loggers.scalars(_values(step), step=step)  # never raises
    loggers.close()

    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    line = errors[0].getMessage()
    assert "\n" not in line and f"tensorboard:{full / WORKER}" in line and "No space left on device" in line
    assert calls["full"] == 1  # later steps never reach the broken sink
    assert [s for s, _ in _tensorboard_scalars(fine / WORKER, "train/loss")] == [1, 2, 3]


# ---------------------------------------------------------------------------------------------- W&B


def _drop_wandb_settings() -> None:
    # the real wandb_setup even while a test has a stand-in as sys.modules["wandb"]
    wandb_setup = sys.modules.get("wandb.sdk.wandb_setup")
    if wandb_setup is not None:
        wandb_setup.teardown()


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """Every folder W&B writes to under tmp_path, no credentials from this machine, and W&B's process-wide
    settings dropped before and after (W&B caches the environment it first saw)."""
    _drop_wandb_settings()
    for name in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_ENTITY",
                 "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    for name, sub in (("WANDB_DIR", "root"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_CONFIG_DIR", "config"),
                      ("WANDB_DATA_DIR", "data"), ("WANDB_ARTIFACT_DIR", "artifacts")):
        (tmp_path / sub).mkdir()
        monkeypatch.setenv(name, str(tmp_path / sub))
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # absent: no key from ~/.netrc
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield tmp_path
    _drop_wandb_settings()


def _wandb_records(path: Path) -> list:
    """The records of a ``.wandb`` transaction log (wandb 0.31 has no Python reader of its own any more): a 7-byte
    header (``:W&B``, magic 0xBEE1, version), then LevelDB-log framing in 32 KiB blocks (crc32, length, type;
    type 1 = a whole record, 2/3/4 = first/middle/last piece), each record a ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B" and struct.unpack("<H", data[4:6])[0] == 0xBEE1, data[:7]
    block_bytes, frame_bytes = 32 * 1024, 7
    pos, pieces, records = 7, b"", []
    while pos + frame_bytes <= len(data):
        left_in_block = block_bytes - pos % block_bytes
        if left_in_block < frame_bytes:  # block trailer: zero padding
            pos += left_in_block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + frame_bytes])
        chunk = data[pos + frame_bytes:pos + frame_bytes + length]
        pos += frame_bytes + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces + chunk)
            records.append(record)
            pieces = b""
        elif kind in (2, 3):
            pieces += chunk
        else:
            raise AssertionError(f"frame type {kind} at byte {pos}")
    return records


def _wandb_children() -> List[str]:
    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if "wandb" in proc.name() or "wandb" in " ".join(proc.cmdline()):
                found.append(f"{proc.pid} {proc.name()}")
        except psutil.NoSuchProcess:
            pass
    return found


class _FakeCommError(Exception):
    """stands in for wandb.errors.CommError"""


def _fake_wandb(init) -> types.ModuleType:
    """A stand-in for the wandb module whose ``init`` is the test's."""
    module = types.ModuleType("wandb")
    module.Settings, module.init, module.run = dict, init, None
    module.setup = module.teardown = lambda **kwargs: None
    module.errors = types.SimpleNamespace(CommError=_FakeCommError)
    return module


class _FakeRun:
    def __init__(self, sync_dir: Path, fail: bool = False):
        self.offline, self.settings, self.fail = True, types.SimpleNamespace(sync_dir=str(sync_dir)), fail
        self.logged: List[int] = []

    def log(self, values, step):
        self.logged.append(step)
        if self.fail:
            raise RuntimeError("wandb-core\nwent away")

    def finish(self):
        pass


def test_wandb_failures_while_starting_or_training_are_logged_not_raised(wandb_env, monkeypatch, caplog):
    """W&B stand-in: a start that fails (a refused key) leaves W&B out; a log call that fails later switches it
    off; TensorBoard goes on in both cases."""
    monkeypatch.setattr(sinks_module, "wandb_needs_offline", lambda: True)
    failing = _FakeRun(wandb_env / "offline-run-x", fail=True)

    def refused(**kwargs):
        raise RuntimeError("api.wandb.ai: 401 unauthorized")

    cases = [(refused, "could not start: RuntimeError: api.wandb.ai: 401 unauthorized"),
             (lambda **kwargs: failing, "stopped: RuntimeError: wandb-core went away")]
    for attempt, (init, expect) in enumerate(cases):
        monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(init))
        caplog.clear()
        board = wandb_env / f"board-{attempt}"
        loggers = _loggers(parse_log_to("wandb:proj"), parse_log_to(f"tensorboard:{board}"))
        with caplog.at_level(logging.INFO, logger="p2ptrain.observe"):
            loggers.open()
            for step in range(1, 4):
                loggers.scalars(_values(step), step=step)
            loggers.close()
        errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and f"wandb:proj/{WORKER} {expect}" in errors[0], errors
        assert [s for s, _ in _tensorboard_scalars(board / WORKER, "train/loss")] == [1, 2, 3]
    assert failing.logged == [1]


def test_wandb_records_offline_when_the_server_does_not_answer(wandb_env, monkeypatch, caplog):
    monkeypatch.setattr(sinks_module, "wandb_needs_offline", lambda: False)  # a key is configured
    run, modes = _FakeRun(wandb_env / "offline-run-y"), []

    def init(**kwargs):
        modes.append(kwargs["mode"])
        if kwargs["mode"] != "offline":
            raise _FakeCommError("Timed out while retrying: connection refused")
        return run

    monkeypatch.setitem(sys.modules, "wandb", _fake_wandb(init))
    with caplog.at_level(logging.INFO, logger="p2ptrain.observe"):
        loggers = _loggers(parse_log_to("wandb")).open()
        loggers.scalars(_values(1), step=1)
        loggers.close()
    assert modes == [None, "offline"] and run.logged == [1]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("recording offline instead" in r.getMessage() for r in caplog.records)
    assert any("the W&B server did not answer" in r.getMessage() and "wandb sync " in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("wandb_mode, why", [("offline", "W&B is set to offline"),
                                              (None, "no W&B API key is configured")])
def test_wandb_offline_run_read_back(wandb_env, monkeypatch, caplog, wandb_mode, why):
    if wandb_mode is None:
        # offline because no key is configured; were it not, W&B would find no server here rather than the real one
        monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")
    else:
        monkeypatch.setenv("WANDB_MODE", wandb_mode)
    hooks = (sys.excepthook, sys.exit)
    started_s = time.monotonic()
    loggers = _loggers(parse_log_to("wandb:p2ptrain-test"))
    with caplog.at_level(logging.DEBUG, logger="p2ptrain.observe"):
        loggers.open()
        during = _wandb_children()
        for step in range(1, 6):
            loggers.scalars(_values(step), step=step)
        loggers.scalars({"eval/loss": 2.5}, step=5)  # same step again: the same row
        loggers.scalars({"train/loss": 99.0}, step=3)  # went back: dropped, not raised
        loggers.close()
    left = _wandb_children()
    seconds = time.monotonic() - started_s
    print(f"W&B offline run: open, 7 calls, close in {seconds:.1f} s")

    assert during, "expected W&B's service process while the run was open (is the check below still meaningful?)"
    assert left == [], f"W&B processes left after close: {left}"
    assert (sys.excepthook, sys.exit) == hooks  # wandb.init wraps both; close puts them back
    # ours only: wandb's own loggers propagate to the root logger too (0.31 logs "offline" twice itself)
    ours = [r for r in caplog.records if r.name.startswith("p2ptrain")]
    assert not [r for r in ours if r.levelno >= logging.WARNING]
    offline = [r.getMessage() for r in ours if "offline" in r.getMessage()]
    assert len(offline) == 1 and "wandb sync " in offline[0] and why in offline[0]
    assert any("dropped step 3" in r.getMessage() for r in caplog.records)

    run_dirs = list((wandb_env / "root" / "wandb").glob("offline-run-*"))
    assert len(run_dirs) == 1 and str(run_dirs[0]) in offline[0]
    records = _wandb_records(next(run_dirs[0].glob("run-*.wandb")))
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert (run.project, run.run_group, run.display_name) == ("p2ptrain-test", RUN, WORKER)
    assert {item.key: json.loads(item.value_json) for item in run.config.update}["inner_lr"] == 3e-4
    history = {}
    for record in records:
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[record.history.step.num] = row
    assert sorted(history) == [1, 2, 3, 4, 5]
    for step, row in history.items():
        for tag in TAGS:
            assert row[tag] == pytest.approx(_values(step)[tag])
    assert history[5]["eval/loss"] == 2.5 and history[3]["train/loss"] == pytest.approx(4.0 / 3)


def test_wandb_dir_that_is_a_file(wandb_env, monkeypatch):
    blocked = wandb_env / "blocked"
    blocked.write_text("not a folder")
    monkeypatch.setenv("WANDB_DIR", str(blocked))
    with pytest.raises(LogToError, match="set WANDB_DIR to a folder"):
        _loggers(parse_log_to("wandb")).open()


@pytest.mark.parametrize("setup, offline", [
    ({}, True),
    ({"WANDB_API_KEY": "a" * 40}, False),
    ({"WANDB_MODE": "online"}, False),
    ({"netrc": "machine api.wandb.ai\n  login user\n  password " + "b" * 40 + "\n"}, False),
    ({"netrc": "machine example.com\n  login user\n  password " + "b" * 40 + "\n"}, True),
])
def test_wandb_goes_offline_without_credentials(wandb_env, monkeypatch, setup, offline):
    monkeypatch.setenv("WANDB_BASE_URL", "https://api.wandb.ai")
    for name, value in setup.items():
        if name == "netrc":
            (wandb_env / "netrc").write_text(value)
        else:
            monkeypatch.setenv(name, value)
    assert wandb_needs_offline() is offline


# ---------------------------------------------------------------------------------------------- missing extras


@pytest.mark.parametrize("module", ["wandb", "tensorboard"])
def test_missing_extra_names_the_pip_install(tmp_path, monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # import fails
    spec = "wandb" if module == "wandb" else f"tensorboard:{tmp_path}"
    loggers = TrainingLoggers([parse_log_to(spec)], run_id=RUN, peer_id=PEER_ID, config={})
    with pytest.raises(MissingExtra) as caught:
        loggers.open()
    assert f"pip install 'p2ptrain[{module}]'" in str(caught.value)
    assert f"--log-to {module}" in str(caught.value)
    assert list(tmp_path.iterdir()) == []  # nothing started
