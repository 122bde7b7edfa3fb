"""What ``xlaunch check`` runs in every rank: the steps, each timed, each failing by name.

`run_checks` is a module-level function, so ``--start-method spawn`` can pickle it; torch and
torch_xla are imported inside functions, so the command-line parser stays cheap. A step that goes
wrong raises `CheckFailed` naming the step; the launch's `LaunchError` then leads with the rank
where it went wrong first, and the command reads the step back from it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

STEPS = ("ranks", "all-reduce", "barrier", "training")
WARMUP_STEPS = 2  # a training loop compiles its graphs here; the steps after must compile none


class CheckFailed(RuntimeError):
    """A check step went wrong; the message starts with the step's name and a colon."""


@dataclass(frozen=True)
class CheckConfig:
    world_size: int  # what the plan says every rank must see
    train_steps: int = 6
    batch: int = 16
    features: int = 8
    grow_batch: int = 0  # rows added to the batch each step: 0 is the steady shape the check wants


def run_checks(config: CheckConfig) -> dict[str, Any]:
    """The launched function: each step on every rank; rank 0's timings and counts come back."""
    from xlaunch.state import ProcessState

    with _group_of_one(ProcessState()) as state:
        return _run_steps(config, state)


@contextmanager
def _group_of_one(state: Any) -> Iterator[Any]:
    """A one-process check forms a process group of one (gloo on the CPU, NCCL on a GPU), so its
    all-reduce and barrier run on the path's real collective; the group ends with the check (the
    one process is the caller's own)."""
    if state.backend is not None or state.num_processes != 1 or state.device.type not in (
            "cpu", "cuda"):
        yield state
        return
    import torch.distributed as dist

    from xlaunch.worker.rank import native_stdout_to_stderr

    with native_stdout_to_stderr():  # gloo on torch 2.8 prints a line: not in --json's output
        dist.init_process_group("nccl" if state.device.type == "cuda" else "gloo",
                                store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield state
    finally:
        dist.destroy_process_group()


def _run_steps(config: CheckConfig, state: Any) -> dict[str, Any]:
    timings: dict[str, float] = {}
    details: dict[str, str] = {}
    started = time.time()
    with _step("ranks", timings):
        rank, world = state.process_index, state.num_processes
        if world != config.world_size or not 0 <= rank < world:
            raise CheckFailed(f"this process sees rank {rank} of {world}; the launch planned "
                              f"{config.world_size} ranks")
        details["ranks"] = f"{world} rank(s) started, each knows its rank ({state.backend or 'one process'})"
    reduce = _reducer(state)
    with _step("all-reduce", timings):
        details["all-reduce"] = f"{_check_all_reduce(reduce, rank, world)} ({state.backend})"
    with _step("barrier", timings):
        state.wait_for_everyone()
        details["barrier"] = "every rank passed it"
    with _step("training", timings):
        training = _train(config, state, reduce)
        details["training"] = training.pop("detail")
    return {"rank": rank, "world_size": world, "started_at": started, "timings": timings,
            "details": details, "training": training, "returned_at": time.time()}


@contextmanager
def _step(name: str, timings: dict[str, float]) -> Iterator[None]:
    started = time.perf_counter()
    try:
        yield
    except CheckFailed as failed:
        raise CheckFailed(f"{name}: {failed}") from None
    except Exception as error:  # any failure inside a step is that step's
        raise CheckFailed(f"{name}: {type(error).__name__}: {error}") from error
    timings[name] = time.perf_counter() - started


def _reducer(state: Any) -> Callable[[Any], Any]:
    """A sum over every rank, on the path's own collective (XLA, a process group, or none)."""
    if state.backend == "xla":
        import torch_xla.core.xla_model as xm

        def xla_sum(tensor: Any) -> Any:
            return xm.all_reduce(xm.REDUCE_SUM, tensor.to(state.device)).cpu()

        return xla_sum
    import torch.distributed as dist

    def group_sum(tensor: Any) -> Any:
        tensor = tensor.to(state.device)
        dist.all_reduce(tensor)
        return tensor.cpu()

    return group_sum


def _check_all_reduce(reduce: Callable[[Any], Any], rank: int, world: int) -> str:
    """Each rank adds rank+1, and a one in its own slot: the sum and every slot must come out."""
    import torch

    values = torch.zeros(world + 1)
    values[rank] = 1.0
    values[world] = rank + 1.0
    total = reduce(values)
    expected = world * (world + 1) / 2
    seen = total[:world].tolist()
    if any(count != 1.0 for count in seen):
        raise CheckFailed(f"rank {rank} saw each rank this many times: {seen} (every rank once "
                          "was expected): two processes share a rank, or one is missing")
    if float(total[world]) != expected:
        raise CheckFailed(f"rank {rank} got the sum {float(total[world])}, expected {expected}")
    return f"sum {expected:g} on every rank"


def _train(config: CheckConfig, state: Any, reduce: Callable[[Any], Any]) -> dict[str, Any]:
    """A few SGD steps at one shape, gradients summed over ranks; graphs must stop compiling."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(config.features, 1).to(state.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(state.process_index)
    rows = config.batch + config.train_steps * config.grow_batch
    x = torch.randn(rows, config.features, generator=generator).to(state.device)
    y = torch.randn(rows, 1, generator=generator).to(state.device)
    compiled, count, what = _compiler(state, model)
    counts = [count()]
    for step in range(config.train_steps):
        rows = config.batch + step * config.grow_batch
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(compiled(x[:rows]), y[:rows]).backward()
        _average_gradients(state, model, optimizer, reduce)
        counts.append(count())
    warmup = counts[WARMUP_STEPS] - counts[0]
    steady = counts[-1] - counts[WARMUP_STEPS]
    steady_steps = config.train_steps - WARMUP_STEPS
    if warmup < 1:
        raise CheckFailed(f"{what} counted no compilation in the first {WARMUP_STEPS} steps")
    if steady:
        raise CheckFailed(f"rank {state.process_index}: {steady} {what} compilation(s) in the "
                          f"{steady_steps} steps after warm-up at an unchanged shape "
                          f"({warmup} in warm-up)")
    return {"compiler": what, "warmup_compiles": warmup, "steady_compiles": steady,
            "steps": config.train_steps,
            "detail": f"{config.train_steps} steps: {warmup} {what} graph(s) compiled in "
                      f"warm-up, none in the {steady_steps} steady steps"}


def _compiler(state: Any, model: Any) -> tuple[Any, Callable[[], int], str]:
    """The model as the path compiles it, and the counter of its compilations.

    XLA and TorchTPU compile every step's graph themselves (counted by torch_xla's metrics and
    TorchTPU's compilation cache, as the report reads them); elsewhere the model goes through
    torch.compile (dynamo only, no code generation).
    """
    if state.backend == "xla":
        import torch_xla.debug.metrics as met

        return model, lambda: int(met.counter_value("UncachedCompile") or 0), "XLA"
    if state.backend == "tpu_dist":
        from xlaunch._compat import tpu_cache_stats

        def tpu_compiles() -> int:
            stats = tpu_cache_stats()
            return stats.compiles if stats is not None else 0

        return model, tpu_compiles, "TorchTPU"
    import torch

    from xlaunch._compat import dynamo_counts

    compiled = torch.compile(model, backend="eager")
    return compiled, lambda: (dynamo_counts() or {}).get("frames", 0), "torch.compile"


def _average_gradients(state: Any, model: Any, optimizer: Any, reduce: Callable[[Any], Any]) -> None:
    if state.backend == "xla":
        import torch_xla
        import torch_xla.core.xla_model as xm

        xm.optimizer_step(optimizer)
        torch_xla.sync()
        return
    if state.backend is not None:
        import torch.distributed as dist

        for parameter in model.parameters():
            dist.all_reduce(parameter.grad)
            parameter.grad /= state.num_processes
    optimizer.step()
