"""Messages that must read right: the counts an XLA device takes, what an XLA launch runs, and
what a death by each signal usually means."""

from __future__ import annotations

import pytest

from xlaunch.detect.environment import Environment
from xlaunch.plan import LaunchOptions, make_plan
from xlaunch.plan.tpu_layout import tpu_layout
from xlaunch.result.outcome import RankExit, failures_of


def xla_cpu(devices: int) -> Environment:
    return Environment("local", "cpu", devices, xla_device="CPU")


def test_one_xla_device_offers_one_choice_once():
    with pytest.raises(ValueError) as refused:
        tpu_layout(xla_cpu(1), 3)
    assert str(refused.value).endswith("use None or 1 (the one device)")
    with pytest.raises(ValueError) as refused:
        tpu_layout(xla_cpu(4), 3)
    assert str(refused.value).endswith("use None or 4 (every device) or 1 (one device)")


def test_an_xla_launch_on_cpu_devices_says_devices_not_processes():
    two = make_plan(xla_cpu(2), LaunchOptions())
    assert two.summary() == "2 XLA CPU devices through torch_xla (1 process x 2 threads)"
    one = make_plan(xla_cpu(1), LaunchOptions())
    assert one.summary() == "1 XLA CPU device through torch_xla (1 process)"


@pytest.mark.parametrize(("signal_number", "words", "not_words"), [
    (9, "the out-of-memory killer does this", "aborted"),
    (6, "aborted by native code", "out-of-memory"),
    (11, "crashed in native code", "out-of-memory"),
    (15, "killed by a signal nobody in the launch sent", "out-of-memory"),
])
def test_a_death_by_signal_is_explained_by_that_signal(signal_number, words, not_words):
    (failure,) = failures_of([RankExit(rank=0, pid=123, exitcode=-signal_number)], False)
    assert words in failure.message and not_words not in failure.message
