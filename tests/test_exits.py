"""`backends.exits`: what each process left, turned into each rank's `RankExit`, as data.

No processes: the facts a launcher saw (pid, exit status, signals sent) and the files workers
wrote (pid and rank, records, stacks, "returned" marks) are written out by hand.
"""

from __future__ import annotations

import signal

from xlaunch.backends.exits import AttemptFiles, ChildExit, elastic_exits, xla_exits
from xlaunch.result.errors import ProcessFailure

KILL = signal.SIGKILL


def test_each_attempt_takes_its_share_of_the_processes_in_start_order():
    children = [ChildExit(10, 1), ChildExit(11, -KILL, frozenset({KILL})),  # attempt 0
                ChildExit(20, 0), ChildExit(21, 0)]  # attempt 1
    record = ProcessFailure(rank=0, exc_type="ValueError", message="bad")
    attempts = [AttemptFiles(places={0: (10, 0), 1: (11, 1)}, records={0: record}),
                AttemptFiles(places={0: (20, 0), 1: (21, 1)}, returned=frozenset({0, 1}))]
    first, second = elastic_exits(children, attempts, per_attempt=2, rank_offset=0)
    assert [(e.rank, e.pid, e.exitcode) for e in first] == [(0, 10, 1), (1, 11, -KILL)]
    assert first[0].record is record and first[1].signals_sent == {KILL}
    assert [e.returned for e in second] == [True, True] and second[0].record is None


def test_a_process_that_died_before_writing_its_pid_gets_its_place_by_start_order():
    # Node 1 of 2 (ranks 2-3): local rank 0 wrote its pid file, local rank 1 died at once.
    children = [ChildExit(30, 1), ChildExit(31, -signal.SIGSEGV)]
    files = AttemptFiles(places={2: (30, 0)})
    (exits,) = elastic_exits(children, [files], per_attempt=2, rank_offset=0)
    assert [(e.rank, e.pid, e.exitcode) for e in exits] == [(2, 30, 1), (3, 31, -signal.SIGSEGV)]


def test_with_no_files_the_offset_given_places_the_ranks():
    (exits,) = elastic_exits([ChildExit(40, -KILL), ChildExit(41, -KILL)], [],
                             per_attempt=2, rank_offset=4)
    assert [e.rank for e in exits] == [4, 5]


def test_a_rank_seen_only_through_its_own_files_is_kept():
    files = AttemptFiles(places={0: (50, 0), 1: (51, 1)})
    (exits,) = elastic_exits([ChildExit(50, 0)], [files], per_attempt=2, rank_offset=0)
    assert [(e.rank, e.pid, e.exitcode) for e in exits] == [(0, 50, 0), (1, 51, None)]


def test_replicas_sharing_a_process_share_its_end_and_keep_their_own_records():
    record = ProcessFailure(rank=1, exc_type="KeyError", message="x")
    files = AttemptFiles(places={0: (60, 0), 1: (60, 1), 2: (61, 0), 3: (61, 1)},
                         records={1: record}, stacks={3: "stack of 3"})
    children = [ChildExit(60, 1), ChildExit(61, 0)]
    exits = xla_exits(children, files, world_size=4, tails={1: "tail 1"}, stopped_all=False)
    assert [(e.rank, e.pid, e.exitcode) for e in exits] == [(0, 60, 1), (1, 60, 1), (2, 61, 0),
                                                           (3, 61, 0)]
    assert exits[1].record is record and exits[0].record is None
    assert exits[1].stderr_tail == "tail 1" and exits[3].stack == "stack of 3"


def test_when_the_launcher_ended_everything_an_unseen_end_counts_as_its_kill():
    files = AttemptFiles(places={0: (70, 0), 1: (71, 1)})
    exits = xla_exits([ChildExit(70, 0)], files, world_size=2, tails={}, stopped_all=True)
    assert exits[0].signals_sent == frozenset() and exits[0].exitcode == 0
    assert exits[1].exitcode is None and exits[1].signals_sent == {KILL}
    unseen = xla_exits([ChildExit(70, 0)], files, world_size=2, tails={}, stopped_all=False)
    assert unseen[1].signals_sent == frozenset()


def test_a_process_that_died_before_it_learnt_its_rank_gets_a_rank_no_other_has():
    files = AttemptFiles(places={0: (80, 0)})
    children = [ChildExit(80, 0), ChildExit(81, -signal.SIGABRT), ChildExit(82, 0)]
    exits = xla_exits(children, files, world_size=2, tails={}, stopped_all=False)
    assert [(e.rank, e.pid) for e in exits] == [(0, 80), (1, 81)]  # a clean exit is not listed
    assert exits[1].exitcode == -signal.SIGABRT


def test_signals_that_reached_a_replica_as_it_ended_by_itself_are_not_the_cause():
    # os._exit(0) in a replica breaks xmp.spawn's pool, which then terminates its processes: on a
    # busy machine the dying replica is not reaped yet and the SIGTERM is noted on it. It exited 0:
    # no signal ended it. Only a stop the launcher decided (stopped_all) makes it the launcher's.
    files = AttemptFiles(places={0: (90, 0)})
    ended = [ChildExit(90, 0, frozenset({signal.SIGTERM, KILL}))]
    (own,) = xla_exits(ended, files, world_size=1, tails={}, stopped_all=False)
    assert own.exitcode == 0 and own.signals_sent == frozenset()
    (stopped,) = xla_exits(ended, files, world_size=1, tails={}, stopped_all=True)
    assert stopped.signals_sent == {signal.SIGTERM, KILL}
    killed = [ChildExit(90, -KILL, frozenset({KILL}))]  # a signal that did end it stays
    (gone,) = xla_exits(killed, files, world_size=1, tails={}, stopped_all=False)
    assert gone.signals_sent == {KILL}
