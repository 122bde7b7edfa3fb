"""From what the processes of a launch left to each rank's `RankExit`: pure, tested as data.

Two kinds of facts meet here: what the launch's owner (`processes.ProcessSet`) knows of each
process - pid, exit status, the signals it sent that reached the process alive - and what each
worker wrote in its attempt's folder about itself: its pid and rank, its exception, its stack,
that its function returned, that it found the launch stopped, that it received SIGTERM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from xlaunch.backends.processes import ProcessEnd
from xlaunch.result.errors import ProcessFailure
from xlaunch.result.outcome import RankExit
from xlaunch.worker.launch_dir import (
    Mark,
    noted,
    read_crashes,
    read_failures,
    read_stacks,
    worker_places,
)


@dataclass(frozen=True)
class AttemptFiles:
    """What the workers of one attempt wrote about themselves."""

    places: Mapping[int, tuple[int, int]] = field(default_factory=dict)  # rank -> (pid, local)
    records: Mapping[int, ProcessFailure] = field(default_factory=dict)
    stacks: Mapping[int, str] = field(default_factory=dict)
    returned: frozenset[int] = frozenset()  # ranks whose function returned (value sent)
    sending: frozenset[int] = frozenset()  # ranks that began to send their value back
    cancelled: frozenset[int] = frozenset()  # ranks that found the launch stopped, ran nothing
    terminated: frozenset[int] = frozenset()  # pids that received SIGTERM
    processes: frozenset[int] = frozenset()  # pids of an engine's processes, as each began
    crashes: Mapping[int, tuple[int, str]] = field(default_factory=dict)  # pid -> signal, dump
    # Ranks whose function had returned or raised when the launch's deadline passed (None: no
    # deadline passed). What the others did while they were stopped changes nothing: they were
    # still running at the deadline, and the verdict is the timeout.
    settled_at_deadline: frozenset[int] | None = None

    @classmethod
    def read(cls, folder: Path | None,
             settled_at_deadline: frozenset[int] | None = None) -> AttemptFiles:
        if folder is None or not folder.exists():
            return cls(settled_at_deadline=settled_at_deadline)
        return cls(worker_places(folder), read_failures(folder), read_stacks(folder),
                   noted(folder, Mark.RETURNED), noted(folder, Mark.SENDING),
                   noted(folder, Mark.CANCELLED), noted(folder, Mark.TERMINATED),
                   noted(folder, Mark.BEGAN), read_crashes(folder), settled_at_deadline)


def dist_exits(ends: Sequence[ProcessEnd], files: AttemptFiles,
               rank_offset: int) -> tuple[RankExit, ...]:
    """The ranks of one attempt whose processes the owner started, one per local rank in order:
    the n-th process started is local rank n, whatever it wrote or failed to write."""
    return tuple(rank_exit(rank_offset + local, end, files) for local, end in enumerate(ends))


def xla_exits(ends: Sequence[ProcessEnd], files: AttemptFiles, world_size: int,
              tails: Mapping[int, str]) -> tuple[RankExit, ...]:
    """The replicas of one XLA launch; several ranks share a process on v2/v3 chips.

    The processes are the owner's own (a launch leader, the SPMD process) and the engine's (the
    pool ``xmp.spawn`` starts), each known by its pid; which ranks a process ran is in the pid
    files its replicas wrote.
    """
    by_pid = {end.pid: end for end in ends if end.pid}
    for pid in sorted(files.processes - set(by_pid)):
        by_pid[pid] = ProcessEnd(pid, None, adopted=True)
    ranks_of: dict[int, list[int]] = {}
    for rank, (pid, _) in files.places.items():
        ranks_of.setdefault(pid, []).append(rank)
    exits = {}
    for pid, ranks in ranks_of.items():
        end = by_pid.get(pid) or ProcessEnd(pid, None, adopted=True)
        for rank in ranks:
            exits[rank] = rank_exit(rank, end, files, tails.get(rank, ""))
    # A process that ended before it learnt its rank gets one no other process has.
    spare = iter(sorted(set(range(world_size + len(by_pid))) - set(exits)))
    for pid, end in by_pid.items():
        if pid not in ranks_of and end.exitcode != 0 and not (end.adopted and end.signals_sent):
            rank = next(spare)
            exits[rank] = rank_exit(rank, end, files, tails.get(rank, ""))
    return tuple(exits[rank] for rank in sorted(exits))


def rank_exit(rank: int, end: ProcessEnd, files: AttemptFiles, tail: str = "") -> RankExit:
    exitcode = end.exitcode
    crash = files.crashes.get(end.pid) if end.pid else None
    if crash is not None:  # its own dump says which signal ended it, whoever saw its status
        exitcode = exitcode if exitcode is not None else -crash[0]
        tail = f"{tail}\n{crash[1]}".strip()
    settled = files.settled_at_deadline
    running_at_deadline = settled is not None and rank not in settled
    return RankExit(rank=rank, pid=end.pid, exitcode=exitcode,
                    record=None if running_at_deadline else files.records.get(rank),
                    signals_sent=end.signals_sent,
                    stack=files.stacks.get(rank, ""), stderr_tail=tail,
                    returned=rank in files.returned and not running_at_deadline,
                    sending=rank in files.sending and rank not in files.returned,
                    cancelled=rank in files.cancelled,
                    terminated=end.pid in files.terminated,
                    running_at_deadline=running_at_deadline)
