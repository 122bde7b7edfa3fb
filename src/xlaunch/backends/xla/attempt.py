"""One attempt of an XLA launch, as its supervisor sees it (see supervise.Supervised).

Two ways to start the replicas share everything else here: `pool.PoolRun` calls ``xmp.spawn``
from the launch thread, so the replicas are the caller's children; `via_leader.LeaderRun` forks a
launch leader first, for the one replica ``xmp.spawn(nprocs=1)`` would otherwise run in the caller.
"""

from __future__ import annotations

import dataclasses
import pickle
import threading
import time
from pathlib import Path
from typing import Any

from xlaunch.backends.exits import AttemptFiles, ChildExit, xla_exits
from xlaunch.backends.xla import replica
from xlaunch.backends.xla.tail import Tail
from xlaunch.plan.specs import LaunchPlan, XlaSpec
from xlaunch.result.errors import ProcessFailure
from xlaunch.result.outcome import RankExit
from xlaunch.worker.launch_dir import LaunchDir, dump_stacks, worker_pids
from xlaunch.worker.process_tree import ProcessTree

FAILURE_GRACE_S = 3.0  # after a replica fails, its peers get this long to end on their own


class AttemptRun:
    """What both ways of starting replicas share: watching, stopping, and the facts left."""

    def __init__(self, plan: LaunchPlan, spec: XlaSpec, job: replica.Job) -> None:
        self.plan, self.spec, self.job = plan, spec, job
        self.launch_dir = LaunchDir(job.setup.launch_dir)
        self.attempt: Path = self.launch_dir.attempt_dir(job.attempt)
        self.tree: ProcessTree | None = None
        self.stopped_all = False
        self.stacks: dict[int, str] = {}
        self.failure: ProcessFailure | None = None  # the launch failed before any replica ran
        self.tail = Tail()
        self._finished = threading.Event()
        self._failed_at: float | None = None
        self._gate = threading.Lock()
        self._cancelled = False
        self._started = False

    def run(self) -> None:
        try:
            self._run()
        except BaseException as error:  # reported as the launch's own failure
            self.failure = ProcessFailure.from_exception(error, rank=0)
        finally:
            self._finished.set()
            self.tail.stop()

    def _run(self) -> None:
        raise NotImplementedError

    def _begin(self) -> bool:
        """Under the gate: False when the launch was stopped before anything started."""
        with self._gate:
            if self._cancelled:
                return False
            self._started = True
            self.tree = ProcessTree()
            return True

    def check(self) -> None:
        """Peers stuck in a collective would wait for a failed replica forever."""
        if self._finished.is_set():
            return
        now = time.monotonic()
        if self._failed_at is None and any(self.attempt.glob("failure-*.json")):
            self._failed_at = now
        if self._failed_at is not None and now - self._failed_at >= FAILURE_GRACE_S:
            self._stop_all()

    def expire(self) -> None:
        pids = worker_pids(self.attempt)
        stacks = dump_stacks(self.attempt, pids)
        by_pid = {pids[rank]: text for rank, text in stacks.items() if text}
        # Replicas that share a process (v2/v3) share its dump.
        self.stacks = {rank: stacks.get(rank) or by_pid.get(pid) or "(no stack arrived)"
                       for rank, pid in pids.items()}
        self._stop_all()

    def stop(self) -> bool:
        with self._gate:
            self._cancelled = True
            started = self._started
        if started:
            self._stop_all()
        return started

    def _stop_all(self) -> None:
        raise NotImplementedError

    def end(self) -> None:
        if self.tree is not None:
            self.tree.end()

    def children(self) -> list[ChildExit]:
        raise NotImplementedError

    def exits(self) -> tuple[RankExit, ...]:
        """Each replica's end, from how each process ended and the replicas' own files."""
        files = AttemptFiles.read(self.attempt)
        files = dataclasses.replace(files, stacks=self.stacks or files.stacks)
        tails = {rank: self.tail.lines(rank) for rank in files.places}
        return xla_exits(self.children(), files, self.plan.world_size, tails, self.stopped_all)

    def result(self) -> Any:
        path = self.attempt / replica.RESULT_FILE
        return pickle.loads(path.read_bytes()) if path.exists() else None
