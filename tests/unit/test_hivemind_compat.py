"""Every private part of hivemind that p2ptrain relies on (p2ptrain/averaging/hivemind_compat.py) is there in the
installed hivemind, with the parameters p2ptrain calls it with; and the list is complete for p2ptrain's subclasses."""

from __future__ import annotations

import inspect

import pytest

from p2ptrain.averaging import hivemind_compat
from p2ptrain.averaging.hivemind_compat import TOUCH_POINTS, TouchPoint, check_hivemind, missing_touch_points


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

    from p2ptrain.averaging.allreduce import ExactAllReduceRunner, _Reducer
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
