"""The caller's side (the launch thread) of an attempt run through a launch leader it forks
first (`in_leader.lead` is what the leader runs): for the one replica ``xmp.spawn(nprocs=1)`` runs
in its caller.

``nprocs=1`` runs the function in the calling process and leaves the runtime initialised there,
after which every later spawn in that process refuses. In a leader that state dies with the
leader, so the next launch in the same notebook works. Legacy TPU Nodes (torch_xla <= 2.0) run
their whole launch in a leader too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal

from xlaunch.backends.exits import ChildExit
from xlaunch.backends.xla import in_leader, replica
from xlaunch.backends.xla.attempt import AttemptRun
from xlaunch.plan.specs import LaunchPlan, XlaSpec
from xlaunch.worker.rank import flush_output

LEADER_EXTRA_S = 2.0  # beyond the stop's grace: the leader's time to reap and record its pool


class LeaderRun(AttemptRun):
    def __init__(self, plan: LaunchPlan, spec: XlaSpec, job: replica.Job) -> None:
        super().__init__(plan, spec, job)
        self.pid = 0
        self.status: int | None = None  # the leader's exit status once reaped (-N: signal N)
        self.leader_signals: set[int] = set()  # what the launcher sent the leader

    def _run(self) -> None:
        if not self._begin():
            return
        assert self.tree is not None
        setup = dataclasses.replace(self.job.setup, tree=self.tree.ticket(forked=True))
        job = dataclasses.replace(self.job, setup=setup)
        read_end, write_end = os.pipe()
        flush_output()  # buffered text would be written twice
        pid = os.fork()
        if pid == 0:  # the leader: it never returns into the caller's code
            try:
                os.close(read_end)
                in_leader.lead(self.spec, job, write_end)
            finally:
                os._exit(1)
        os.close(write_end)
        self.pid = pid
        self.tail.start(read_end)
        try:
            self.status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        except ChildProcessError:  # reaped behind our back (SIGCHLD ignored in the caller)
            self.status = 0
        self.failure = self.failure or in_leader.read_leader_failure(self.attempt)

    def _stop_all(self) -> None:
        """SIGTERM lets the leader end its pool and say how; then the whole group is killed."""
        self.launch_dir.cancel()  # a replica not started yet will not start
        self.stopped_all = True
        if self.pid and not self._finished.is_set():
            self.leader_signals.add(signal.SIGTERM)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            if not self._finished.wait(self.plan.stop_grace + LEADER_EXTRA_S):
                self.leader_signals.add(signal.SIGKILL)
        if self.tree is not None:
            self.tree.kill()

    def children(self) -> list[ChildExit]:
        leader_exit = ChildExit(self.pid, self.status, frozenset(self.leader_signals))
        if self.spec.nprocs == 1:  # the leader was the replica
            return [leader_exit]
        return [ChildExit(entry.get("pid"), entry.get("exitcode"),
                          frozenset(entry.get("signals_sent") or ()))
                for entry in in_leader.read_exits(self.attempt)]
