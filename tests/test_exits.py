"""`backends.exits`: what each process left, turned into each rank's `RankExit`, as data.

No processes: the facts the launch's owner kept (pid, exit status, the signals it sent that
reached the process alive) and the files workers wrote (pid and rank, records, stacks, marks)
are written out by hand.
"""

from __future__ import annotations

import signal

from xlaunch.backends.exits import AttemptFiles, dist_exits, xla_exits
from xlaunch.backends.processes import ProcessEnd
from xlaunch.result.errors import ProcessFailure
from xlaunch.result.outcome import classify

KILL, TERM = signal.SIGKILL, signal.SIGTERM


def test_the_nth_process_started_is_local_rank_n_whatever_it_wrote():
    # Node 1 of 2 (ranks 2-3): local rank 0 wrote its pid file, local rank 1 died at once.
    ends = [ProcessEnd(30, 1), ProcessEnd(31, -signal.SIGSEGV)]
    record = ProcessFailure(rank=2, exc_type="ValueError", message="bad")
    files = AttemptFiles(places={2: (30, 0)}, records={2: record})
    exits = dist_exits(ends, files, rank_offset=2)
    assert [(e.rank, e.pid, e.exitcode) for e in exits] == [(2, 30, 1), (3, 31, -signal.SIGSEGV)]
    assert exits[0].record is record and exits[1].record is None


def test_marks_reach_their_rank_and_pid():
    ends = [ProcessEnd(40, 0), ProcessEnd(41, 0, frozenset({TERM}))]
    files = AttemptFiles(returned=frozenset({0}), cancelled=frozenset({1}),
                         terminated=frozenset({41}))
    first, second = dist_exits(ends, files, rank_offset=0)
    assert first.returned and not first.cancelled and not first.terminated
    assert second.cancelled and second.terminated and second.signals_sent == {TERM}


def test_replicas_sharing_a_process_share_its_end_and_keep_their_own_records():
    record = ProcessFailure(rank=1, exc_type="KeyError", message="x")
    files = AttemptFiles(places={0: (60, 0), 1: (60, 1), 2: (61, 0), 3: (61, 1)},
                         records={1: record}, stacks={3: "stack of 3"})
    ends = [ProcessEnd(60, 1), ProcessEnd(61, 0)]
    exits = xla_exits(ends, files, world_size=4, tails={1: "tail 1"})
    assert [(e.rank, e.pid, e.exitcode) for e in exits] == [(0, 60, 1), (1, 60, 1), (2, 61, 0),
                                                           (3, 61, 0)]
    assert exits[1].record is record and exits[0].record is None
    assert exits[1].stderr_tail == "tail 1" and exits[3].stack == "stack of 3"


def test_an_engines_process_is_known_by_the_pid_it_wrote_as_it_began():
    # xmp.spawn's pool started 70 and 71; the owner never held them, they said they began.
    files = AttemptFiles(places={0: (70, 0)}, processes=frozenset({70, 71}))
    exits = xla_exits([], files, world_size=2, tails={})
    assert [(e.rank, e.pid, e.exitcode) for e in exits] == [(0, 70, None), (1, 71, None)]


def test_a_process_that_died_before_it_learnt_its_rank_gets_a_rank_no_other_has():
    files = AttemptFiles(places={0: (80, 0)})
    ends = [ProcessEnd(80, 0), ProcessEnd(81, -signal.SIGABRT), ProcessEnd(82, 0)]
    exits = xla_exits(ends, files, world_size=2, tails={})
    assert [(e.rank, e.pid) for e in exits] == [(0, 80), (1, 81)]  # a clean exit is not listed
    assert exits[1].exitcode == -signal.SIGABRT
    # An engine's process the owner stopped before it learnt its rank is no failure of its own.
    stopped = AttemptFiles(processes=frozenset({83}))
    assert xla_exits([ProcessEnd(83, None, frozenset({TERM}), adopted=True)], stopped, 1, {}) == ()


def test_an_engines_process_the_pool_terminated_is_stopped_not_its_own_death():
    # A pool process died of the OOM killer (no record, no mark); the broken pool then sent
    # SIGTERM to the other, whose handler wrote its "terminated" mark. The owner sent nothing.
    files = AttemptFiles(places={0: (90, 0), 1: (91, 0)}, processes=frozenset({90, 91}),
                         terminated=frozenset({91}))
    dead, stopped = xla_exits([], files, world_size=2, tails={})
    assert classify(dead, timed_out=False) == "died"
    assert classify(stopped, timed_out=False) == "stopped"
