"""How a launch's workers that form one torch.distributed group start, on this node, and end.

The launch thread starts one process per local rank through the attempt's owner and waits on
their ends (no polling: a process's end is seen the moment it happens). The first rank that fails
- a non-zero status, or an end before its function returned - stops the rest at once, as torchrun
does; what each process left is read afterwards as facts. With several machines, this node first
meets the others (`rendezvous.NodeRendezvous`), a failure here is told to the other nodes through
the rendezvous's store, and one told from there stops this node's workers too.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable, Sequence
from typing import Protocol

from xlaunch.backends.elastic.job import DistJob, run_worker
from xlaunch.backends.environment import World
from xlaunch.backends.exits import AttemptFiles, dist_exits
from xlaunch.backends.processes import LaunchStopped, ProcessEnd, ProcessSet
from xlaunch.backends.supervise import Attempt
from xlaunch.plan.specs import ElasticSpec
from xlaunch.result.outcome import NodeFacts, Outcome, RankExit
from xlaunch.worker.launch_dir import GROUP_STORE, Mark, noted
from xlaunch.worker.private import private_file


class Nodes(Protocol):
    """The other machines of a job, as an attempt needs them (`rendezvous.NodeRendezvous`)."""

    def meet(self, attempt: int, cancelled: threading.Event) -> World: ...
    def report_failure(self, attempt: int, rank_exit: RankExit) -> None: ...
    def failed_elsewhere(self, attempt: int) -> str | None: ...
    def after(self, attempt: int, exits: Sequence[RankExit], timed_out: bool) -> NodeFacts: ...
    def waiting(self, attempt: int) -> str: ...


class DistStarter:
    """One attempt's workers on this node (`supervise.Starter`)."""

    def __init__(self, spec: ElasticSpec, num_processes: int, job: Callable[[World], DistJob],
                 world: World | None, nodes: Nodes | None = None) -> None:
        self.spec, self.num_processes, self.job = spec, num_processes, job
        self.world, self.nodes = world, nodes

    def prepare(self, attempt: Attempt) -> None:
        if self.world is None:  # several machines: where this node sits is known once they meet
            assert self.nodes is not None
            self.world = self.nodes.meet(attempt.number, attempt.cancelled)
        if self.spec.start_method == "fork":  # imported once here, not once in every worker
            import torch.distributed  # noqa: F401

    def start(self, attempt: Attempt, owner: ProcessSet) -> None:
        world = self.world
        assert world is not None
        forked = self.spec.start_method == "fork"
        if world.store_prefix is None:  # torch's FileStore would make it 0644: made private here
            os.close(private_file(attempt.folder / GROUP_STORE))
        job = self.job(world)
        job.setup = dataclasses.replace(job.setup, tree=owner.ticket(forked))
        for local_rank in range(self.num_processes):
            try:
                owner.start(self.spec.start_method, run_worker, (local_rank, job),
                            name=f"xlaunch-rank-{world.rank_offset + local_rank}")
            except LaunchStopped:
                break
        self._watch(attempt, owner, world)

    def _watch(self, attempt: Attempt, owner: ProcessSet, world: World) -> None:
        pending = owner.started
        local_rank = {process: index for index, process in enumerate(pending)}
        while pending:
            for process in owner.wait(pending, self.spec.monitor_interval):
                pending.remove(process)
                rank = world.rank_offset + local_rank[process]
                if not self._failed(attempt, owner.exitcode(process), rank):
                    continue
                if self.nodes is not None:  # which rank, and how: the others lead with it
                    # Every failed rank, after the stop too: a rank that lost its peer here may
                    # be seen ending before the peer that raised (the report keeps the first
                    # and any that ranks before it; a rank the stop ended has no record).
                    self.nodes.report_failure(attempt.number, attempt.exits()[local_rank[process]])
                if not owner.stopped():
                    attempt.stop_all()  # this rank failed: its peers go too, as under torchrun
            elsewhere = self.nodes.failed_elsewhere(attempt.number) if self.nodes else None
            if elsewhere is not None and pending and not owner.stopped():
                attempt.stop_all()

    @staticmethod
    def _failed(attempt: Attempt, exitcode: int | None, rank: int) -> bool:
        """Ended in failure: a non-zero status, or status 0 before its function returned."""
        if exitcode != 0:
            return True
        return rank not in noted(attempt.folder, Mark.RETURNED) | noted(attempt.folder,
                                                                         Mark.CANCELLED)

    def must_stop(self, attempt: Attempt) -> bool:
        return False

    def exits(self, attempt: Attempt, ends: Sequence[ProcessEnd],
              files: AttemptFiles) -> tuple[RankExit, ...]:
        return dist_exits(ends, files, self.world.rank_offset if self.world is not None else 0)

    def outcome(self, attempt: Attempt, outcome: Outcome) -> Outcome:
        """With several machines: what the other nodes told this one (their failures, their
        silence), for the judge to lead with the first failure wherever it happened."""
        if self.nodes is None:
            return outcome
        waiting = self.nodes.waiting(attempt.number) if outcome.timed_out else ""
        return dataclasses.replace(outcome, nodes=self.nodes.after(attempt.number, outcome.exits,
                                                                   outcome.timed_out),
                                   waiting=waiting)
