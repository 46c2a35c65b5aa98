"""Headless Chromium for the tests of web pages (the dashboard): the DOM after the page's scripts ran, and a
screenshot.

``--virtual-time-budget`` is what makes this fast and deterministic: Chromium runs the page on a virtual clock that
jumps over idle time and stops while a network fetch is pending, so a page that fetches and then polls every 2 s
has run ~4 polls against the real server within an 8000 ms budget in under a second of wall time. (Its ``Date.now()``
follows the virtual clock, so a page's "N s ago" in a test may read a few seconds more than the real age.)

Chromium leaves processes behind on exit: its renderers and GPU process in its process group, which ``render`` kills,
and two ``chrome_crashpad_handler`` processes in their own sessions that exit with the browser and are re-parented
to the test process (the suite makes itself a child subreaper), where ``render`` waits for and reaps them. So no
Chromium process, not even a zombie, outlives ``render``. (``--disable-crashpad-for-testing`` would avoid them but
makes Chromium 150 hang at exit.)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence, Set, Tuple

import psutil

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
TIMEOUT_S = 60
CHROMIUM_NAMES = ("chromium", "chrome", "chrome_crashpad", "chrome_crashpad_handler", "google-chrome")
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
    "--no-default-browser-check", "--disable-extensions", "--disable-background-networking", "--disable-sync",
    "--disable-component-update", "--disable-default-apps", "--disable-breakpad", "--mute-audio",
    "--hide-scrollbars", "--enable-logging=stderr", "--v=0",  # stderr carries the page's console, read below
)


class BrowserError(RuntimeError):
    """Chromium failed or hung; the message holds the end of its stderr."""


def find_chromium() -> Optional[str]:
    """The path of a Chromium or Chrome on PATH, or None."""
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


def render(url: str, *, screenshot: Optional[Path] = None, budget_ms: int = 8000,
           window: Tuple[int, int] = (1400, 1000), console: Optional[List[str]] = None) -> str:
    """The DOM of ``url`` serialized after ``budget_ms`` of the page's (virtual) time; with ``screenshot``, also a PNG
    of the page at ``window`` (width, height) pixels, from a second run. ``console``, if given, gets the page's
    console messages and uncaught errors, one string each (``"Uncaught TypeError: ..."``)."""
    browser = find_chromium()
    if browser is None:
        raise BrowserError("no chromium, chromium-browser or google-chrome on PATH")
    common = [f"--virtual-time-budget={int(budget_ms)}", f"--window-size={window[0]},{window[1]}"]
    dom, messages = _run(browser, [*common, "--dump-dom", url])
    if 'id="main-frame-error"' in dom:  # Chromium's own "This site can't be reached" page
        raise BrowserError(f"chromium could not load {url}: is the server up?")
    if screenshot is not None:
        screenshot = Path(screenshot)
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        _run(browser, [*common, f"--screenshot={screenshot.resolve()}", url])
        if not screenshot.is_file():
            raise BrowserError(f"chromium exited without writing the screenshot {screenshot}")
    if console is not None:
        console.extend(messages)
    return dom


def _run(browser: str, args: Sequence[str]) -> Tuple[str, List[str]]:
    """One Chromium run with a fresh profile in a temp dir; its stdout and console messages. Leaves no process."""
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    profile = tempfile.mkdtemp(prefix="p2ptrain-chromium-")
    command = [browser, *FLAGS, f"--user-data-dir={profile}", *args]
    # its own session, so that a hung Chromium and every process it started can be killed as one group
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        try:
            out, err = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            out, err = proc.communicate()
            raise BrowserError(f"chromium did not finish in {TIMEOUT_S} s: {_tail(err)}") from None
    finally:
        _kill_group(proc.pid)
        _reap_leftovers(before)
        shutil.rmtree(profile, ignore_errors=True)
    if proc.returncode != 0:
        raise BrowserError(f"chromium exited with {proc.returncode}: {_tail(err)}")
    return out.decode("utf-8", "replace"), _console_messages(err.decode("utf-8", "replace"))


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _is_chromium(proc: psutil.Process) -> bool:
    try:
        return proc.name().startswith(CHROMIUM_NAMES)
    except psutil.NoSuchProcess:
        return False


def _reap_leftovers(before: Set[int]) -> None:
    """Kill what this run of Chromium left among this process's descendants (crashpad handlers re-parented here)
    and reap the zombies that are this process's own children. Processes that were there before are not touched."""
    me = psutil.Process()
    leftovers = [p for p in me.children(recursive=True) if p.pid not in before and _is_chromium(p)]
    running = [p for p in leftovers if _status(p) not in (psutil.STATUS_ZOMBIE, None)]
    _, alive = psutil.wait_procs(running, timeout=5)  # crashpad exits on its own once the browser is gone
    for proc in alive:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)
    for proc in leftovers:
        try:
            if proc.ppid() == me.pid:
                os.waitpid(proc.pid, os.WNOHANG)
        except (psutil.NoSuchProcess, ChildProcessError):
            pass


def _status(proc: psutil.Process) -> Optional[str]:
    try:
        return proc.status()
    except psutil.NoSuchProcess:
        return None


def _console_messages(stderr: str) -> List[str]:
    # [pid:tid:date:INFO:CONSOLE:12] "Uncaught TypeError: x is undefined", source: http://127.0.0.1:41213/static/...
    messages = []
    for line in stderr.splitlines():
        head, sep, rest = line.partition(":CONSOLE")
        if sep and "]" in rest:
            messages.append(rest.split("]", 1)[1].strip())
    return messages


def _tail(stderr: bytes, lines: int = 15) -> str:
    # Chromium in a container complains about D-Bus on every start: noise that would hide the real error
    text = [line for line in stderr.decode("utf-8", "replace").splitlines() if "dbus" not in line.lower()]
    return "\n".join(text[-lines:]) if text else "(no stderr)"
