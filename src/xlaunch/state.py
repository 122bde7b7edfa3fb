"""ProcessState: what this process's place in the launched world is, read from the world itself.

Nothing is cached. A `ProcessState` made in a notebook before a launch is copied into forked
workers; had it stored its rank it would report rank 0 of 1 in every worker, every rank would think
it is the main process and decorated functions would run everywhere. Reading the world at each
access (a few environment and ``sys.modules`` look-ups) keeps one object valid on both sides of a
fork, and lets decorators applied before the launch decide in the worker, at call time.

The XLA queries initialise the XLA runtime, after which ``xmp.spawn`` refuses to run in that
process. They are therefore made only inside an XLA world: a replica's process the launcher marked
(``XLAUNCH_WORLD=xla:<its pid>``), or a process whose runtime is already initialised (a user's own
spawn).
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, ParamSpec, TypeVar

from xlaunch import _compat
from xlaunch.names import DEVICE_VAR, MIXED_PRECISION_VAR, RESTART_VAR, WORLD_VAR
from xlaunch.sharing import share_of

P = ParamSpec("P")
R = TypeVar("R")
F = TypeVar("F", bound=Callable[[], Any])

_RENDEZVOUS_TAG = "xlaunch.wait_for_everyone"


class _World(NamedTuple):
    kind: str  # "xla", "distributed", "environment" (torchrun without a group) or "single"
    # backend: "xla", "nccl", "gloo", "tpu_dist" (TorchTPU) or None
    rank: int
    size: int
    local_rank: int
    backend: str | None


def in_xla_replica() -> bool:
    """This process is an XLA replica's, as the launcher marked it (a value preset in the caller,
    or inherited by a process a replica starts, names another pid and is ignored)."""
    return os.environ.get(WORLD_VAR) == f"xla:{os.getpid()}"


def _in_xla_world() -> bool:
    return in_xla_replica() or _compat.xla_runtime_is_initialized()


def _spmd_on() -> bool:
    """torch_xla's SPMD switch (``use_spmd()`` sets it); never imports torch_xla."""
    runtime = sys.modules.get("torch_xla.runtime")
    return bool(runtime is not None and runtime.is_spmd())


def _xla_world() -> _World:
    """The replica's place, from torch_xla.runtime (the floor, torch_xla 2.8, has it all)."""
    import torch_xla.runtime as xr

    return _World("xla", xr.global_ordinal(), xr.world_size(), xr.local_ordinal(), "xla")


