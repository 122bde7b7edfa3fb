"""One attempt of an XLA launch, as its supervisor sees it (see supervise.Supervised).

torch_xla's ``xmp.spawn`` starts the replicas' processes. Two ways to call it, one owner either way
(`backends.processes.ProcessSet`, which holds the launch's tree and sends every signal):

- `pool`: from the launch thread, when the caller's environment already is what ``xmp.spawn``
  reads (the device, the chip layout): the pool's processes are the caller's children, and no
  process stands between them (a leader in between cost about 40 ms a launch on the CPU device);
- `leader`: from a launch leader the owner forks first, for one replica (``xmp.spawn(nprocs=1)``
  runs it in its caller), ``spawn``/``forkserver``, and a layout whose variables ``xmp.spawn``
  must read in the process that calls it: the leader sets them in itself, never in the caller.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

from xlaunch.backends.exits import AttemptFiles, xla_exits
from xlaunch.backends.processes import ProcessSet
from xlaunch.backends.xla import replica
from xlaunch.backends.xla.tail import Tail
from xlaunch.plan.specs import LaunchPlan, XlaSpec
from xlaunch.result.errors import LeftRunning, ProcessFailure
from xlaunch.result.outcome import RankExit
from xlaunch.worker.launch_dir import LaunchDir, collect_stacks, noted, settled, worker_pids

# After a replica fails, its peers get this long to end on their own before they are stopped:
# replicas run the same program, and eight cores that hit one bug then show as one entry.
# Not the stop grace (``stop_grace``, plan/options.py DEFAULT_STOP_GRACE, the same 3 s by
# coincidence): that runs from a stop's SIGTERM to its SIGKILL; this ends before the stop begins.
PEERS_GRACE_S = 3.0


def launch_failure(error: BaseException) -> ProcessFailure:
    """What failed in the launch thread itself, before any replica ran (no worker's pid)."""
    return dataclasses.replace(ProcessFailure.from_exception(error, rank=0), pid=None)


class XlaAttempt:
    def __init__(self, plan: LaunchPlan, spec: XlaSpec, job: replica.Job) -> None:
        self.plan, self.spec, self.job = plan, spec, job
        self.launch_dir = LaunchDir(job.setup.launch_dir)
        self.attempt: Path = self.launch_dir.attempt_dir(job.attempt)
        self.owner: ProcessSet | None = None
        self.stacks: dict[int, str] = {}
        self.settled_at_deadline: frozenset[int] | None = None  # see exits.AttemptFiles
        self.failure: ProcessFailure | None = None  # the launch failed before any replica ran
        self.tail = Tail()
        self.leader: Any = None  # the leader's process, when there is one
        self._finished = threading.Event()
        self._failed_at: float | None = None
        self._gate = threading.Lock()
        self._cancelled = False

    def run(self) -> None:
        from xlaunch.backends.xla import leader, pool

        try:
            pool.import_torch_xla()
            with self._gate:
                if self._cancelled:
                    return
                self.owner = ProcessSet(self.plan.stop_grace)
            if pool.can_run_here(self.spec):
                pool.run(self, self.owner)
            else:
                self.leader = leader.run(self, self.owner)
        except BaseException as error:  # reported as the launch's own failure
            self.failure = launch_failure(error)
        finally:
            self._finished.set()
            self.tail.stop()

    def check(self) -> None:
        """Peers stuck in a collective would wait for a failed replica forever."""
        if self._finished.is_set():
            return
        now = time.monotonic()
        if self._failed_at is None and any(self.attempt.glob("failure-*.json")):
            self._failed_at = now
        if self._failed_at is not None and now - self._failed_at >= PEERS_GRACE_S:
            self._stop_all(f"a replica failed; its peers had not ended {PEERS_GRACE_S:g} s later")

    def expire(self) -> None:
        self.settled_at_deadline = settled(self.attempt)  # before anyone is asked or stopped
        pids = worker_pids(self.attempt)
        asked = set(self.owner.ask_stacks(set(pids.values()))) if self.owner else set()
        stacks = collect_stacks(self.attempt, [r for r, pid in pids.items() if pid in asked])
        by_pid = {pids[rank]: text for rank, text in stacks.items() if text}
        # Replicas that share a process (v2/v3) share its dump.
        self.stacks = {rank: stacks.get(rank) or by_pid.get(pid) or "(no stack arrived)"
                       for rank, pid in pids.items()}
        self._stop_all(f"the launch's timeout ({self.plan.timeout} s) passed")

    def stop(self) -> bool:
        with self._gate:
            self._cancelled = True
            started = self.owner is not None
        if started:
            self._stop_all("interrupted (the stop button, Ctrl-C or SIGTERM)")
        return started

    def _stop_all(self, why: str) -> None:
        self.launch_dir.cancel()  # a replica not started yet will not start
        if self.owner is not None:
            self.owner.adopt(noted(self.attempt, "process"))
            self.owner.stop(why)

    def end(self) -> list[int]:
        """Every process of the attempt ended; the pids of any that could not be."""
        return self.owner.close() if self.owner is not None else []

    def left_running(self) -> list[LeftRunning]:
        """What the workers started that left the launch's group, still running at its end."""
        return self.owner.left_running if self.owner is not None else []

    def exits(self) -> tuple[RankExit, ...]:
        """Each replica's end, from how each process ended and the replicas' own files."""
        files = AttemptFiles.read(self.attempt, self.settled_at_deadline)
        files = dataclasses.replace(files, stacks=self.stacks or files.stacks)
        tails = {rank: self.tail.lines(rank) for rank in files.places}
        ends = self.owner.ends() if self.owner is not None else []
        if self.leader is not None and self.spec.nprocs != 1:  # the leader ran no replica
            ends = [end for end in ends if end.pid != self.leader.pid]
        return xla_exits(ends, files, self.plan.world_size, tails)
