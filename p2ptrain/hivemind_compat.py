"""The parts of hivemind's internals that p2ptrain relies on, in one checked list.

hivemind has no public hooks for what p2ptrain changes in its averaging (a group target per round, bit-identical
results, bans, state transfer in chunks, socket clean-up), so p2ptrain subclasses its classes and reaches into
them. Every such name is listed here with where it is used and why. The reaching in happens here too (the
accessors below; the matchmaking's hooks in averaging/matchmaking.py); what stays in the subclasses is the methods
they override, which are listed as well. ``missing_touch_points`` says which of them the installed hivemind lacks;
``check_hivemind`` refuses to start on such a hivemind with one line naming the fix, and
tests/unit/test_hivemind_compat.py has a test per touch point. Upgrading hivemind starts here: read what changed in
these names, then run that test.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib
import importlib.util
import inspect
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Tuple

import psutil

from p2ptrain.lifeline import remove_files

SUPPORTED_HIVEMIND = "1.1.12"
JOIN_POLL_S = 0.05
"""how often a part stream for a group not registered here asks whether this peer can still be in it"""


@dataclass(frozen=True)
class TouchPoint:
    owner: str
    """the hivemind class, dotted"""
    name: str
    kind: str
    """"method": called, patched or replaced by a subclass, with these ``params``; "attribute": an instance attribute
    that the class sets itself"""
    used_by: str
    why: str
    params: Tuple[str, ...] = ()

    def problem(self) -> Optional[str]:
        """Why the installed hivemind does not provide this touch point, or None."""
        module_name, class_name = self.owner.rsplit(".", 1)
        try:
            owner = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as e:
            return f"{self.owner} is gone ({e})"
        if self.kind == "attribute":
            # "self.x = ...", "self.x: T = ..." or "self.x, self.y = ..."
            assigned = rf"\bself\.{re.escape(self.name)}\s*(:[^=\n]+)?(,\s*self\.\w+\s*)*=(?!=)"
            if not re.search(assigned, inspect.getsource(owner)):
                return f"{self.owner} no longer sets self.{self.name}"
            return None
        method = getattr(owner, self.name, None)
        if not callable(method):
            return f"{self.owner}.{self.name} is gone"
        params = tuple(inspect.signature(method).parameters)
        if params != self.params:
            return f"{self.owner}.{self.name} takes {params}, not {self.params}"
        return None


_AVERAGER = "hivemind.averaging.averager.DecentralizedAverager"
_MATCHMAKING = "hivemind.averaging.matchmaking.Matchmaking"
_RUNNER = "hivemind.averaging.allreduce.AllReduceRunner"
_CONTAINER = "hivemind.averaging.partition.TensorPartContainer"

TOUCH_POINTS: Tuple[TouchPoint, ...] = (
    TouchPoint(_AVERAGER, "_step", "method", "averaging/averager.py",
               "set the round's target, window and expected peers before hivemind's step reads them",
               ("self", "step", "future_for_init")),
    TouchPoint(_AVERAGER, "_aggregate_with_group", "method", "averaging/averager.py",
               "check members and weights, count bytes, report incomplete rounds",
               ("self", "group_info", "min_vector_size", "kwargs")),
    TouchPoint(_AVERAGER, "_run_allreduce_inplace_", "method", "averaging/averager.py",
               "run ExactAllReduceRunner and write the tensors only when the whole round succeeded",
               ("self", "tensors", "group_info", "group_id", "kwargs")),
    TouchPoint(_AVERAGER, "rpc_join_group", "method", "averaging/averager.py",
               "refuse peers without the swarm's key or banned before matchmaking sees them",
               ("self", "request", "context")),
    TouchPoint(_AVERAGER, "_get_current_state_from_host_process", "method", "averaging/averager.py",
               "a donor's snapshot comes from the training process", ("self",)),
    TouchPoint(_AVERAGER, "_matchmaking", "attribute", "averaging/averager.py",
               "the per-round plan and the group key prefix live on the matchmaking object"),
    TouchPoint(_AVERAGER, "_p2p", "attribute", "averaging/averager.py, averaging/process.py",
               "stubs for the state-transfer RPCs and the all-reduce runner"),
    TouchPoint(_AVERAGER, "_outer_pipe", "attribute", "averaging/averager.py",
               "send a download request to the averager process, as hivemind's own step does"),
    TouchPoint(_AVERAGER, "_running_groups", "attribute", "averaging/averager.py",
               "hand the runner to the RPCs of a group that formed"),
    TouchPoint(_AVERAGER, "_pending_groups_registered", "attribute", "averaging/averager.py",
               "a part stream that comes before its group is registered waits for it (runner_for)"),
    TouchPoint(_AVERAGER, "add_p2p_handlers", "method", "averaging/averager.py",
               "the all-reduce's part stream is served beside the RPCs (part_stream.py)",
               ("self", "p2p", "wrapper", "namespace", "balanced")),
    TouchPoint(_AVERAGER, "_inner_pipe", "attribute", "averaging/process.py",
               "its control pipe is read whole messages at a time (swarm/pipe.py)"),
    TouchPoint(_AVERAGER, "remove_p2p_handlers", "method", "averaging/averager.py",
               "a p2pd that died with the DHT process is no error at shutdown", ("self", "p2p", "namespace")),
    TouchPoint("hivemind.dht.dht.DHT", "_inner_pipe", "attribute", "swarm/dht.py",
               "the DHT process reads its commands whole messages at a time (swarm/pipe.py)"),
    TouchPoint("hivemind.dht.dht.DHT", "_outer_pipe", "attribute", "swarm/dht.py",
               "commands are written one at a time across processes, and never wait on a dead DHT process"),
    TouchPoint(_MATCHMAKING, "_request_join_group", "method", "averaging/matchmaking.py",
               "never ask a banned peer to lead our group", ("self", "leader")),
    TouchPoint(_MATCHMAKING, "_check_reasons_to_reject", "method", "averaging/matchmaking.py",
               "an unexpected follower raises the target instead of taking an expected peer's place",
               ("self", "request", "context")),
    TouchPoint(_MATCHMAKING, "assembled_group", "attribute", "averaging/matchmaking.py",
               "a peer looking for a group, with no join request out and none assembled, is in no formed group"),
    TouchPoint(_MATCHMAKING, "lock_looking_for_group", "attribute", "averaging/matchmaking.py",
               "is_looking_for_group: whether the peer is in a step's matchmaking"),
    TouchPoint(_MATCHMAKING, "current_followers", "attribute", "averaging/matchmaking.py",
               "a follower that completes the group is not refused for its shorter window"),
    TouchPoint("hivemind.averaging.matchmaking.PotentialLeaders", "declared_expiration_time", "attribute",
               "averaging/matchmaking.py",
               "the leader's window, which a follower that completes the group may end before"),
    TouchPoint(_MATCHMAKING, "target_group_size", "attribute", "averaging/matchmaking.py",
               "the group starts once it holds the round's target"),
    TouchPoint(_MATCHMAKING, "min_matchmaking_time", "attribute", "averaging/matchmaking.py", "the round's window"),
    TouchPoint(_MATCHMAKING, "potential_leaders", "attribute", "averaging/matchmaking.py",
               "its min_matchmaking_time is the round's window too"),
    TouchPoint(_MATCHMAKING, "group_key_manager", "attribute", "averaging/matchmaking.py, averaging/state_transfer.py",
               "the group bits are the outer step: hivemind's rewrite after each group is switched off"),
    TouchPoint("hivemind.averaging.key_manager.GroupKeyManager", "update_key_on_group_assembled", "method",
               "averaging/matchmaking.py", "switched off: hivemind rewrote the group bits after every group",
               ("self", "group_info")),
    TouchPoint("hivemind.averaging.key_manager.GroupKeyManager", "get_averagers", "method",
               "averaging/matchmaking.py", "pace matchmaking's lookups of the declared leaders",
               ("self", "group_key", "only_active")),
    TouchPoint("hivemind.averaging.matchmaking.PotentialLeaders", "min_matchmaking_time", "attribute",
               "averaging/matchmaking.py", "the round's window"),
    TouchPoint(_RUNNER, "_communicate_with_peer", "method", "averaging/allreduce.py",
               "our own contribution goes through the codec too, so every member gets the same bits",
               ("self", "peer_id")),
    TouchPoint(_RUNNER, "_accumulate_parts_streaming", "method", "averaging/allreduce.py",
               "check each received part (finite, shape, weight, norm) and ban its sender",
               ("self", "stream", "sender_index")),
    TouchPoint(_RUNNER, "rpc_aggregate_part", "method", "averaging/allreduce.py",
               "a reducer answers every sender before its round ends (it may be its last), and holds each stream "
               "open until its sender hangs up (protocol 6)", ("self", "stream", "context")),
    TouchPoint(_RUNNER, "_handle_missing_senders", "method", "averaging/allreduce.py",
               "a member that sends nothing is left out after START_TIMEOUT_S, not sender_timeout", ("self",)),
    TouchPoint(_RUNNER, "_generate_input_for_peer", "method", "averaging/allreduce.py",
               "stream our parts to a reducer, recording each one's commitment (audit.py)", ("self", "peer_index")),
    TouchPoint(_RUNNER, "_ban_sender", "method", "averaging/allreduce.py", "a sender whose part was refused",
               ("self", "peer_id")),
    TouchPoint(_CONTAINER, "_input_parts_by_peer", "attribute", "averaging/allreduce.py, averaging/flat_outputs.py",
               "our own part over a range: the reference of the norm check, a failed range's values"),
    *(TouchPoint(_CONTAINER, name, "method", "averaging/flat_outputs.py", "averages decoded into one kept buffer",
                 params) for name, params in [("register_processed_part", ("self", "peer_index", "part_index", "part")),
                                              ("register_failed_reducer", ("self", "peer_index")),
                                              ("iterate_output_tensors", ("self",)), ("finalize", ("self",))]),
    TouchPoint("hivemind.averaging.partition.TensorPartReducer", "check_current_part_finished", "method",
               "averaging/reducer.py", "a part that every sender weighs 0 averages to zeros, not NaN", ("self",)),
    TouchPoint("hivemind.averaging.partition.TensorPartReducer", "accumulate_part", "method",
               "averaging/reducer.py", "copied: weights capped, parts kept for robust aggregation, senders recorded",
               ("self", "sender_index", "part_index", "tensor_part", "weight")),
    TouchPoint("hivemind.averaging.partition.TensorPartReducer", "reset_accumulators", "method",
               "averaging/reducer.py", "the current part's kept parts and senders", ("self",)),
    TouchPoint("hivemind.p2p.p2p_daemon.P2P", "_client_listen_maddr", "attribute", "swarm/dht.py",
               "remove the client's unix socket, which hivemind leaves in /tmp"),
    TouchPoint("hivemind.p2p.p2p_daemon.P2P", "_daemon_listen_maddr", "attribute", "swarm/dht.py",
               "remove the daemon's unix socket"),
    TouchPoint("hivemind.p2p.p2p_daemon.P2P", "_child", "attribute", "swarm/dht.py",
               "only the P2P that started p2pd owns the daemon's socket"),
    TouchPoint("hivemind.p2p.p2p_daemon.P2P", "__init__", "method", "swarm/dht.py",
               "the DHT process learns of the P2P whose start failed, to remove the sockets it left", ("self",)),
    TouchPoint("hivemind.averaging.control.StepControl", "__del__", "method", "averaging/__init__.py",
               "a StepControl collected under torch's fake-tensor mode reads its shared state outside it",
               ("self",)),
    TouchPoint("hivemind.p2p.p2p_daemon.P2P", "_client", "attribute", "swarm/relays.py",
               "dial a relayed peer at circuit addresses that hivemind's multiaddr cannot encode"),
    TouchPoint("hivemind.p2p.p2p_daemon.P2P", "_make_process_args", "method", "swarm/relays.py",
               "start the bootstrap's relay daemons with their limits", ("args", "kwargs")),
    TouchPoint("hivemind.p2p.p2p_daemon.P2P", "_terminate", "method", "swarm/relays.py",
               "end the relay daemons from a process whose event loop is gone", ("self",)),
)


def missing_touch_points(points: Tuple[TouchPoint, ...] = TOUCH_POINTS) -> List[str]:
    """What the installed hivemind lacks of ``points``, one line each (empty: all there)."""
    return [problem for point in points if (problem := point.problem()) is not None]


@functools.lru_cache(maxsize=None)
def _missing_once() -> Tuple[str, ...]:
    return tuple(missing_touch_points())


def check_hivemind() -> None:
    """Raise RuntimeError, in one line naming the fix, if the installed hivemind lacks a touch point."""
    missing = _missing_once()
    if missing:
        import hivemind

        raise RuntimeError(f"hivemind {hivemind.__version__} is not the one p2ptrain was written for "
                           f"({missing[0]}{f'; and {len(missing) - 1} more' if len(missing) > 1 else ''}); "
                           f"install it with: pip install hivemind=={SUPPORTED_HIVEMIND}")


def step_controls_outside_fake_mode() -> None:
    """Make hivemind's ``StepControl.__del__`` run outside torch's fake-tensor mode. It reads the step's state from a
    shared-memory tensor (``.item()``); the garbage collector may run it while a thread is inside a ``FakeTensorMode``
    (torch's compile and checkpoint planning use one), where that read fails with "Please convert all Tensors to
    FakeTensors first" and prints a traceback (CI, test_ctrl_c_stops_a_two_rank_peer_cleanly, once)."""
    from hivemind.averaging.control import StepControl
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    original = StepControl.__del__
    if getattr(original, "_p2ptrain_outside_fake_mode", False):
        return

    def __del__(self):
        with unset_fake_temporarily():
            original(self)

    __del__._p2ptrain_outside_fake_mode = True
    StepControl.__del__ = __del__


def matchmaking_of(averager: Any) -> Any:
    """The averager's hivemind ``Matchmaking`` (made in the averager process when it starts)."""
    return averager._matchmaking


def group_key_prefix(averager: Any) -> str:
    return averager._matchmaking.group_key_manager.prefix


def p2p_of(averager: Any) -> Any:
    """The averager's replica of its DHT's P2P (made in the averager process when it starts)."""
    return averager._p2p


async def p2p_connect(p2p: Any, peer_id: Any, maddrs: List[Any]) -> None:
    """Have p2pd connect to ``peer_id`` at ``maddrs`` (objects with ``to_bytes``: p2pd reads the bytes as given)."""
    await p2p._client.connect(peer_id, maddrs)


async def p2p_disconnect(p2p: Any, peer_id: Any) -> None:
    """Have p2pd close its connections to ``peer_id``."""
    await p2p._client.disconnect(peer_id)


def terminate_p2p(p2p: Any) -> None:
    """Stop a P2P's p2pd and remove its sockets without its event loop (``P2P.shutdown`` needs one)."""
    p2p._terminate()


def send_to_averager_process(averager: Any, method: str, **kwargs) -> None:
    """Have the averager process run ``averager.<method>(**kwargs)``, as hivemind's own ``step`` does."""
    averager._outer_pipe.send((method, [], kwargs))


async def current_state_from_host(averager: Any) -> tuple:
    """(metadata, tensors, infos) from the host process's ``get_current_state``."""
    return await averager._get_current_state_from_host_process()


def register_runner(averager: Any, group_id: bytes, runner: Any) -> None:
    """Hand a group's all-reduce runner to the RPCs that wait for it."""
    assert group_id in averager._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
    averager._running_groups[group_id].set_result(runner)


async def runner_for(averager: Any, group_id: bytes, in_no_formed_group: Callable[[], bool] = lambda: False) -> Any:
    """The all-reduce runner of a group this averager is in (waiting until it is made), or None: hivemind's
    ``rpc_aggregate_part`` lookup, for the part stream (part_stream.py). A member whose leader's answer is late may
    hear from the others first: then it waits for the next group it registers, unless ``in_no_formed_group`` says
    that no group formed so far can hold it (``SteeredMatchmaking.in_no_formed_group``): then None at once, and
    the sender learns within a poll that the leader counted in a member that left."""
    registered = averager._pending_groups_registered
    while group_id not in averager._running_groups and not registered.is_set():
        if in_no_formed_group():
            return None
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(registered.wait(), JOIN_POLL_S)
    future = averager._running_groups.get(group_id)
    return None if future is None else await future


@contextlib.contextmanager
def p2ps_made() -> Iterator[List[Any]]:
    """While inside, every hivemind P2P this process makes is appended to the list yielded. ``P2P.create`` makes
    one, then starts p2pd; when p2pd fails (an initial peer that refuses), nothing else keeps a reference to it, and
    the sockets p2pd made in /tmp stay there (remove_unstarted_p2p_files removes them)."""
    from hivemind.p2p.p2p_daemon import P2P

    made: List[Any] = []
    original = P2P.__init__

    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        made.append(self)

    P2P.__init__ = init
    try:
        yield made
    finally:
        P2P.__init__ = original


def remove_unstarted_p2p_files(p2p: Any, wait_s: float = 2.0) -> None:
    """Remove the sockets of a P2P whose start failed (hivemind removes nothing then), once its p2pd, which said it
    failed and is exiting, is gone: until then it may still make them."""
    child = getattr(p2p, "_child", None)
    if child is not None:
        with contextlib.suppress(psutil.Error):
            psutil.Process(child.pid).wait(timeout=wait_s)
    remove_files(p2p_socket_paths(p2p))


def p2p_socket_paths(p2p: Any) -> List[str]:
    """The unix socket files a hivemind P2P made in /tmp (hivemind-p2pclient-*.sock: its client's listen socket,
    made with the first handler; hivemind-p2pd-*.sock: the daemon's control socket, if this P2P started p2pd)."""
    paths = []
    for maddr in p2p_socket_maddrs(p2p):
        with contextlib.suppress(KeyError, TypeError, ValueError):
            paths.append(maddr["unix"])
    return paths


def p2p_socket_maddrs(p2p: Any) -> List[Any]:
    """The multiaddrs of the unix sockets a hivemind P2P made in /tmp: its client's listen socket, and the daemon's
    control socket if this P2P started p2pd (a replica's daemon socket belongs to the P2P that started it)."""
    maddrs = [getattr(p2p, "_client_listen_maddr", None)]
    if getattr(p2p, "_child", None) is not None:
        maddrs.append(getattr(p2p, "_daemon_listen_maddr", None))
    return maddrs


def own_input_part(container: Any, peer_index: int, part_index: int) -> Any:
    """This peer's own values of part ``part_index`` of the range reduced by ``peer_index``."""
    return container._input_parts_by_peer[peer_index][part_index][0]


def own_input_part_shapes(container: Any) -> List[List[Any]]:
    return [[part.shape for part, _ in parts] for parts in container._input_parts_by_peer]


def take_input_parts(container: Any, peer_index: int) -> List[Any]:
    """This peer's parts of the range reduced by ``peer_index``, each with its ``CompressionInfo``, to send once:
    what hivemind's ``TensorPartContainer.iterate_input_parts_for`` (1.1.12) takes before it compresses them."""
    assert not container._inputs_consumed_by_peer[peer_index], "input parts of a given peer are already used"
    container._inputs_consumed_by_peer[peer_index] = True
    return list(container._input_parts_by_peer[peer_index])


_STANDALONE_MULTIADDR = "_p2ptrain_hivemind_multiaddr"


def multiaddr_class() -> type:
    """hivemind's ``Multiaddr`` (its vendored py-multiaddr, ``hivemind/utils/multiaddr/``). Where hivemind is not
    imported yet, the vendored package is loaded on its own, without ``hivemind/__init__`` (which loads torch: 3 s
    before a wrong --initial-peers could be reported). It imports only itself and small libraries (base58, cid,
    netaddr, idna, varint), so it parses exactly as hivemind does."""
    if "hivemind.utils.multiaddr" in sys.modules:
        return sys.modules["hivemind.utils.multiaddr"].Multiaddr
    if _STANDALONE_MULTIADDR not in sys.modules:
        origin = importlib.util.find_spec("hivemind").origin  # finds the package without running its __init__
        init = origin.rsplit("/", 1)[0] + "/utils/multiaddr/__init__.py"
        spec = importlib.util.spec_from_file_location(_STANDALONE_MULTIADDR, init,
                                                      submodule_search_locations=[init.rsplit("/", 1)[0]])
        module = importlib.util.module_from_spec(spec)
        sys.modules[_STANDALONE_MULTIADDR] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[_STANDALONE_MULTIADDR]
            raise
    return sys.modules[_STANDALONE_MULTIADDR].Multiaddr