def _process_group() -> Any:
    """torch.distributed when this process is in an initialised group; never imports torch."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist
    return None


def _current_world() -> _World:
    if _in_xla_world():
        return _xla_world()
    dist = _process_group()
    if dist is not None:
        rank = dist.get_rank()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        name = str(dist.get_backend())  # "cpu:gloo,cuda:nccl" counts as nccl, its GPU side
        backend = next((known for known in ("nccl", "gloo") if known in name), name)
        return _World("distributed", rank, dist.get_world_size(), local_rank, backend)
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1 and "RANK" in os.environ:
        rank = int(os.environ["RANK"])
        return _World("environment", rank, size, int(os.environ.get("LOCAL_RANK", rank)), None)
    return _World("single", 0, 1, 0, None)


class ProcessState:
    """This process's rank, world, device and precision, plus helpers that depend on them.

    Cheap to create anywhere and holds nothing: every answer is read when asked.
    """

    def __repr__(self) -> str:
        world = _current_world()
        return (f"ProcessState(process_index={world.rank}, num_processes={world.size}, "
                f"local_process_index={world.local_rank}, backend={world.backend!r})")

    @property
    def process_index(self) -> int:
        return _current_world().rank

    @property
    def local_process_index(self) -> int:
        return _current_world().local_rank

    @property
    def num_processes(self) -> int:
        return _current_world().size

    @property
    def is_main_process(self) -> bool:
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        world = _current_world()
        return world.rank == world.size - 1

    @property
    def backend(self) -> str | None:
        return _current_world().backend

    @property
    def device(self) -> Any:
        """A ``torch.device``: on XLA the replica's own device; in a launch, the launch's
        accelerator (a CPU launch is on the CPU, GPUs or not); elsewhere a guess from the world."""
        world = _current_world()
        if world.kind == "xla":
            import torch_xla

            return torch_xla.device()
        launched = os.environ.get(DEVICE_VAR)
        if world.backend == "tpu_dist" or launched == "tpu":
            return _tpu_device()
        import torch

        if launched == "cpu" or (launched is None and world.backend == "gloo"):
            return torch.device("cpu")
        if launched == "cuda" or world.backend == "nccl" or (
                world.kind != "single" and torch.cuda.is_available()):
            return torch.device("cuda", world.local_rank)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    @property
    def is_spmd(self) -> bool:
        """This process drives every device of its host through torch_xla's SPMD."""
        return _in_xla_world() and _spmd_on()

    @property
    def num_devices(self) -> int:
        """The devices this process drives: every device of the host under SPMD, else 1."""
        if not self.is_spmd:
            return 1
        import torch_xla.runtime as xr

        return int(xr.global_runtime_device_count()) // max(1, _current_world().size)

    def mesh(self, axis_names: tuple[str, ...] = ("data",),
             shape: tuple[int, ...] | None = None) -> Any:
        """A ``torch_xla.distributed.spmd.Mesh`` over every device (SPMD launches only); with
        ``shape`` None, every device on the first axis and 1 on the others."""
        if not self.is_spmd:
            raise RuntimeError("ProcessState().mesh() is for SPMD launches: launch with "
                               "notebook_launcher(..., spmd=True)")
        import numpy as np
        import torch_xla.runtime as xr
        from torch_xla.distributed.spmd import Mesh

        devices = int(xr.global_runtime_device_count())
        if shape is None:
            shape = (devices, *(1 for _ in axis_names[1:]))
        return Mesh(np.arange(devices), tuple(shape), tuple(axis_names))

    @property
    def restart_count(self) -> int:
        """0 on the first attempt, then 1, 2, ... after each restart (``max_restarts``)."""
        value = os.environ.get(RESTART_VAR) or os.environ.get("TORCHELASTIC_RESTART_COUNT") or "0"
        return int(value)

    @property
    def mixed_precision(self) -> str:
        return os.environ.get(MIXED_PRECISION_VAR, "no").strip().lower() or "no"

    def wait_for_everyone(self) -> None:
        """Block until every process reaches this call; every process must make it."""
        # The hot path of a training loop: ask only what the barrier needs.
        if _in_xla_world():
            if _spmd_on() and _current_world().size == 1:
                return  # one SPMD process drives every device: nobody to wait for
            import torch_xla.core.xla_model as xm

            xm.rendezvous(_RENDEZVOUS_TAG)
            return
        dist = _process_group()
        if dist is not None:
            if "nccl" in str(dist.get_backend()):
                dist.barrier(device_ids=[int(os.environ.get("LOCAL_RANK", dist.get_rank()))])
            else:
                dist.barrier()
            return
        world = _current_world()
        if world.kind == "environment":
            # Returning would let a rank save a model its peers are still training.
            raise RuntimeError(
                f"wait_for_everyone() in process {world.rank} of {world.size}: this process was "
                "started by a launcher (RANK/WORLD_SIZE are set) but no process group exists. "
                "Call torch.distributed.init_process_group() first, or start it with xlaunch."
            )

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """The main process runs the block alone (a download, a cache), then the others run it."""
        with self._leader_first(self.is_main_process):
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """As `main_process_first`, with each machine's local main process as the leader."""
        with self._leader_first(self.is_local_main_process):
            yield

    @contextlib.contextmanager
    def _leader_first(self, leading: bool) -> Iterator[None]:
        # No try/finally: if the leader's block fails, followers must not go on as if the download
        # or cache it was making exists. They wait until the launcher stops them.
        if not leading:
            self.wait_for_everyone()
        yield
        if leading:
            self.wait_for_everyone()

    def _only_where(self, should_run: Callable[[], bool],
                    function: Callable[P, R]) -> Callable[P, R | None]:
        @functools.wraps(function)
        def run_here_or_skip(*args: P.args, **kwargs: P.kwargs) -> R | None:
            return function(*args, **kwargs) if should_run() else None

        return run_here_or_skip

    def on_main_process(self, function: Callable[P, R]) -> Callable[P, R | None]:
        return self._only_where(lambda: self.is_main_process, function)

    def on_local_main_process(self, function: Callable[P, R]) -> Callable[P, R | None]:
        return self._only_where(lambda: self.is_local_main_process, function)

    def on_last_process(self, function: Callable[P, R]) -> Callable[P, R | None]:
        return self._only_where(lambda: self.is_last_process, function)

    def on_process(self, function: Callable[..., Any] | None = None,
                   process_index: int = 0) -> Any:
        """``@state.on_process(process_index=1)``; bare ``@state.on_process`` means process 0."""
        _check_decorated(function, "on_process(process_index=...)")
        if function is None:
            return functools.partial(self.on_process, process_index=process_index)
        return self._only_where(lambda: self.process_index == process_index, function)

    def on_local_process(self, function: Callable[..., Any] | None = None,
                         local_process_index: int = 0, *,
                         local_process_idx: int | None = None) -> Any:
        """``local_process_idx`` is the spelling accelerate's tutorials use; both are accepted."""
        _check_decorated(function, "on_local_process(local_process_index=...)")
        if local_process_idx is not None:
            if local_process_index not in (0, local_process_idx):
                raise TypeError("on_local_process: give local_process_index or "
                                "local_process_idx, not two different values")
            local_process_index = local_process_idx
        if function is None:
            return functools.partial(self.on_local_process,
                                     local_process_index=local_process_index)
        return self._only_where(lambda: self.local_process_index == local_process_index,
                                function)

    @contextlib.contextmanager
    def split_between_processes(self, inputs: Any, apply_padding: bool = False) -> Iterator[Any]:
        """Yield this rank's contiguous share; shares differ in length by at most one.

        With ``apply_padding`` every share has the longest share's length, the short ones
        repeating their last item, so that tensors gathered from all ranks have equal shapes.
        """
        world = _current_world()
        yield share_of(inputs, world.rank, world.size, apply_padding)

    def on_stop(self, callback: F) -> F:
        """Run ``callback()`` if the launcher stops this worker (the timeout, the stop button, a
        failed peer, a restart), to save a checkpoint: it has the launch's ``stop_grace`` seconds
        before SIGKILL. Works in XLA replicas too, where ``signal.signal`` cannot be called.
        Usable as a decorator; call it inside the launched function."""
        from xlaunch import stopping

        return stopping.on_stop(callback)

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on the main process only, so a message appears once, not once per rank."""
        if self.is_main_process:
            builtins.print(*args, **kwargs)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The context that applies the launch's ``mixed_precision`` on this process's device."""
        precision = self.mixed_precision
        if precision == "no":
            return contextlib.nullcontext()
        if precision not in ("fp16", "bf16"):
            raise ValueError(f"mixed_precision {precision!r}: expected 'no', 'fp16' or 'bf16'")
        import torch

        device_type = self.device.type
        if device_type == "xla" and precision == "fp16":
            raise ValueError("mixed_precision 'fp16' is not supported on XLA devices; use 'bf16'")
        if precision == "fp16" and (device_type == "tpu" or self.backend == "tpu_dist"):
            raise ValueError("mixed_precision 'fp16' is not supported on TPU devices; use 'bf16'")
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
        return torch.autocast(device_type=device_type, dtype=dtype)


