"""Starting and joining the DHT: address checks, bounded start-up, clean shutdown."""

from __future__ import annotations

import logging
import multiprocessing.util
import os
import shutil
import tempfile
import threading
import time
from contextlib import suppress
from functools import partial
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import hivemind
from hivemind.p2p import P2P, P2PDaemonError

from p2ptrain.config import SwarmConfig  # noqa: F401 (SwarmConfig lived here; importers use this path)
from p2ptrain.config_checks import check_maddrs
from p2ptrain.hivemind_compat import check_hivemind, p2p_socket_paths, p2ps_made, remove_unstarted_p2p_files
from p2ptrain.lifeline import (exit_on_sigterm, follow_parent, leave_process_group, on_forced_exit, parent_gone,
                               remove_files, remove_inherited_temp_dir)
from p2ptrain.swarm.pipe import LockedWriter, PipeBroken, WholeMessageReader, process_alive, quiet_shared_fd_resets
from p2ptrain.swarm.admission import SwarmRefused, check_admission, serve_admission
from p2ptrain.swarm.reachability import MODES, Reachability, SwarmUnreachable, decide, serve_probes
from p2ptrain.swarm.relays import (RELAYS, RelayedPeer, relay_limits_text, serve_relay_checks, start_relays,
                                   stop_relays)
from p2ptrain.security import (KeyFileError, PeerSignatureValidator, SwarmAuth, SwarmKeyValidator,
                               limit_stream_messages, load_identity, load_swarm_key)

logger = logging.getLogger(__name__)


class SwarmError(Exception):
    """The swarm could not be joined; the message says why and what to do. Not a bug: the CLI exits with 2."""


def read_maddrs_file(path: str, timeout_s: float, poll_s: float = 0.5) -> List[str]:
    """The multiaddrs in ``path``, one per line (blank lines and # comments skipped), waiting up to ``timeout_s``
    for the file to appear; SwarmError if it never does, is empty or holds something else."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            text = Path(path).read_text()
            break
        except FileNotFoundError:
            if time.monotonic() >= deadline:
                raise SwarmError(f"--initial-peers-file {path} did not appear in {timeout_s:.0f}s; start the "
                                 "bootstrap peer with --maddrs-file pointing there, or fix the path") from None
            time.sleep(poll_s)
        except OSError as e:
            raise SwarmError(f"--initial-peers-file {path} cannot be read ({e.strerror}); fix its permissions"
                             ) from None
    maddrs = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not maddrs:
        raise SwarmError(f"--initial-peers-file {path} holds no multiaddr; write one per line, or let a bootstrap "
                         "peer write it with --maddrs-file")
    try:
        check_maddrs(maddrs, f"--initial-peers-file {path}", need_peer_id=True)
    except ValueError as e:
        raise SwarmError(str(e)) from None
    return maddrs


class FollowingDHT(hivemind.DHT):
    """hivemind's DHT process, in a process group of its own with its p2pd (signals meant for the peer's group do
    not stop them under a leaving peer), which exits (taking p2pd along) when the process that started it is gone.

    ``auth`` is the swarm's admission rule (security.SwarmAuth), which the averager applies to its peers too."""

    auth: SwarmAuth = SwarmAuth()
    reachability: Reachability = Reachability(False, "")
    relayed: Optional[RelayedPeer] = None
    """a worker behind NAT that runs relayed (swarm/relays.py), or None"""
    relays: int = 0
    """the relay daemons this peer runs (a bootstrap peer's --relays), which its probe answers name"""
    _identity_dir: Optional[str] = None
    _socket_paths: List[str] = []
    """the unix sockets of the DHT process's P2P, learnt at start: stop_dht removes what the process left"""

    def __init__(self, *args, start: bool = False, **kwargs):
        super().__init__(*args, start=False, **kwargs)
        # commands of any size, from any thread or forked process, and none that waits on a dead DHT process
        # (swarm/pipe.py: hivemind's own reading of this pipe killed the process on a 300 KB record)
        self._outer_pipe = LockedWriter(self._outer_pipe, reader_alive=lambda: process_alive(self.pid),
                                        reader="the DHT process", on_closed=_fail_command)
        if start:
            self.run_in_background(await_ready=kwargs.get("await_ready", True))

    def run(self) -> None:
        leave_process_group()
        follow_parent()
        exit_on_sigterm()
        on_forced_exit(self._clean_up)
        self._inner_pipe = WholeMessageReader(self._inner_pipe)
        parent = os.getppid()
        try:
            with p2ps_made() as self._p2ps_made:
                super().run()
        except PipeBroken as e:
            logger.error(f"the DHT process stops: its command pipe cannot be read any further ({e})")
            if parent_gone(parent, wait_s=2.0):  # the peer died (SIGKILL, os._exit): it removes nothing now
                remove_inherited_temp_dir()
        finally:
            self._clean_up()

    def _clean_up(self) -> None:
        """What this process leaves, however it ends: its sockets (hivemind removes them on a clean shutdown only),
        and a fresh identity key's folder (start_dht made it for this DHT alone; a peer that died without stop_dht,
        by SIGKILL or os._exit, left it in TMPDIR: a private key)."""
        stop_relays()
        self._remove_own_sockets()
        if self._identity_dir:
            shutil.rmtree(self._identity_dir, ignore_errors=True)

    def _remove_own_sockets(self) -> None:
        node = getattr(self, "_node", None)
        if node is not None:
            remove_files(p2p_socket_paths(node.p2p))
        for p2p in getattr(self, "_p2ps_made", []):
            if node is None or p2p is not node.p2p:  # a start that failed: hivemind removes nothing then
                remove_unstarted_p2p_files(p2p)

    async def replicate_p2p(self) -> P2P:
        """hivemind's replica of the DHT's P2P for this process (the averager's process takes one), whose client
        socket is removed when this process exits: hivemind removes it only in P2P.shutdown or __del__, which a
        multiprocessing child never reaches (it ends with os._exit), so each averager left one in /tmp."""
        p2p = await super().replicate_p2p()
        seen = _replicas_seen.setdefault(os.getpid(), set())
        if id(p2p) not in seen:  # hivemind keeps one replica per process: register its clean-up once
            seen.add(id(p2p))
            # run by multiprocessing at the exit of its child processes and by atexit in a main process; by
            # lifeline when a child follows its parent out
            paths = p2p_socket_paths(p2p)
            multiprocessing.util.Finalize(None, remove_files, args=(paths,), exitpriority=0)
            on_forced_exit(lambda: remove_files(paths))
        return p2p


