"""What careless notebooks do, on the CPU path: real launches through torch elastic.

A rank that finishes while its peers wait on it, an exit that bypasses the function's return, an
exception that cannot be printed, a worker that ignores SIGTERM, two launches from two threads,
binary and very long output. Each is what a notebook user writes by mistake; each must end with
the right rank blamed and nothing left broken. Tests never assert a duration.
"""

from __future__ import annotations

import sys

import pytest

import xlaunch
from xlaunch import LaunchError, LaunchTimeout, ProcessState, notebook_launcher


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    monkeypatch.setenv("XLAUNCH_ACCELERATOR", "cpu")


def finish_early_on_rank_one(how):
    if ProcessState().process_index == 1:
        if how == "exit":
            sys.exit(0)
        return "rank one is done"
    xlaunch.wait_for_everyone()  # rank 0 waits for a peer that will never come
    return "rank zero is done"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["return", "exit"])
def test_a_rank_that_finishes_while_its_peer_waits_is_the_root_cause(how):
    # Without a fix the peer waits in the barrier until gloo's 30 minutes: the launch's own
    # timeout (far above the few seconds a closed connection takes) makes that a LaunchTimeout.
    with pytest.raises(LaunchError) as caught:
        notebook_launcher(finish_early_on_rank_one, args=(how,), num_processes=2, timeout=90)
    error = caught.value
    assert not isinstance(error, LaunchTimeout), str(error)
    assert error.root_cause is not None and error.root_cause.rank == 1, str(error)
    assert error.root_cause.cause == "finished-early"
    text = str(error)
    assert "[root cause] rank 1" in text
    assert "while its peers still waited" in text
    assert "rank 0" in text and "wait_for_everyone" in text  # where the peer waited


def reduce_then_return():
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    return value.item()


@pytest.mark.timeout(240)
def test_ranks_that_all_finish_normally_are_unaffected():
    for _ in range(8):  # the last collective, then every rank leaves as soon as it can
        assert notebook_launcher(reduce_then_return, num_processes=2) == 2.0
