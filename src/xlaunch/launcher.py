"""The public launch functions: check the call, plan it, hand the plan to one backend.

`notebook_launcher` and `launch` are one function under two names: notebooks know the first from
accelerate, scripts and the design card use the second.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

from .environment import detect
from .plan import DEFAULT_PORT, LaunchPlan, make_plan


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str = DEFAULT_PORT,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: Mapping[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    *,
    timeout: float | None = None,
    start_method: str | None = None,
) -> Any:
    """Run ``function(*args)`` in every process of this machine; return local process 0's result.

    The path comes from `detect()`: every TPU core through torch_xla, else every GPU, else CPU
    processes, through torch elastic. Failures arrive as `LaunchError`, root cause first.
    """
    args = _check_call(function, args)
    plan = make_plan(
        detect(), num_processes=num_processes, mixed_precision=mixed_precision, use_port=use_port,
        master_addr=master_addr, node_rank=node_rank, num_nodes=num_nodes,
        rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf,
        rdzv_id=rdzv_id, max_restarts=max_restarts, monitor_interval=monitor_interval,
        log_line_prefix_template=log_line_prefix_template, timeout=timeout,
        start_method=start_method,
    )
    return run_plan(plan, function, args)


launch = notebook_launcher


def debug_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    num_processes: int = 2,
    *,
    timeout: float | None = None,
) -> Any:
    """Run ``function(*args)`` in ``num_processes`` CPU processes over gloo, whatever the machine."""
    args = _check_call(function, args)
    plan = make_plan(detect(), num_processes=num_processes, timeout=timeout, cpu_only=True)
    return run_plan(plan, function, args)


def run_plan(plan: LaunchPlan, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    for line in (*plan.notes, f"launching {plan.summary()}"):
        print(f"xlaunch: {line}", file=sys.stderr)
    if plan.accelerator == "cuda" and plan.start_method == "fork" and plan.backend == "elastic":
        _refuse_initialised_cuda()
    backend = import_module(f".backends.{plan.backend}", __package__)
    return backend.launch(plan, function, args)


def _check_call(function: object, args: object) -> tuple[Any, ...]:
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}: {function!r}")
    if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of arguments for the function, got {args!r}")
    return tuple(args)


def _refuse_initialised_cuda() -> None:
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return
    raise RuntimeError(
        "CUDA was already initialised in this process, so forked workers cannot use the GPUs. "
        "Something in an earlier cell touched the GPU: a tensor or model moved with .cuda() or "
        ".to('cuda'), or a torch.cuda call such as torch.cuda.get_device_name(). Restart the "
        "kernel and launch before any cell uses the GPU (do GPU work inside the launched function)."
    )