def _fail_command(command: tuple, error: Exception) -> bool:
    """A DHT command (store, get, run_coroutine ...) that could not reach the DHT process ends with ``error`` in
    its future, where every caller of a DHT call already handles failures; commands without one raise it."""
    method, args, kwargs = command
    future = kwargs.get("future")
    if future is None:
        return False
    future.set_exception(error)
    return True


_replicas_seen: dict = {}
"""pid -> ids of the P2P replicas whose sockets are already set to be removed at that process's exit"""


async def _dht_socket_paths(_dht: hivemind.DHT, node) -> List[str]:
    return p2p_socket_paths(node.p2p)


def start_dht(config: SwarmConfig, role: str = "", reader: bool = False, relays: int = 0) -> hivemind.DHT:
    """Start this peer's DHT and join the swarm through ``initial_peers``; raise SwarmError if that fails.
    ``role``: why this command sets ``config.reachability`` itself (the log says so, not "forced"), or "".
    ``reader``: a short-lived reader of the records (status, the demo's follower), not a member: no word about
    the swarm being open, which is its members' concern. ``relays``: how many relay daemons this peer runs for
    workers behind NAT (a bootstrap peer's ``--relays``; swarm/relays.py).

    Bounded: an initial peer that does not answer makes this fail after ``bootstrap_timeout_s``, never hang.
    """
    try:
        check_hivemind()
    except RuntimeError as e:
        raise SwarmError(str(e)) from None
    check_maddrs(config.initial_peers, "--initial-peers", need_peer_id=True)
    check_maddrs(config.host_maddrs, "--host-maddrs")
    check_maddrs(config.announce_maddrs, "--announce-maddrs")
    if 0 < relays < RELAYS:
        raise SwarmError(f"--relays {relays}: use 0 (no relaying) or at least {RELAYS}; a worker behind NAT that "
                         f"knows fewer than {RELAYS} relays waits 3 minutes for its relay slot (go-libp2p's rule)")
    initial_peers = list(config.initial_peers)
    if config.initial_peers_file:
        initial_peers += read_maddrs_file(config.initial_peers_file, config.bootstrap_timeout_s)
    if config.reachability not in MODES:
        raise SwarmError(f"--reachability {config.reachability!r} is unknown; use one of: {', '.join(MODES)}")
    try:
        auth = SwarmAuth.from_key(load_swarm_key(config.swarm_key_file) if config.swarm_key_file else None)
    except KeyFileError as e:
        raise SwarmError(str(e)) from None

    # records about a peer are signed with its libp2p identity key, so we need the key file: the user's, or a
    # fresh one in a private folder that lives as long as the DHT (then the peer id is new each start, as before)
    identity_path, identity_dir = config.identity_path, None
    if identity_path is None:
        identity_dir = tempfile.mkdtemp(prefix="p2ptrain-identity-")
        identity_path = str(Path(identity_dir) / "identity.key")
    try:  # until the DHT owns the fresh key's folder (stop_dht removes it), a failure removes it here
        existing_identity = Path(identity_path).exists()
        if not existing_identity:
            P2P.generate_identity(identity_path)
        try:
            validators = [PeerSignatureValidator(load_identity(identity_path))]
        except (KeyFileError, OSError, ValueError) as e:
            raise SwarmError(f"--identity {identity_path} is not a usable identity key ({e}); remove the file and "
                             "p2ptrain creates a new one (the peer id changes)") from None
        if auth.private:
            validators.append(SwarmKeyValidator(auth))
        limit_stream_messages()
        quiet_shared_fd_resets()  # a DHT process killed mid-fetch of a command's pipe: no traceback from the sharer
        try:
            reachability = decide(config.reachability, initial_peers, config.host_maddrs, config.announce_maddrs,
                                  timeout_s=config.bootstrap_timeout_s, role=role)
        except SwarmUnreachable as e:  # fail now: the DHT would wait as long again and fail the same way
            raise SwarmError(_join_failure(initial_peers, str(e))) from None
        mode = {"relayed": "relayed (behind NAT, dialled through the bootstrap's relays)",
                "client": "in client mode (it dials out only)"}.get(reachability.mode, "public")
        logger.info(f"this peer runs {mode}: {reachability.reason}")
        # relayed: p2pd reserves slots on the relays, so that peers can dial it through them
        relaying = dict(use_auto_relay=True, trusted_relays=reachability.relay_maddrs, force_reachability="private"
                        ) if reachability.relay_maddrs else dict(use_auto_relay=config.use_auto_relay)

        # this process's multiprocessing folder, made before the DHT and averager processes fork off: they know it
        # then, and remove it if this process is killed (lifeline.remove_inherited_temp_dir)
        multiprocessing.util.get_temp_dir()
        dht = FollowingDHT(
            initial_peers=initial_peers,
            host_maddrs=config.host_maddrs,
            announce_maddrs=config.announce_maddrs or None,
            identity_path=identity_path,
            # a key made just now is nobody else's: skip hivemind's check, which starts a second p2pd to dial it
            check_if_identity_free=existing_identity,
            record_validators=validators,
            client_mode=reachability.client_mode,
            use_relay=config.use_relay or bool(reachability.relay_maddrs),
            **relaying,
            # p2pd gives up on unreachable bootstrap peers after this long instead of waiting forever
            startup_timeout=config.bootstrap_timeout_s,
            start=False,
        )
    except BaseException:
        if identity_dir is not None:
            shutil.rmtree(identity_dir, ignore_errors=True)
        raise
    dht.auth, dht.reachability, dht._identity_dir = auth, reachability, identity_dir
    dht.relayed = RelayedPeer(dht, reachability.relay_maddrs) if reachability.relay_maddrs else None
    dht.identity = validators[0]  # the averager signs its averages with it (averaging/evidence.py)
    if not auth.private and not reader:
        logger.warning("this swarm is OPEN: any host that reaches a peer can join it, average with it and download "
                       "the model; give every peer --swarm-key FILE (p2ptrain keygen FILE) to make it private")
    try:
        dht.run_in_background(await_ready=True, timeout=config.bootstrap_timeout_s + 5)
    except (P2PDaemonError, TimeoutError, Exception) as e:
        stop_dht(dht)
        reason = str(e).splitlines()[-1] if str(e) else type(e).__name__
        if initial_peers:
            raise SwarmError(_join_failure(initial_peers, reason)) from None
        raise SwarmError(f"could not start the DHT ({reason}); check --host-maddrs and --identity") from None
    # stop_dht removes them if the DHT process cannot (terminated, or p2pd killed under it)
    dht._socket_paths = dht.run_coroutine(_dht_socket_paths)
    if reachability.relay_maddrs:
        dht.run_coroutine(serve_relay_checks)  # peers that connect through the relays check the connection
    if not reachability.client_mode:
        if relays > 0:
            try:
                dht.relays = dht.run_coroutine(partial(start_relays, count=relays, host_maddrs=config.host_maddrs))
            except Exception as e:
                stop_dht(dht)
                raise SwarmError(f"could not start {relays} relay daemons ({e}); check --host-maddrs, or pass "
                                 "--relays 0") from None
            logger.info(relay_limits_text(relays))
        dht.run_coroutine(serve_probes)  # tell joining peers whether they can be dialled, and of the relays
    serve_admission(dht, auth)  # tell joining peers whether they hold this swarm's key
    try:  # and ask ours: a swarm that ignores every record of ours would leave this peer training alone
        check_admission(dht, auth, initial_peers, f"--swarm-key {config.swarm_key_file}",
                        timeout_s=config.bootstrap_timeout_s)
    except SwarmRefused as e:
        stop_dht(dht)
        raise SwarmError(str(e)) from None
    return dht


