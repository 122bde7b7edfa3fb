"""The caller's handle on one attempt's launch leader: start it, watch it, stop it, collect it.

The leader is forked from the launch thread, which then waits for it; the caller's thread
supervises (supervise.py). Everything the attempt leaves is gathered into `RankExit`s here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import signal
import threading
import time
from pathlib import Path
from typing import Any

from ...errors import ProcessFailure
from ...launch_dir import LaunchDir, dump_stacks, worker_pids
from ...outcome import RankExit
from ...plan import LaunchPlan, XlaSpec
from ...process_group import LaunchGroup
from ...worker import flush_output
from ..exits import AttemptFiles, ChildExit, xla_exits
from . import leader, replica
from .tail import Tail

FAILURE_GRACE_S = 3.0  # after a replica fails, its peers get this long to end on their own
STOP_GRACE_S = 2.0  # the leader's time to stop its pool before the whole group is killed


class LeaderRun:
    """One attempt on the XLA path (see supervise.Supervised)."""

    def __init__(self, plan: LaunchPlan, job: replica.Job) -> None:
        assert isinstance(plan.spec, XlaSpec)
        self.plan, self.spec, self.job = plan, plan.spec, job
        self.launch_dir = LaunchDir(job.setup.launch_dir)
        self.attempt: Path = self.launch_dir.attempt_dir(job.attempt)
        self.group: LaunchGroup | None = None
        self.pid = 0
        self.status: int | None = None  # the leader's exit status once reaped (-N: signal N)
        self.leader_signals: set[int] = set()
        self.stopped_all = False
        self.stacks: dict[int, str] = {}
        self.tail = Tail()
        self._exited = threading.Event()
        self._failed_at: float | None = None
        self._gate = threading.Lock()
        self._cancelled = False

    def run(self) -> None:
        with self._gate:
            if self._cancelled:
                return
            self.group = LaunchGroup()
            setup = dataclasses.replace(self.job.setup, group=self.group.ticket(forked=True))
            self.job = dataclasses.replace(self.job, setup=setup)
            read_end, write_end = os.pipe()
            flush_output()  # buffered text would be written twice
            pid = os.fork()
            if pid == 0:  # the leader: it never returns into the caller's code
                try:
                    os.close(read_end)
                    leader.lead(self.plan, self.job, write_end)
                finally:
                    os._exit(1)
            os.close(write_end)
            self.pid = pid
        self.tail.start(read_end)
        try:
            self.status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        except ChildProcessError:  # reaped behind our back (SIGCHLD ignored in the caller)
            self.status = 0
        finally:
            self._exited.set()
            self.tail.stop()

    def check(self) -> None:
        """Peers stuck in a collective would wait for a failed replica forever."""
        if self._exited.is_set():
            return
        now = time.monotonic()
        if self._failed_at is None and any(self.attempt.glob("failure-*.json")):
            self._failed_at = now
        if self._failed_at is not None and now - self._failed_at >= FAILURE_GRACE_S:
            self._stop_leader()

    def expire(self) -> None:
        pids = worker_pids(self.attempt)
        stacks = dump_stacks(self.attempt, pids)
        by_pid = {pids[rank]: text for rank, text in stacks.items() if text}
        # Replicas that share a process (v2/v3) share its dump.
        self.stacks = {rank: stacks.get(rank) or by_pid.get(pid) or "(no stack arrived)"
                       for rank, pid in pids.items()}
        self._stop_leader()

    def stop(self) -> bool:
        with self._gate:
            self._cancelled = True
            started = bool(self.pid)
        self._stop_leader()
        return started

    def _stop_leader(self) -> None:
        """SIGTERM lets the leader end its pool and say how; then the whole group is killed."""
        self.launch_dir.cancel()  # a replica not started yet will not start
        if self.pid and not self._exited.is_set():
            self.leader_signals.add(signal.SIGTERM)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            self._exited.wait(STOP_GRACE_S)
        self.stopped_all = True
        if not self._exited.is_set():
            self.leader_signals.add(signal.SIGKILL)
        if self.group is not None:
            self.group.kill()

    def exits(self) -> tuple[RankExit, ...]:
        """Each replica's end, from the leader's record of its pool and the replicas' files."""
        files = AttemptFiles.read(self.attempt)
        files = AttemptFiles(files.places, files.records, self.stacks or files.stacks)
        leader_exit = ChildExit(self.pid, self.status, frozenset(self.leader_signals))
        if self.spec.nprocs == 1:  # the leader was the replica
            children = [leader_exit]
        else:
            children = [ChildExit(entry.get("pid"), entry.get("exitcode"),
                                  frozenset(entry.get("signals_sent") or ()))
                        for entry in leader.read_exits(self.attempt)]
        tails = {rank: self.tail.lines(rank) for rank in files.places}
        exits = xla_exits(children, files, self.plan.world_size, tails, self.stopped_all)
        if not exits and self.status not in (0, None) and not self.stopped_all:
            # Nothing started and the leader died without a word (a crash importing torch_xla).
            return (RankExit(rank=0, pid=self.pid, exitcode=self.status,
                             stderr_tail=self.tail.lines()),)
        return exits

    def end(self) -> None:
        if self.group is not None:
            self.group.end()

    def leader_failure(self) -> ProcessFailure | None:
        return leader.read_leader_failure(self.attempt)

    def result(self) -> Any:
        path = self.attempt / replica.RESULT_FILE
        return pickle.loads(path.read_bytes()) if path.exists() else None
