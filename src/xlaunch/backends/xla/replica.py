"""What each XLA replica runs: torch_xla calls `replica` with its global ordinal.

Work that belongs to the process rather than the replica (v2/v3 chips run two replicas as two
threads of one process) is done once per process: taking over stderr for the launch's tail, and
setting up the persistent compilation cache before anything touches the device.
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import os
import pickle
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from xlaunch import _compat, stopping
from xlaunch.backends.environment import apply, worker_environment
from xlaunch.backends.xla.metrics import collect
from xlaunch.worker import process_tree
from xlaunch.worker.launch_dir import CRASH, LaunchDir, Mark, note
from xlaunch.worker.private import private_file
from xlaunch.worker.rank import Worker, WorkerSetup, by_value


@dataclass(frozen=True)
class ReplicaJob:
    """What every replica runs (plain data, so ``spawn`` can pickle it)."""

    function: Callable[..., Any]
    args: tuple[Any, ...]
    setup: WorkerSetup
    attempt: int = 0
    stderr_fd: int | None = None  # the launch's stderr pipe, inherited by forked replicas
    compile_cache: str | None = None  # torch_xla's persistent cache, one folder per process
    replicas_per_process: int = 1  # 2 on v2/v3 chips: replicas that are threads of one process

    def __getstate__(self) -> dict[str, Any]:
        # Under spawn the function and its arguments travel by value (cloudpickle), so functions
        # defined in a notebook cell reach the replicas.
        state = dict(self.__dict__)
        state.update(function=None, args=(), payload=by_value((self.function, self.args)))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        function, args = pickle.loads(state.pop("payload"))
        self.__dict__.update(state, function=function, args=args)


# The job, for replicas forked from the caller: xmp.spawn's pool pickles what it is given even
# under fork, and a closure, a lambda or an argument such as a lock cannot be pickled.
FORKED_JOB: ReplicaJob | None = None
_PROCESS_READY = threading.Lock()
_CRASH_FILE: Any = None
_COPYING = threading.Lock()
_process_done = False


def replica(index: int, job: ReplicaJob | None = None) -> None:
    """One replica, in a thread of its process."""
    job = job or FORKED_JOB
    assert job is not None
    _prepare_process(job)
    world_size, local_ordinal = world()
    worker = Worker(job.setup, job.attempt, index, local_ordinal, world_size)
    function, args = replica_inputs(job)
    with _spmd_refused():  # each host of a pod returns its own first replica's result
        worker.run(function, args, measure=collect, send=local_ordinal == 0)


SPMD_IN_A_REPLICA = (
    "torch_xla.runtime.use_spmd() inside a launched function: this launch runs one replica per "
    "device and the XLA runtime is already up in it, where use_spmd() would crash the process "
    "(SIGSEGV). Launch with notebook_launcher(..., spmd=True) (xlaunch run --spmd): one process "
    "then drives every device, with SPMD switched on before the runtime starts")


@contextlib.contextmanager
def _spmd_refused() -> Any:
    """In a replica of a launch without SPMD, ``use_spmd()`` raises, naming ``spmd=True``, instead
    of crashing the process: the launched function calls torch_xla's public function, which
    this one replica process stands in for while the function runs (as `worker.script` stands
    in for ``xmp.spawn`` in a script)."""
    import torch_xla.runtime as xr

    if xr.is_spmd():  # an SPMD launch: calling it again is harmless
        yield
        return

    def use_spmd(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError(SPMD_IN_A_REPLICA)

    with _compat.standing_in(xr, "use_spmd", use_spmd):
        yield


def replica_inputs(job: ReplicaJob) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """The function and arguments this replica runs: its own deep copy where replicas share a
    process, as Lightning's XLA launcher does.

    Two replicas that are threads of one process would otherwise receive the same objects: a model
    passed in ``args`` and moved with ``.to(device)`` in each would move under the other's feet
    (on two CPU devices the process aborted in 3 of 5 launches; with a copy each, 5 of 5 worked).
    One replica per process keeps the objects it was given, at no cost.
    """
    if job.replicas_per_process <= 1:
        return job.function, job.args
    with _COPYING:  # one copy at a time: the originals are read, never written, meanwhile
        return copy.deepcopy((job.function, job.args))


@dataclass(frozen=True)
class Arming:
    """A launch whose pool is being forked: by which thread, and what each process gets."""

    thread: int  # the launch thread's ident (a fork elsewhere in the caller is not ours)
    job: ReplicaJob


def prepare_forked_process() -> None:
    """In each process ``xmp.spawn`` forks for the launch, first of all: it says it began (so the
    owner knows it even if it dies at once), joins the launch's tree, takes the variables only
    the replicas need, and gets its stop handler in its main thread (replicas are threads, where
    ``signal.signal`` raises; their `on_stop` callbacks run from there), which records that a
    SIGTERM reached it."""
    arming = ARMED
    if arming is None or threading.get_ident() != arming.thread:
        return
    begin_process(arming.job)
    stopping.reset()
    with contextlib.suppress(ValueError):
        stopping.install_handler(note=_terminated(arming.job))


def begin_process(job: ReplicaJob) -> None:
    """Once per replica process: its record that it began, the tree, its environment (before
    torch_xla's runtime starts in it, which reads some of it)."""
    folder = LaunchDir(job.setup.launch_dir).attempt_path(job.attempt)
    note(folder, Mark.BEGAN, os.getpid())
    process_tree.join(job.setup.tree)
    apply(worker_environment(job.setup.launch_env, attempt=job.attempt, pid=os.getpid(),
                             xla=True))


def _terminated(job: ReplicaJob) -> Callable[[int], None]:
    folder = LaunchDir(job.setup.launch_dir).attempt_path(job.attempt)
    return lambda signum: note(folder, Mark.TERMINATED, os.getpid())


ARMED: Arming | None = None
os.register_at_fork(after_in_child=prepare_forked_process)


def _prepare_process(job: ReplicaJob) -> None:
    global _process_done
    with _PROCESS_READY:
        if _process_done:
            return
        _process_done = True
        if ARMED is None:  # spawned (or the leader's own): no at-fork hook ran for it
            begin_process(job)
        if job.stderr_fd is not None:
            os.dup2(job.stderr_fd, 2)
            with contextlib.suppress(OSError):
                os.close(job.stderr_fd)
        # A crash (SIGSEGV, SIGABRT...) leaves its Python stack in a file of its process: its
        # status goes to torch_xla's pool, so this is how the launch learns which signal it was.
        global _CRASH_FILE
        folder = LaunchDir(job.setup.launch_dir).attempt_path(job.attempt)
        _CRASH_FILE = open(private_file(folder / CRASH.format(os.getpid())), "w")
        faulthandler.enable(file=_CRASH_FILE, all_threads=False)
        if job.compile_cache is not None:
            process = os.environ.get("PJRT_LOCAL_PROCESS_RANK", "0")
            import torch_xla.runtime as xr

            # Several processes writing one cache race (torch_xla's own tests give each process
            # its folder); set up before the first compilation, which would fix the cache.
            cache = os.path.expanduser(job.compile_cache)
            xr.initialize_cache(os.path.join(cache, f"process-{process}"))


def world() -> tuple[int, int]:
    """World size and this replica's ordinal on its host."""
    import torch_xla.runtime as xr

    return int(xr.world_size()), int(xr.local_ordinal())
