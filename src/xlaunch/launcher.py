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
from .plan import DEFAULT_MONITOR_INTERVAL, DEFAULT_PORT, LaunchPlan, make_plan


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
    monitor_interval: float = DEFAULT_MONITOR_INTERVAL,
    log_line_prefix_template: str | None = None,
    *,
    timeout: float | None = None,
    start_method: str | None = None,
) -> Any:
    """Run ``function(*args)`` in every process of this machine; return local process 0's result.

    The path comes from `detect()`: every TPU core through torch_xla, else every GPU, else CPU
    processes, through torch elastic. Failures arrive as `LaunchError`, root cause first.

    Args:
        function: called as ``function(*args)`` in every process; read the rank from
            `ProcessState`. Defined in a notebook cell is fine: workers are forked.
        args: the arguments, a tuple.
        num_processes: processes on this machine. None: every TPU core, every GPU, or one
            process on a CPU-only machine. A count the hardware cannot run is a `ValueError`.
        mixed_precision: ``"no"``, ``"fp16"`` or ``"bf16"`` (any case); workers read it from
            ``ProcessState().mixed_precision`` and apply it with ``ProcessState().autocast()``.
        use_port: the port workers see as ``MASTER_PORT`` (node 0's meeting point with several
            machines). Left at its default and taken, a free port is used instead.
        master_addr: node 0's address when ``num_nodes > 1``.
        node_rank: this machine's index, ``0 <= node_rank < num_nodes``.
        num_nodes: machines in the job; each runs the same call with its own ``node_rank``.
        rdzv_backend: torch elastic's rendezvous, ``"static"`` or ``"c10d"`` (``"etcd"``,
            ``"etcd-v2"`` where installed).
        rdzv_endpoint: ``host:port`` of the rendezvous; default ``master_addr:use_port``.
        rdzv_conf: extra rendezvous settings passed to torch elastic.
        rdzv_id: the job's name at the rendezvous, the same on every machine.
        max_restarts: how many times the workers are restarted after a failure.
        monitor_interval: seconds between torch elastic's checks on the workers. Left at 0.1,
            the workers are checked every 0.01 s, so a short launch does not wait 0.1 s for
            the first check.
        log_line_prefix_template: torch elastic's prefix for each worker's output lines (for
            example ``"[${rank}] "``); by default lines are prefixed ``[rank N]``.
        timeout: seconds the whole launch may take; then every worker is stopped and
            `LaunchTimeout` shows where each rank stood.
        start_method: ``"fork"`` (default on Linux), ``"spawn"`` or ``"forkserver"``.

    Returns:
        What ``function`` returned in this machine's local process 0, tensors moved to the CPU.
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
