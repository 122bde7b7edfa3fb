"""What runs in the launch leader, a process forked from the caller (never in the caller
itself): it owns torch_xla's process pool.

- ``xmp.spawn(nprocs=1)`` runs the function in the calling process and leaves the runtime
  initialised there, after which every later spawn in that process refuses. In the leader that
  state dies with the leader, so the next launch in the same notebook works.
- ``xmp.spawn`` returns None, and its pool reports a dead replica only as "terminated abruptly".
  Replica 0 leaves its result in the launch directory; the leader records each pool process's
  exit status and the signals it or the pool sent, so the caller can judge who failed first.
- The leader never returns into the caller's code: it ends in ``os._exit``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import json
import os
import signal
from pathlib import Path
from typing import Any, NoReturn

from xlaunch import _compat
from xlaunch.backends.supervise import stop_processes
from xlaunch.backends.xla import replica
from xlaunch.plan.specs import XlaSpec
from xlaunch.result.errors import ProcessFailure
from xlaunch.worker import process_tree
from xlaunch.worker.launch_dir import LaunchDir, atomic_write
from xlaunch.worker.rank import die_with_parent, flush_output

EXITS_FILE = "exits.json"
LEADER_FILE = "leader.json"
REAP_S = 1.0

_POOL: list[_compat.Child] = []  # xmp.spawn's pool, each process recorded as it starts
_ATTEMPT: Path | None = None
_GRACE = 3.0


def lead(spec: XlaSpec, job: replica.Job, stderr_fd: int) -> NoReturn:
    """The leader's whole life: set up, spawn the replicas, record how each ended, exit."""
    global _ATTEMPT, _POOL
    _ATTEMPT = attempt = LaunchDir(job.setup.launch_dir).attempt_dir(job.attempt)
    code = 1
    try:
        process_tree.join(job.setup.tree)
        os.dup2(stderr_fd, 2)
        os.close(stderr_fd)
        faulthandler.enable(file=2, all_threads=False)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, _stop_pool if spec.nprocs is None else signal.SIG_DFL)
        global _GRACE
        _GRACE = job.stop_grace
        replica.ARMED.set()  # each pool process gets its stop handler as it is forked
        die_with_parent()
        _prepare_environment(spec)
        with _compat.recording_children() as pool:
            _POOL = pool
            code = _spawn(spec, job)
    except BaseException as error:  # the caller reports it
        if type(error).__name__ != "BrokenProcessPool":  # the exit statuses say more
            record = ProcessFailure.from_exception(error, rank=0, exitcode=1)
            atomic_write(attempt / LEADER_FILE, record.to_json())
    finally:
        _end_pool()
        flush_output()
        os._exit(code)


def _prepare_environment(spec: XlaSpec) -> None:
    for name in spec.unset_env:
        os.environ.pop(name, None)
    if spec.pjrt_device is not None:
        os.environ.setdefault("PJRT_DEVICE", spec.pjrt_device)


def _spawn(spec: XlaSpec, job: replica.Job) -> int:
    import torch_xla.distributed.xla_multiprocessing as xmp

    # The replicas start in the leader's group, with nothing of the caller's to let go of.
    job = dataclasses.replace(job, setup=dataclasses.replace(job.setup, tree=None))
    replica.FORKED_JOB = job
    args = () if spec.start_method == "fork" else (job,)
    try:
        xmp.spawn(replica.replica, args=args, nprocs=spec.nprocs, start_method=spec.start_method)
    except SystemExit as stop:  # a replica's failure, already recorded by its Worker
        return stop.code if isinstance(stop.code, int) else 1
    return 0


def _end_pool() -> None:
    """Kill what is left of the pool (noted as ours), reap it, record how each process ended."""
    pool = list(_POOL)
    _compat.kill_and_reap(pool, REAP_S)
    exits = [{"pid": c.pid, "exitcode": c.exitcode, "signals_sent": sorted(c.signals_sent)}
             for c in pool if c.pid is not None]
    if _ATTEMPT is not None:
        with contextlib.suppress(Exception):
            atomic_write(_ATTEMPT / EXITS_FILE, json.dumps(exits))


def _stop_pool(signum: int, frame: Any) -> None:
    """The leader's SIGTERM (the caller stopping the launch): stop the pool (SIGTERM, the grace,
    SIGKILL), then end the leader."""
    stop_processes(_POOL, None, _GRACE)
    _end_pool()
    flush_output()
    os._exit(128 + signum)


def read_exits(attempt: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads((attempt / EXITS_FILE).read_text())
    except (OSError, ValueError):
        return []
    return data if isinstance(data, list) else []


def read_leader_failure(attempt: Path) -> ProcessFailure | None:
    try:
        return ProcessFailure.from_json((attempt / LEADER_FILE).read_text())
    except (OSError, ValueError, TypeError):
        return None