def _tpu_device() -> Any:
    """TorchTPU's device for this process: one per process, its index as torch.accelerator says."""
    import torch

    return torch.device("tpu", torch.accelerator.current_device_index())


def _check_decorated(function: Any, spelling: str) -> None:
    if function is not None and not callable(function):
        raise TypeError(f"pass the index by keyword, as in {spelling}; got {function!r}")


def wait_for_everyone() -> None:
    ProcessState().wait_for_everyone()


def on_main_process(function: Callable[P, R]) -> Callable[P, R | None]:
    return ProcessState().on_main_process(function)


def on_local_main_process(function: Callable[P, R]) -> Callable[P, R | None]:
    return ProcessState().on_local_main_process(function)


def on_last_process(function: Callable[P, R]) -> Callable[P, R | None]:
    return ProcessState().on_last_process(function)


def on_process(function: Callable[..., Any] | None = None, process_index: int = 0) -> Any:
    return ProcessState().on_process(function, process_index=process_index)


def on_local_process(function: Callable[..., Any] | None = None, local_process_index: int = 0,
                     *, local_process_idx: int | None = None) -> Any:
    return ProcessState().on_local_process(function, local_process_index=local_process_index,
                                           local_process_idx=local_process_idx)


def on_stop(callback: F) -> F:
    return ProcessState().on_stop(callback)


def main_process_first() -> contextlib.AbstractContextManager[None]:
    return ProcessState().main_process_first()
