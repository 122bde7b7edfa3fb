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
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from xlaunch.names import STORE_DIR_VAR
from xlaunch.plan.options import DEFAULT_MASTER_ADDR
from xlaunch.plan.specs import ElasticSpec
from xlaunch.worker.launch_dir import GROUP_STORE
from xlaunch.worker.rank import Worker, WorkerSetup, by_value, native_stdout_to_stderr

STORE_TIMEOUT_S = 300.0  # forming the group through another node's store


@dataclass(frozen=True)
class World:
    """Where this node's workers sit in the job: decided by the launch before any starts."""

    rank_offset: int  # global rank of this node's local rank 0
    world_size: int
    local_world_size: int
    node_rank: int = 0
    num_nodes: int = 1
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: int = 0
    # One machine: the group meets through a file in the attempt's folder; several: through the
    # rendezvous's store (a TCPStore at master_addr:master_port), under this prefix.
    store_prefix: str | None = None


def run_worker(local_rank: int, job: Job) -> None:
    """The target of every worker process: the job, for this local rank."""
    job(local_rank)


class Job:
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
        os.environ.update(self.rank_variables(local_rank))
        worker = Worker(self.setup, self.attempt, rank, local_rank, world.world_size)
        if worker.cancelled:
            raise SystemExit(0)  # its record says it ran nothing
        try:
            self._prepare_torch(local_rank)
            self._form_group(worker.attempt, rank)
            function, args = self._work()
        except Exception as error:  # reported as this rank's failure
            worker.record_failure(error)
            raise SystemExit(1) from None
        worker.run(function, args, measure=self._measure(), send=local_rank == 0)
        # A forked worker ends in os._exit, which frees everything; gloo's own teardown cost
        # 20-80 ms a rank. Workers that end in a full interpreter shutdown tear down first.
        if self.spec.dist_backend == "nccl" or self.spec.start_method != "fork":
            _destroy_groups()

    def rank_variables(self, local_rank: int) -> dict[str, str]:
        """What torchrun sets in each worker, so a library that reads them (Lightning's
        TorchElasticEnvironment, accelerate, transformers) finds the same world."""
        world = self.world
        values = {"RANK": world.rank_offset + local_rank, "LOCAL_RANK": local_rank,
                  "WORLD_SIZE": world.world_size, "LOCAL_WORLD_SIZE": world.local_world_size,
                  "GROUP_RANK": world.node_rank, "GROUP_WORLD_SIZE": world.num_nodes,
                  "ROLE_RANK": world.rank_offset + local_rank, "ROLE_NAME": "default",
                  "ROLE_WORLD_SIZE": world.world_size, "MASTER_ADDR": world.master_addr,
                  "MASTER_PORT": world.master_port, "TORCHELASTIC_RUN_ID": self.run_id,
                  "TORCHELASTIC_RESTART_COUNT": self.attempt,
                  "TORCHELASTIC_MAX_RESTARTS": self.spec.max_restarts,
                  "TORCHELASTIC_USE_AGENT_STORE": False}
        return {name: str(value) for name, value in values.items()}

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

    def _form_group(self, attempt: Path, rank: int) -> None:
        import torch.distributed as dist

        world = self.world
        if world.store_prefix is None:
            os.environ[STORE_DIR_VAR] = str(attempt)  # a script's own group meets here too
            store: Any = dist.FileStore(str(attempt / GROUP_STORE), world.world_size)
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
