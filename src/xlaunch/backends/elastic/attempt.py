"""One attempt of a launch whose workers form a torch.distributed group, as its supervisor sees
it (see supervise.Supervised): this node's workers started, watched and stopped by their owner.

The launch thread starts one process per local rank and waits on their ends (no polling: a
process's end is seen the moment it happens). The first rank that fails - a non-zero status, or
an end before its function returned - stops the rest at once, as torchrun does; what each process
left is read afterwards as facts. With several machines, a failure here is told to the other
nodes through the rendezvous's store, and one told from there stops this node's workers too.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from xlaunch.backends.elastic.job import Job, World, run_worker
from xlaunch.backends.exits import AttemptFiles, dist_exits
from xlaunch.backends.processes import LaunchStopped, ProcessSet
from xlaunch.plan.specs import ElasticSpec, LaunchPlan
from xlaunch.result.errors import LeftRunning, ProcessFailure
from xlaunch.result.outcome import RankExit
from xlaunch.worker.launch_dir import (
    GROUP_STORE,
    LaunchDir,
    collect_stacks,
    noted,
    private_file,
    settled,
    worker_pids,
)


class Nodes(Protocol):
    """The other machines of a job, as an attempt needs them (`rendezvous.NodeRendezvous`)."""

    def meet(self, attempt: int) -> World: ...
    def report_failure(self, attempt: int, rank_exit: RankExit) -> None: ...
    def failed_elsewhere(self, attempt: int) -> str | None: ...


class DistAttempt:
    def __init__(self, plan: LaunchPlan, spec: ElasticSpec, make_job: Callable[[World], Job],
                 launch_dir: LaunchDir, attempt: int, world: World | None,
                 nodes: Nodes | None = None) -> None:
        self.plan, self.spec, self.make_job = plan, spec, make_job
        self.launch_dir, self.attempt, self.world, self.nodes = launch_dir, attempt, world, nodes
        self.folder: Path = launch_dir.attempt_dir(attempt)
        self.owner: ProcessSet | None = None
        self.stacks: dict[int, str] = {}
        self.settled_at_deadline: frozenset[int] | None = None  # see exits.AttemptFiles
        self.failure: ProcessFailure | None = None  # the launch failed before any worker ran
        self._gate = threading.Lock()
        self._cancelled = False

    # --- in the launch thread ----------------------------------------------------------------

    def run(self) -> None:
        try:
            self._run()
        except BaseException as error:  # reported as the launch's own failure
            self.failure = dataclasses.replace(ProcessFailure.from_exception(error, rank=0),
                                               pid=None)

    def _run(self) -> None:
        world = self.world
        if world is None:  # several machines: where this node sits is known once they meet
            assert self.nodes is not None
            world = self.world = self.nodes.meet(self.attempt)
        forked = self.spec.start_method == "fork"
        if forked:  # imported once here, not once in every forked worker
            import torch.distributed  # noqa: F401
        with self._gate:
            if self._cancelled:
                return
            owner = self.owner = ProcessSet(self.plan.stop_grace)
        if world.store_prefix is None:  # torch's FileStore would make it 0644: made private here
            os.close(private_file(self.folder / GROUP_STORE))
        job = self.make_job(world)
        job.setup = dataclasses.replace(job.setup, tree=owner.ticket(forked))
        for local_rank in range(self.plan.num_processes):
            try:
                owner.start(self.spec.start_method, run_worker, (local_rank, job),
                            name=f"xlaunch-rank-{world.rank_offset + local_rank}")
            except LaunchStopped:
                break
        self._watch(owner, world)

    def _watch(self, owner: ProcessSet, world: World) -> None:
        pending = owner.started
        local_rank = {process: index for index, process in enumerate(pending)}
        while pending:
            for process in owner.wait(pending, self.spec.monitor_interval):
                pending.remove(process)
                rank = world.rank_offset + local_rank[process]
                if self._failed(owner.exitcode(process), rank) and not owner.stopped():
                    if self.nodes is not None:  # which rank, and how: the others lead with it
                        self.nodes.report_failure(self.attempt, self.exits()[local_rank[process]])
                    owner.stop(f"rank {rank} failed")
            elsewhere = self.nodes.failed_elsewhere(self.attempt) if self.nodes else None
            if elsewhere is not None and pending and not owner.stopped():
                owner.stop(elsewhere)

    def _failed(self, exitcode: int | None, rank: int) -> bool:
        """Ended in failure: a non-zero status, or status 0 before its function returned."""
        if exitcode != 0:
            return True
        return rank not in noted(self.folder, "returned") | noted(self.folder, "cancelled")

    # --- in the caller's thread ------------------------------------------------------------

    def check(self) -> None:
        return None

    def expire(self) -> None:
        """Stacks first, then every process of the attempt."""
        self.settled_at_deadline = settled(self.folder)  # before anyone is asked or stopped
        self.launch_dir.cancel()
        owner = self.owner
        if owner is None:
            return
        pids = worker_pids(self.folder)
        asked = set(owner.ask_stacks(pids.values()))
        self.stacks = collect_stacks(self.folder, [r for r, pid in pids.items() if pid in asked])
        owner.stop(f"the launch's timeout ({self.plan.timeout} s) passed")

    def stop(self) -> bool:
        with self._gate:
            self._cancelled = True
            owner = self.owner
        self.launch_dir.cancel()
        if owner is not None:
            owner.stop("interrupted (the stop button, Ctrl-C or SIGTERM)")
        # Several nodes still meeting: nothing of ours runs yet and the wait cannot be cut short.
        return owner is not None or self.world is not None

    def end(self) -> list[int]:
        """Every process of the attempt ended; the pids of any that could not be."""
        return self.owner.close() if self.owner is not None else []

    def left_running(self) -> list[LeftRunning]:
        """What the workers started that left the launch's group, still running at its end."""
        return self.owner.left_running if self.owner is not None else []

    # --- the facts ----------------------------------------------------------------------------

    def exits(self) -> tuple[RankExit, ...]:
        files = AttemptFiles.read(self.folder, self.settled_at_deadline)
        if self.stacks:
            files = dataclasses.replace(files, stacks=self.stacks)
        ends = self.owner.ends() if self.owner is not None else []
        offset = self.world.rank_offset if self.world is not None else 0
        return dist_exits(ends, files, offset)

