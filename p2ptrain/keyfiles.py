"""The swarm key file: made by `p2ptrain keygen`, read by every peer of a private swarm. No hivemind or torch here:
`keygen` and a bad --swarm-key answer in a fraction of a second, before the heavy imports."""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path


class KeyFileError(ValueError):
    """A swarm key or identity file that cannot be used; the message names the file and the fix."""


SWARM_KEY_BYTES = 32


def generate_swarm_key(path: str | Path) -> None:
    """Write a new random swarm key to ``path`` (hex, mode 0600); never overwrite an existing file."""
    path = Path(path)
    if path.exists():
        raise KeyFileError(f"{path} already exists; p2ptrain keygen never overwrites a key (a run's peers would "
                          "lose it): pick another path or remove the file yourself")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise KeyFileError(f"cannot create {path} ({e.strerror}); pick a writable path") from None
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(SWARM_KEY_BYTES) + "\n")


def load_swarm_key(path: str | Path) -> bytes:
    """The key in ``path``; KeyFileError naming the problem and the fix for a missing, unreadable, shared
    (group/other permissions) or malformed file."""
    option = f"--swarm-key {path}"
    try:
        mode = os.stat(path).st_mode
        text = Path(path).read_text()
    except FileNotFoundError:
        raise KeyFileError(f"{option} does not exist; create one with 'p2ptrain keygen {path}' and copy it to "
                          "every peer of the run") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not text"
        raise KeyFileError(f"{option} cannot be read ({reason}); fix its permissions or regenerate it") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"{option} is readable by other users (mode {stat.S_IMODE(mode):o}); run "
                          f"'chmod 600 {path}'")
    key = text.strip()
    if len(key) != 2 * SWARM_KEY_BYTES or any(c not in "0123456789abcdefABCDEF" for c in key):
        raise KeyFileError(f"{option} does not hold a swarm key ({2 * SWARM_KEY_BYTES} hex digits); regenerate it "
                          "with 'p2ptrain keygen' and copy it to every peer")
    return bytes.fromhex(key)
