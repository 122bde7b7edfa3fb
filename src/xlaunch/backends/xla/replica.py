"""What each XLA replica runs: xmp.spawn calls `replica` with its global ordinal."""

from __future__ import annotations

import faulthandler
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...launch_dir import atomic_write
from ...worker import Worker, WorkerSetup

RESULT_FILE = "result.pkl"


@dataclass(frozen=True)
class Job:
    """What every replica runs (plain data, so ``spawn`` can pickle it)."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    setup: WorkerSetup
    attempt: int = 0


# The job, for replicas forked from the leader. xmp.spawn's pool pickles what it is given even
# under fork, and a closure, a lambda or an argument such as a lock cannot be pickled.
FORKED_JOB: Job | None = None


def replica(index: int, job: Job | None = None) -> None:
    """One replica, in a thread of its process (two threads a process on v2/v3 chips)."""
    job = job or FORKED_JOB
    assert job is not None
    if not faulthandler.is_enabled():  # spawn/forkserver: a crash still leaves its stack on fd 2
        faulthandler.enable(file=2, all_threads=False)
    world_size, local_ordinal = world()
    worker = Worker(job.setup, job.attempt, index, local_ordinal, world_size)
    result = worker.run(job.function, job.args)
    if local_ordinal != 0:  # each host of a pod returns its own first replica's result
        return
    data = pickle.dumps(worker.returnable(result))
    atomic_write(worker.attempt / RESULT_FILE, data)


def world() -> tuple[int, int]:
    """World size and this replica's ordinal on its host: torch_xla.runtime, else its forerunners."""
    try:
        import torch_xla.runtime as xr

        return int(xr.world_size()), int(xr.local_ordinal())
    except (ImportError, AttributeError):
        import torch_xla.core.xla_model as xm

        return int(xm.xrt_world_size()), int(xm.get_local_ordinal())
