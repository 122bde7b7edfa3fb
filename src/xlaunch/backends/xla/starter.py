"""How an XLA launch's replicas start and end, as its attempts need them (`supervise.Starter`).

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

import time
from collections.abc import Sequence
from typing import Any

from xlaunch.backends.environment import Variables
from xlaunch.backends.exits import AttemptFiles, xla_exits
from xlaunch.backends.processes import ProcessEnd, ProcessSet
from xlaunch.backends.supervise import Attempt
from xlaunch.backends.xla import leader, pool
from xlaunch.backends.xla.replica import ReplicaJob
from xlaunch.backends.xla.tail import Tail
from xlaunch.plan.specs import XlaSpec
from xlaunch.result.outcome import Outcome, RankExit
from xlaunch.worker.launch_dir import failed_any

# After a replica fails, its peers get this long to end on their own before they are stopped:
# replicas run the same program, and eight cores that hit one bug then show as one entry.
# Not the stop grace (``stop_grace``, plan/options.py DEFAULT_STOP_GRACE, the same 3 s by
# coincidence): that runs from a stop's SIGTERM to its SIGKILL; this ends before the stop begins.
PEERS_GRACE_S = 3.0


class XlaStarter:
    """One attempt's replicas: ``job`` for each; ``path_env``: torch_xla's layer of their
    environment (`environment.xla_layer`), which decides between the pool and a leader."""

    def __init__(self, spec: XlaSpec, world_size: int, job: ReplicaJob,
                 path_env: Variables) -> None:
        self.spec, self.world_size, self.job, self.path_env = spec, world_size, job, path_env
        self.tail = Tail()  # the replicas' stderr, copied to the caller's, its last lines kept
        self.leader: Any = None  # the leader's process, when there is one
        self._failed_at: float | None = None

    def prepare(self, attempt: Attempt) -> None:
        pool.import_torch_xla()

    def start(self, attempt: Attempt, owner: ProcessSet) -> None:
        try:
            if pool.can_run_here(self.spec, self.path_env):
                pool.run(self.job, owner, self.tail)
            else:
                self.leader = leader.run(self.spec, self.job, owner, self.tail)
                attempt.failure = attempt.failure or leader.read_failure(attempt.folder)
        finally:
            self.tail.stop()

    def must_stop(self, attempt: Attempt) -> bool:
        """A replica failed and its peers had not ended `PEERS_GRACE_S` later: stuck in a
        collective, they would wait for it forever."""
        now = time.monotonic()
        if self._failed_at is None and failed_any(attempt.folder):
            self._failed_at = now
        return self._failed_at is not None and now - self._failed_at >= PEERS_GRACE_S

    def exits(self, attempt: Attempt, ends: Sequence[ProcessEnd],
              files: AttemptFiles) -> tuple[RankExit, ...]:
        """Each replica's end, from how each process ended and the replicas' own files."""
        tails = {rank: self.tail.lines(rank) for rank in files.places}
        if self.leader is not None and self.spec.nprocs != 1:  # the leader ran no replica
            ends = [end for end in ends if end.pid != self.leader.pid]
        return xla_exits(ends, files, self.world_size, tails)

    def outcome(self, attempt: Attempt, outcome: Outcome) -> Outcome:
        return outcome
