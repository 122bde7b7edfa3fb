"""From what the processes of a launch left to each rank's `RankExit`: pure, tested as data.

Two kinds of facts meet here: what the launcher saw of each process it (or its engine) started -
pid, exit status, the signals sent to it - and what each worker wrote in its attempt's folder -
its pid and rank, its exception, its stack. A worker that died before writing anything is still
known by its place in the start order, which the engines keep: one process per local rank,
local rank 0 first, attempt after attempt.
"""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from xlaunch.result.errors import ProcessFailure
from xlaunch.result.outcome import RankExit
from xlaunch.worker.launch_dir import read_failures, read_stacks, returned_ranks, worker_places


@dataclass(frozen=True)
class ChildExit:
    """One started process as its parent saw it."""

    pid: int | None
    exitcode: int | None  # None: still running; negative: the signal it died of
    signals_sent: frozenset[int] = frozenset()


@dataclass(frozen=True)
class AttemptFiles:
    """What the workers of one attempt wrote about themselves."""

    places: Mapping[int, tuple[int, int]] = field(default_factory=dict)  # rank -> (pid, local)
    records: Mapping[int, ProcessFailure] = field(default_factory=dict)
    stacks: Mapping[int, str] = field(default_factory=dict)
    returned: frozenset[int] = frozenset()  # ranks whose function returned

    @classmethod
    def read(cls, folder: Path | None) -> AttemptFiles:
        if folder is None or not folder.exists():
            return cls()
        return cls(worker_places(folder), read_failures(folder), read_stacks(folder),
                   returned_ranks(folder))


def elastic_exits(children: Sequence[ChildExit], attempts: Sequence[AttemptFiles],
                  per_attempt: int, rank_offset: int) -> list[tuple[RankExit, ...]]:
    """Each attempt's ranks, oldest attempt first.

    The engine starts ``per_attempt`` processes per attempt in local-rank order, so the n-th
    process started belongs to attempt n // per_attempt. Its global rank comes from its own pid
    file; failing that, from the offset its peers' pid files show (rank - local rank).
    """
    count = max(len(attempts), -(-len(children) // per_attempt) if per_attempt else 0)
    result = []
    for index in range(count):
        files = attempts[index] if index < len(attempts) else AttemptFiles()
        started = children[index * per_attempt:(index + 1) * per_attempt]
        by_pid = {pid: rank for rank, (pid, _) in files.places.items()}
        offset = next((rank - local for rank, (_, local) in files.places.items()), rank_offset)
        exits = {}
        for local, child in enumerate(started):
            rank = by_pid.get(child.pid, offset + local) if child.pid else offset + local
            exits[rank] = _rank_exit(rank, child, files)
        for rank, (pid, _) in files.places.items():  # seen only through its own files
            exits.setdefault(rank, _rank_exit(rank, ChildExit(pid, None), files))
        result.append(tuple(exits[rank] for rank in sorted(exits)))
    return result


def xla_exits(children: Sequence[ChildExit], files: AttemptFiles, world_size: int,
              tails: Mapping[int, str], stopped_all: bool) -> tuple[RankExit, ...]:
    """The replicas of one XLA launch; several ranks share a process on v2/v3 chips.

    ``children`` are the processes the leader saw; ``stopped_all`` says the launcher ended the
    leader's whole group, so a replica with no exit on record was stopped, not lost.

    Without that decision, the only signals the pool's processes get are the pool's own reaction
    to a process that died (a broken pool terminates the rest) and the reap at the end. A process
    that exited with a status of 0 or more was not ended by them (no signal's default action
    exits so, and xlaunch's stop handler ends of the signal): what it ended of was its own.
    """
    by_pid: dict[int, ChildExit] = {child.pid: child for child in children if child.pid}
    ranks_of: dict[int, list[int]] = {}
    for rank, (pid, _) in files.places.items():
        ranks_of.setdefault(pid, []).append(rank)
    exits = {}
    for pid, ranks in ranks_of.items():
        child = by_pid.get(pid) or ChildExit(pid, None)
        if stopped_all and child.exitcode is None:
            child = ChildExit(pid, None, frozenset({signal.SIGKILL}))
        elif not stopped_all and child.exitcode is not None and child.exitcode >= 0:
            child = ChildExit(pid, child.exitcode)  # signals that reached it as it ended
        for rank in ranks:
            exits[rank] = _rank_exit(rank, child, files, tails.get(rank, ""))
    # A process that died before it learnt its rank gets one no other process has.
    spare = iter(sorted(set(range(world_size + len(by_pid))) - set(exits)))
    for pid, child in by_pid.items():
        if pid not in ranks_of and child.exitcode not in (0, None):
            rank = next(spare)
            exits[rank] = _rank_exit(rank, child, files, tails.get(rank, ""))
    return tuple(exits[rank] for rank in sorted(exits))


def _rank_exit(rank: int, child: ChildExit, files: AttemptFiles, tail: str = "") -> RankExit:
    return RankExit(rank=rank, pid=child.pid, exitcode=child.exitcode,
                    record=files.records.get(rank), signals_sent=child.signals_sent,
                    stack=files.stacks.get(rank, ""), stderr_tail=tail,
                    returned=rank in files.returned)
