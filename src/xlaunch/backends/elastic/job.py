"""What each GPU/CPU (and TorchTPU) worker runs: take its place, form the group, call the function.

The worker is started by the launch's owner (`backends.processes`) with `run_worker` as its
target, a module-level function importable without torch: under ``spawn`` every variable a rank
needs (its rank, torchrun's names for it, TorchTPU's launch variables) is set before the first
``import torch`` in it, which TorchTPU's loader requires.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from xlaunch.backends.environment import World, apply, rank_layer, worker_environment
from xlaunch.plan.specs import ElasticSpec
from xlaunch.worker.launch_dir import GROUP_STORE, LaunchDir
from xlaunch.worker.rank import Worker, WorkerSetup, by_value, native_stdout_to_stderr

STORE_TIMEOUT_S = 300.0  # forming the group through another node's store


def run_worker(local_rank: int, job: DistJob) -> None:
    """The target of every worker process: the job, for this local rank."""
    job(local_rank)


class DistJob:
    """The function each worker process runs (a plain object, so ``spawn`` can pickle it).

    Under ``spawn`` the function and its arguments travel by value (cloudpickle), and are
    unpickled only once the worker is set up, so that what their unpickling imports sees the
    rank's variables, and a failure to unpickle is that rank's recorded failure.
    """

    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...], setup: WorkerSetup,
                 spec: ElasticSpec, world: World, attempt: int = 0, run_id: str = "none") -> None:
        self.function: Callable[..., Any] | None = function
        self.args: tuple[Any, ...] = args
        self.setup, self.spec, self.world = setup, spec, world
        self.attempt, self.run_id = attempt, run_id
        self._payload: bytes | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state.update(function=None, args=(), _payload=by_value((self.function, self.args)))
        return state

    def _work(self) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        if self._payload is not None:
            self.function, self.args = pickle.loads(self._payload)
            self._payload = None
        assert self.function is not None
        return self.function, self.args

    def __call__(self, local_rank: int) -> None:
        world = self.world
        rank = world.rank_offset + local_rank
        folder = LaunchDir(self.setup.launch_dir).attempt_path(self.attempt)
        apply(worker_environment(
            self.setup.launch_env,
            rank_layer(world, local_rank, self.attempt, self.run_id, self.spec.max_restarts,
                       str(folder) if world.store_prefix is None else None),
            attempt=self.attempt, pid=os.getpid()))
        worker = Worker(self.setup, self.attempt, rank, local_rank, world.world_size)
        if worker.cancelled:
            raise SystemExit(0)  # its record says it ran nothing
        try:
            self._prepare_torch(local_rank)
            self._form_group(worker.folder, rank)
            function, args = self._work()
        except Exception as error:  # reported as this rank's failure
            worker.record_failure(error)
            raise SystemExit(1) from None
        worker.run(function, args, measure=self._measure(), send=local_rank == 0)
        # A forked worker ends in os._exit, which frees everything; gloo's own teardown cost
        # 20-80 ms a rank. Workers that end in a full interpreter shutdown tear down first.
        if self.spec.dist_backend == "nccl" or self.spec.start_method != "fork":
            _destroy_groups()

    def _measure(self) -> Callable[[], Mapping[str, Any]] | None:
        """What the rank adds to its report (a path's own counters); None: wall time and memory."""
        return None

    def _prepare_torch(self, local_rank: int) -> None:
        spec = self.spec
        if spec.cpu_threads or spec.dist_backend == "nccl":
            import torch

            if spec.cpu_threads:
                torch.set_num_threads(spec.cpu_threads)  # forked: the variable alone comes too late
            if spec.dist_backend == "nccl":
                torch.cuda.set_device(local_rank)

    def _form_group(self, folder: Path, rank: int) -> None:
        import torch.distributed as dist

        world = self.world
        if world.store_prefix is None:
            store: Any = dist.FileStore(str(folder / GROUP_STORE), world.world_size)
        else:
            tcp = dist.TCPStore(world.master_addr, world.master_port, None, False,
                                timedelta(seconds=STORE_TIMEOUT_S))
            store = dist.PrefixStore(f"{world.store_prefix}/attempt_{self.attempt}", tcp)
        with native_stdout_to_stderr():  # gloo on torch 2.8 prints "[Gloo] Rank 0 is connected..."
            dist.init_process_group(self.spec.dist_backend, store=store, rank=rank,
                                    world_size=world.world_size)
        # Gloo finishes connecting pairs lazily: a rank that returned at once and exited would
        # break a peer still connecting. Everyone starts the function together.
        dist.barrier()


def _destroy_groups() -> None:
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        dist.destroy_process_group()
