"""hivemind's StepControl, collected while torch's fake-tensor mode is on (torch's compile and checkpoint planning
use one): its __del__ reads a shared-memory tensor, which fake mode refuses with a traceback on the daemon's stderr
(CI, test_ctrl_c_stops_a_two_rank_peer_cleanly, once). p2ptrain runs that __del__ outside fake mode."""

from __future__ import annotations

import gc
import sys

from hivemind.averaging.control import StepControl
from hivemind.utils import MPFuture, get_dht_time
from torch._subclasses.fake_tensor import FakeTensorMode

import p2ptrain.averaging  # noqa: F401 (installs the guard)


def test_a_step_control_collected_in_fake_tensor_mode_reads_its_state_without_a_traceback(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: seen.append(unraisable.exc_value))
    trigger, cancel = MPFuture(), MPFuture()  # first: hivemind starts the futures' backend on MPFuture itself
    control = StepControl(scheduled_time=get_dht_time(), deadline=get_dht_time() + 5, allow_retries=False,
                          weight=1.0, data_for_gather=b"")
    control.attach(trigger, cancel)
    trigger.set_result(None)  # triggered: its __del__ reads that from the shared state, and warns of nothing
    with FakeTensorMode():
        del control
        gc.collect()
    assert not seen, seen