def _join_failure(initial_peers: Sequence[str], reason: str) -> str:
    return (f"could not join the swarm through {', '.join(initial_peers)} ({reason}); check that the address is "
            "current and the peer is running and reachable from this host")


def visible_maddrs(dht: hivemind.DHT) -> List[str]:
    """Addresses others can use as --initial-peers, loopback last (it only works on this host)."""
    maddrs = [str(m) for m in dht.get_visible_maddrs()]
    return sorted(maddrs, key=lambda m: ("/127.0.0.1/" in m or "/::1/" in m, m))


class DHTLost(RuntimeError):
    """The peer's DHT process died; DHTWatch logged why. The CLI exits with 1."""


class DHTWatch:
    """Notices within ``poll_s`` that a peer's DHT process is gone (killed, or stopped on a pipe it could not
    read), says so in one line and calls ``on_lost(line)`` once: without its DHT a peer sees no other peer, and
    would otherwise wait for rounds that never come or train on alone. ``stop()`` before shutting the DHT down."""

    def __init__(self, dht: hivemind.DHT, on_lost: Callable[[str], None], poll_s: float = 1.0):
        self.dht, self.on_lost, self.poll_s = dht, on_lost, poll_s
        self.lost: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="p2ptrain-dht-watch", daemon=True)

    def start(self) -> "DHTWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll_s + 5)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.dht.is_alive():
                continue
            if self._stop.is_set():  # shut down on purpose meanwhile
                return
            self.lost = (f"the DHT process (pid {self.dht.pid}) exited with code {self.dht.exitcode}: this peer can "
                         "no longer reach the swarm, so it leaves now; start it again (with --resume to continue "
                         "from its checkpoint)")
            logger.error(self.lost)
            self.on_lost(self.lost)
            return


def stop_dht(dht: hivemind.DHT) -> None:
    """Shut the DHT process (and its p2pd) down; terminate it if it does not leave on its own."""
    try:
        if dht.is_alive():
            dht.shutdown()
        dht.join(timeout=10)
        if dht.is_alive():
            logger.warning("DHT process did not exit in 10s; terminating it")
            dht.terminate()
            dht.join(timeout=5)
    except (AssertionError, ValueError):
        pass  # never started
    with suppress(AssertionError):  # is_alive asserts that this process started it
        if not dht.is_alive():
            remove_files(getattr(dht, "_socket_paths", []))
    if getattr(dht, "_identity_dir", None):
        shutil.rmtree(dht._identity_dir, ignore_errors=True)
