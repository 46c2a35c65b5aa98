"""Every private part of hivemind that p2ptrain relies on (p2ptrain/hivemind_compat.py) is there in the
installed hivemind, with the parameters p2ptrain calls it with; and the list is complete for p2ptrain's subclasses."""

from __future__ import annotations

import inspect

import pytest

from p2ptrain import hivemind_compat, lookup_pace
from p2ptrain.hivemind_compat import TOUCH_POINTS, TouchPoint, check_hivemind, missing_touch_points


@pytest.mark.parametrize("point", TOUCH_POINTS, ids=lambda p: f"{p.owner.rsplit('.', 1)[1]}.{p.name}")
def test_touch_point_is_there(point: TouchPoint):
    assert point.problem() is None


def test_a_missing_or_changed_touch_point_is_named_and_refused(monkeypatch):
    gone = TouchPoint("hivemind.averaging.matchmaking.Matchmaking", "_no_such_method", "method", "-", "-", ("self",))
    changed = TouchPoint("hivemind.averaging.matchmaking.Matchmaking", "_request_join_group", "method", "-", "-",
                         ("self",))
    unset = TouchPoint("hivemind.averaging.matchmaking.Matchmaking", "no_such_attribute", "attribute", "-", "-")
    assert missing_touch_points((gone, changed, unset)) == [
        "hivemind.averaging.matchmaking.Matchmaking._no_such_method is gone",
        "hivemind.averaging.matchmaking.Matchmaking._request_join_group takes ('self', 'leader'), not ('self',)",
        "hivemind.averaging.matchmaking.Matchmaking no longer sets self.no_such_attribute",
    ]
    monkeypatch.setattr(hivemind_compat, "_missing_once", lambda: ("X is gone", "Y is gone"))
    with pytest.raises(RuntimeError, match=r"^hivemind \S+ is not the one p2ptrain was written for \(X is gone; and 1 "
                                           r"more\); install it with: pip install hivemind==1\.1\.12$"):
        check_hivemind()


def test_every_hivemind_method_p2ptrain_overrides_is_listed():
    """A new override of a hivemind method (private or not) must join the list, so that an upgrade checks it."""
    from hivemind.averaging import DecentralizedAverager
    from hivemind.averaging.allreduce import AllReduceRunner
    from hivemind.averaging.partition import TensorPartReducer

    from p2ptrain.averaging.allreduce import ExactAllReduceRunner
    from p2ptrain.averaging.reducer import Reducer as _Reducer
    from p2ptrain.averaging.averager import PseudoGradientAverager

    listed = {(p.owner.rsplit(".", 1)[1], p.name) for p in TOUCH_POINTS}
    unlisted = []
    for ours, base in [(PseudoGradientAverager, DecentralizedAverager), (ExactAllReduceRunner, AllReduceRunner),
                       (_Reducer, TensorPartReducer)]:
        p2ptrain_classes = [c for c in ours.__mro__ if c.__module__.startswith("p2ptrain.")]
        for cls in p2ptrain_classes:
            for name, value in vars(cls).items():
                if inspect.isfunction(value) and name.startswith("_") and not name.startswith("__") \
                        and hasattr(base, name):
                    owner = next(c for c in base.__mro__ if name in vars(c))
                    if (owner.__name__, name) not in listed:
                        unlisted.append(f"{cls.__name__}.{name} overrides {owner.__name__}.{name}")
    assert not unlisted, unlisted


STANDALONE_PARSE = """
import sys
from p2ptrain.hivemind_compat import multiaddr_class
multiaddr = multiaddr_class()
parsed = multiaddr(sys.argv[1])
print([p.name for p in parsed.protocols()], str(parsed), "torch" in sys.modules, "hivemind" in sys.modules)
"""


def test_the_standalone_multiaddr_parses_as_hivemind_does_without_loading_hivemind():
    """The config checks addresses with hivemind's own vendored parser, loaded without hivemind (and torch)."""
    import subprocess
    import sys

    from hivemind.utils.multiaddr import Multiaddr

    maddr = "/ip4/203.0.113.7/tcp/31337/p2p/QmSXUVsMGJFQBswMvF8D8Fmqy9QgjPzgfoqk3FUZv6ginu"
    out = subprocess.run([sys.executable, "-c", STANDALONE_PARSE, maddr], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    expected = Multiaddr(maddr)
    assert out.stdout.strip() == f"{[p.name for p in expected.protocols()]} {expected} False False"
    bad = subprocess.run([sys.executable, "-c", STANDALONE_PARSE, "bootstrap.example.org:4001"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode != 0 and "StringParseError" in bad.stderr
    assert multiaddr_class_in_this_process_is_hiveminds()


def multiaddr_class_in_this_process_is_hiveminds() -> bool:
    """Once hivemind is imported, the parser is its own class (one Multiaddr type in a process that has both)."""
    from hivemind.utils.multiaddr import Multiaddr

    return hivemind_compat.multiaddr_class() is Multiaddr


def test_group_lookups_start_quick_and_settle_at_two_a_second():
    """A step's lookups of its group's leaders come quickly at first (peers that arrive together find the leader
    that declared a few milliseconds after their first look) and then at most every GROUP_LOOKUP_INTERVAL_S."""
    from itertools import islice

    gaps = list(islice(lookup_pace.group_lookup_gaps(), 8))
    assert gaps == [0.05, 0.1, 0.2, 0.4, 0.5, 0.5, 0.5, 0.5]
    assert gaps[-1] == lookup_pace.GROUP_LOOKUP_INTERVAL_S
    assert lookup_pace.group_lookups_within(0.0) == 1  # the first goes at once
    assert lookup_pace.group_lookups_within(0.75) == 5  # at 0, 0.05, 0.15, 0.35, 0.75
    # ten more seconds alone: twenty more lookups, no more
    assert lookup_pace.group_lookups_within(10.75) - lookup_pace.group_lookups_within(0.75) == 20
