"""What each GPU/CPU worker runs: join the launch, form the process group, call the function."""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from xlaunch import _compat
from xlaunch.names import CANCELLED_EXIT, STORE_DIR_VAR
from xlaunch.plan.specs import ElasticSpec
from xlaunch.worker.rank import Worker, WorkerSetup, by_value


def worker_main(job: Job) -> Any:
    """The engine's entrypoint: a named module-level function, as it expects."""
    return job()


class Job:
    """The function each worker process runs (a plain object, so ``spawn`` can pickle it).

    Under ``spawn`` the function and its arguments travel by value (cloudpickle), and are
    unpickled only once the worker is set up, so that what their unpickling imports sees the
    rank's variables, and a failure to unpickle is that rank's recorded failure.
    """

    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...], setup: WorkerSetup,
                 spec: ElasticSpec) -> None:
        self.function: Callable[..., Any] | None = function
        self.args: tuple[Any, ...] = args
        self.setup = setup
        self.spec = spec
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

    def __call__(self) -> Any:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        worker = Worker(self.setup, attempt, rank, local_rank, world)
        if worker.cancelled:
            raise SystemExit(CANCELLED_EXIT)
        self._prepare_torch(local_rank)
        try:
            self._form_group(worker.attempt, rank, world)
        except Exception as error:  # reported as this rank's failure
            worker.record_failure(error)
            raise SystemExit(1) from None
        try:
            function, args = self._work()
        except Exception as error:  # reported as this rank's failure
            worker.record_failure(error)
            raise SystemExit(1) from None
        try:
            result = worker.run(function, args, measure=self._measure())
            value = worker.returnable(result) if local_rank == 0 else None
        finally:
            # A forked worker ends in os._exit, which frees everything; gloo's own teardown cost
            # 20-80 ms a rank. Workers that end in a full interpreter shutdown tear down first.
            if self.spec.dist_backend == "nccl" or self.spec.start_method != "fork":
                _destroy_groups()
        if world > 1:
            leave(value)
        return value

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

    def _form_group(self, attempt: Path, rank: int, world: int) -> None:
        import torch.distributed as dist

        if self.spec.loopback_only:
            os.environ[STORE_DIR_VAR] = str(attempt)  # a script's own group meets here too
            store = dist.FileStore(str(attempt / "group-store"), world)
            dist.init_process_group(self.spec.dist_backend, store=store, rank=rank,
                                    world_size=world)
        else:
            dist.init_process_group(self.spec.dist_backend, rank=rank, world_size=world)
        # Gloo finishes connecting pairs lazily: a rank that returned at once and exited would
        # break a peer still connecting. Everyone starts the function together.
        dist.barrier()


def leave(value: Any) -> None:
    """A finished worker hands its value to the engine and ends its process at once.

    The engine would keep the process, and with it every socket of its process group, alive until
    all workers finish: a peer still waiting on this rank in a collective would wait until the
    group's timeout (30 minutes). Ending here closes those sockets, as the end of a script does
    under torchrun, and the peer's collective fails within moments ("Connection closed by peer").
    A peer that waits on nothing from this rank is not affected.
    """
    queue = _compat.elastic_return_queue()
    if queue is None:  # the engine changed: at least close the group's sockets
        _destroy_groups()
        return
    # Plain bytes: torch's queue would share a tensor's storage through this process, which is
    # about to end.
    queue.put(None if value is None else Returned(pickle.dumps(value)))
    _compat.end_like_a_process(0)


class Returned:
    """A worker's return value as plain pickled bytes, for a caller that outlives the worker."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def load(self) -> Any:
        return pickle.loads(self.data)


def _destroy_groups() -> None:
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        dist.destroy_process_group()
