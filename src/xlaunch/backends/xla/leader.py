"""A launch leader: a process the launch's owner forks, which calls ``xmp.spawn`` in itself.

- ``xmp.spawn(nprocs=1)`` runs the function in the calling process and leaves the runtime
  initialised there, after which every later spawn in that process refuses. In the leader that
  state ends with the leader, so the next launch in the same notebook works; the leader is then
  the replica, and its exit status is the owner's to see.
- ``spawn``/``forkserver`` leave multiprocessing's resource tracker (and the fork server) running
  in the process that used them: in the leader they end with the launch's tree.
- A layout whose variables ``xmp.spawn`` reads where it is called (`environment.xla_layer`) is
  set in the leader, never in the caller.
- SPMD: the leader is the one process that drives every device. It switches SPMD on first, before
  anything in it can start the runtime, and runs the function itself, without ``xmp.spawn``
  (whose runtime would already be up when the function starts).

The leader says what went wrong before any replica ran in a record of its own (`LEADER_FAILURE`);
how each replica ended is in the replicas' own records and the owner's.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import os
import signal
from pathlib import Path
from typing import Any

from xlaunch.backends.environment import apply
from xlaunch.backends.processes import ProcessSet
from xlaunch.backends.xla import pool, replica
from xlaunch.backends.xla.tail import Tail
from xlaunch.plan.specs import XlaSpec
from xlaunch.result.errors import ProcessFailure
from xlaunch.worker import process_tree
from xlaunch.worker.launch_dir import LEADER_FAILURE, LaunchDir
from xlaunch.worker.private import atomic_write
from xlaunch.worker.rank import die_with_parent, flush_output


def run(spec: XlaSpec, job: replica.ReplicaJob, owner: ProcessSet, tail: Tail) -> Any:
    """In the launch thread: fork the leader, wait for its end; its record read after."""
    write_end = tail.open_pipe()
    job = dataclasses.replace(job, setup=dataclasses.replace(job.setup,
                                                             tree=owner.ticket(forked=True)))
    flush_output()  # buffered text would be written twice
    try:
        leader = owner.start("fork", lead, (spec, job, write_end), name="xlaunch-leader")
    finally:
        os.close(write_end)
    owner.wait([leader], None)
    owner.exitcode(leader)
    return leader


def lead(spec: XlaSpec, job: replica.ReplicaJob, stderr_fd: int) -> None:
    """The leader's whole life: set up, spawn the replicas, say what failed before they ran."""
    folder = LaunchDir(job.setup.launch_dir).attempt_path(job.attempt)
    try:
        process_tree.join(job.setup.tree)
        os.dup2(stderr_fd, 2)
        os.close(stderr_fd)
        faulthandler.enable(file=2, all_threads=False)
        for number in (signal.SIGINT, signal.SIGTERM):
            signal.signal(number, signal.SIG_DFL)
        die_with_parent()
        apply(job.setup.launch_env)  # what xmp.spawn reads where it is called among them
        # Its replicas: in its own tree already, with nothing of the caller's to let go of.
        job = dataclasses.replace(job, setup=dataclasses.replace(job.setup, tree=None))
        if spec.spmd_devices:  # SPMD on before anything here can start the runtime
            import torch_xla.runtime as xr

            xr.use_spmd()
            replica.replica(0, job)
        elif spec.nprocs == 1:
            import torch_xla.distributed.xla_multiprocessing as xmp

            replica.FORKED_JOB = job
            xmp.spawn(replica.replica, nprocs=1, start_method=spec.start_method)
        else:
            pool.spawn_pool(job, spec.start_method)
    except SystemExit:
        raise  # a replica's failure in this process, already in its own record
    except BaseException as error:  # the caller reports it
        record = ProcessFailure.from_exception(error, rank=0, exitcode=1)
        atomic_write(folder / LEADER_FAILURE, record.to_json())
        raise SystemExit(1) from None
    finally:
        flush_output()


def read_failure(folder: Path) -> ProcessFailure | None:
    """What the leader recorded as failing before any replica ran, if anything."""
    try:
        return ProcessFailure.from_json((folder / LEADER_FAILURE).read_text())
    except (OSError, ValueError, TypeError):
        return None
