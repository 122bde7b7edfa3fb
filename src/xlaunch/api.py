"""The public launch functions: check the call, plan it, hand the plan to one backend.

`notebook_launcher` and `launch` are one function under two names: notebooks know the first from
accelerate, scripts use the second.
"""

from __future__ import annotations

import functools
import os
import sys
import time
import types
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

from xlaunch.backends import carry_out
from xlaunch.detect import Environment, Machine, detect
from xlaunch.plan import LaunchOptions, LaunchPlan, make_plan
from xlaunch.plan.options import (
    DEFAULT_MASTER_ADDR,
    DEFAULT_MONITOR_INTERVAL,
    DEFAULT_PORT,
    DEFAULT_RDZV_BACKEND,
    DEFAULT_RDZV_ID,
    DEFAULT_STOP_GRACE,
)
from xlaunch.result import LaunchReport, judge, make_report
from xlaunch.result.errors import left_running_text
from xlaunch.result.report import report_shown


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str = DEFAULT_PORT,
    master_addr: str = DEFAULT_MASTER_ADDR,
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = DEFAULT_RDZV_BACKEND,
    rdzv_endpoint: str = "",
    rdzv_conf: Mapping[str, Any] | None = None,
    rdzv_id: str = DEFAULT_RDZV_ID,
    max_restarts: int = 0,
    monitor_interval: float = DEFAULT_MONITOR_INTERVAL,
    log_line_prefix_template: str | None = None,
    *,
    timeout: float | None = None,
    start_method: str | None = None,
    compile_cache: bool | str | os.PathLike[str] | None = None,
    report: bool = True,
    stop_grace: float = DEFAULT_STOP_GRACE,
    spmd: bool = False,
) -> Any:
    """Run ``function(*args)`` in every process of this machine; return local process 0's result.

    The path comes from `detect()`: every TPU core (torch_xla or TorchTPU), else every GPU, else
    CPU processes. Failures arrive as `LaunchError`, root cause first.

    Args:
        function: called as ``function(*args)`` in every process; read the rank from
            `ProcessState`. Defined in a notebook cell is fine: a forked worker (the default on
            Linux) inherits it, and under ``spawn`` or ``forkserver`` (TorchTPU spawns) it
            travels by value (cloudpickle).
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
        rdzv_backend: torch elastic's rendezvous between machines, ``"static"`` or ``"c10d"``
            (``"etcd"``, ``"etcd-v2"`` where installed); one machine has no other to meet.
        rdzv_endpoint: ``host:port`` of the rendezvous; default ``master_addr:use_port``.
        rdzv_conf: extra rendezvous settings passed to torch elastic.
        rdzv_id: the job's name at the rendezvous, the same on every machine.
        max_restarts: how many times the workers are restarted after a failure (on the XLA
            path the whole launch runs again); ``ProcessState().restart_count`` says which.
        monitor_interval: seconds between the launcher's checks on what does not arrive as a
            worker's end (with several machines: another node's failure). A worker's end is seen
            the moment it happens.
        log_line_prefix_template: a prefix for each worker's output lines, in torch elastic's
            template syntax (for example ``"[${rank}] "``); by default lines are prefixed
            ``[rank N]``.
        timeout: seconds the whole launch may take; then every worker is stopped and
            `LaunchTimeout` shows where each rank stood.
        start_method: ``"fork"`` (default on Linux), ``"spawn"`` or ``"forkserver"``.
        compile_cache: torch_xla's persistent compilation cache. None: on for TPU (and XLA on
            GPUs), in ``$XLAUNCH_COMPILE_CACHE`` or ``~/.cache/xlaunch/xla-compile``; False:
            off; True or a folder: on, there, on any XLA device. Each replica process keeps its
            own sub-folder. Delete the folder to clear it.
        report: after every launch `last_report()` says what each rank did. It is shown when
            it has something to say: always on the TPU paths (xla, torch_tpu), on the other
            paths only when it has a warning or torch.compile counters, never when no rank
            reported; a table in a notebook, text on stderr elsewhere; a failed launch shows
            none: its error carries it (``error.report``) and says its warnings. ``False``
            shows nothing (the report is still kept).
        stop_grace: every stop (the timeout, the stop button, a failed peer, a restart) sends
            each worker SIGTERM, then SIGKILL after this many seconds: time for an
            `xlaunch.on_stop` callback (or the worker's own SIGTERM handler) to save a
            checkpoint. A worker without one ends at once.
        spmd: torch_xla's SPMD, for a model that does not fit one core: one worker process per
            host, with SPMD switched on before the runtime starts, drives every device of the host
            (``ProcessState().mesh()``, ``mark_sharding``, FSDPv2). ``num_processes`` None or 1;
            the XLA path only.

    Returns:
        What ``function`` returned in this machine's local process 0, tensors moved to the CPU.
    """
    __tracebackhide__ = True  # IPython shows the user's call, then the message, not this frame
    return _launch(function, args, lambda: LaunchOptions(
        num_processes=num_processes, mixed_precision=mixed_precision, use_port=use_port,
        master_addr=master_addr, node_rank=node_rank, num_nodes=num_nodes,
        rdzv_backend=rdzv_backend, rdzv_endpoint=rdzv_endpoint, rdzv_conf=rdzv_conf,
        rdzv_id=rdzv_id, max_restarts=max_restarts, monitor_interval=monitor_interval,
        log_line_prefix_template=log_line_prefix_template, timeout=timeout,
        start_method=start_method, compile_cache=compile_cache, report=report,
        stop_grace=stop_grace, spmd=spmd))


launch = notebook_launcher


def debug_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    num_processes: int = 2,
    *,
    timeout: float | None = None,
    stop_grace: float = DEFAULT_STOP_GRACE,
) -> Any:
    """Run ``function(*args)`` in ``num_processes`` CPU processes over gloo, whatever the machine."""
    __tracebackhide__ = True
    return _launch(function, args, lambda: LaunchOptions(
        num_processes=num_processes, timeout=timeout, cpu_only=True, stop_grace=stop_grace))


def _launch(function: Callable[..., Any], args: tuple[Any, ...],
            options: Callable[[], LaunchOptions]) -> Any:
    """Check the arguments, plan, then run the plan; input refused up front is raised as a
    launch's error is (`_raise`: in a notebook, the user's call, then the message)."""
    __tracebackhide__ = True
    try:
        args = _check_args(function, args)
        plan = plan_here(options())
    except Exception as refused:
        _raise(refused)
    return run_plan(plan, function, args)


def plan_here(options: LaunchOptions, env: Environment | None = None) -> LaunchPlan:
    """The plan for this machine and this process: the facts gathered once, then decided."""
    return make_plan(env or detect(), options, Machine.here(), os.environ)


def run_plan(plan: LaunchPlan, function: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """Carry out a plan: say what runs, hand it to its backend, judge the outcome.

    A failed launch shows no report: the error follows the launch line at once, and carries the
    report (``error.report``), its warnings in its text.
    """
    __tracebackhide__ = True
    for line in (*plan.notes, f"launching {plan.summary()}"):
        print(f"xlaunch: {line}", file=sys.stderr)
    started = time.perf_counter()
    try:
        outcome = carry_out(plan, function, args)
    except KeyboardInterrupt as stop:  # the stop button: raised anew, next to the user's call
        interrupted = KeyboardInterrupt(*stop.args)
        interrupted.__suppress_context__ = True
        _raise(interrupted)
    except Exception as failed:  # the launch itself failed before any worker ran
        _raise(failed)
    report = make_report(plan.path, time.perf_counter() - started, outcome.rank_reports,
                         plan.memory_total)
    global _LAST_REPORT
    _LAST_REPORT = report
    error = judge(outcome, report)
    if error is not None and error.report is not None:  # the report names the root cause too
        _LAST_REPORT = error.report
    view = outcome.live_view  # in a notebook: the live view of the ranks, in the cell
    if error is not None:
        if view is not None:
            view.finish(None)
        error.__cause__ = outcome.exception
        _raise(error)
    if outcome.left_running:  # a failed launch names them in its error
        print(f"xlaunch: warning: {left_running_text(outcome.left_running)}", file=sys.stderr)
    _print_report(plan, report, view)
    if outcome.exception is not None:  # the function's own exception, judged no failure
        _raise(outcome.exception)
    return outcome.result


def _raise(error: BaseException) -> NoReturn:
    """Raise a launch's error (or the stop button's interrupt) so that IPython shows the user's
    call, then the message, with no frame of xlaunch's between them.

    IPython hides the frames that set ``__tracebackhide__`` but always shows the one an exception
    was raised in, and some frame of xlaunch's raises it. So the error carries the hook IPython
    calls instead of formatting a traceback itself (``_render_traceback_``, IPython's way for an
    exception to render itself): IPython's own rendering of the same traceback, less xlaunch's
    frames. Outside IPython nothing reads it.
    """
    error._render_traceback_ = functools.partial(_rendered_without_ours, error)  # type: ignore[attr-defined]
    raise error  # the launch's error: its root cause, with the rank's own traceback, below


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _rendered_without_ours(error: BaseException) -> list[str]:
    """IPython's traceback of ``error`` (the lines of a notebook's error output), less the frames
    of xlaunch's files; the whole traceback should that fail."""
    from IPython import get_ipython

    shell = get_ipython()
    whole = error.__traceback__
    try:
        kept = []
        entry = whole
        while entry is not None:
            if not os.path.abspath(entry.tb_frame.f_code.co_filename).startswith(_PACKAGE):
                kept.append(entry)
            entry = entry.tb_next
        shown = None
        for entry in reversed(kept):
            shown = types.TracebackType(shown, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
        return shell.InteractiveTB.structured_traceback(type(error), error, shown)  # type: ignore[no-any-return]
    except Exception:  # IPython's own rendering, ours left in, rather than none
        return shell.InteractiveTB.structured_traceback(type(error), error, whole)  # type: ignore[no-any-return]


def last_report() -> LaunchReport | None:
    """What the last launch in this process did, per rank (None before the first launch)."""
    return _LAST_REPORT


_LAST_REPORT: LaunchReport | None = None


def _print_report(plan: LaunchPlan, report: LaunchReport, view: Any = None) -> None:
    """Show the report when it has something to say (`report_shown`): a table in a notebook
    (in place of the launch's live view, `backends.live_view`, where it showed), text on stderr
    elsewhere. A live view the report does not replace goes."""
    if not plan.report or not report_shown(report):
        if view is not None:
            view.finish(None)
        return
    display = _kernel_display()
    if display is not None and view is not None and view.shown:
        from IPython.display import update_display

        update_display(report, display_id=view.display_id)
    elif display is not None:
        display(report)
    else:
        print(report, file=sys.stderr)


def _kernel_display() -> Callable[[Any], None] | None:
    """IPython's ``display`` when this process is a Jupyter kernel (not a terminal IPython)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None or getattr(shell, "kernel", None) is None:
        return None
    from IPython.display import display

    return display  # type: ignore[no-any-return]


def _check_args(function: object, args: object) -> tuple[Any, ...]:
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}: {function!r}")
    if isinstance(args, (str, bytes)) or not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple of arguments for the function, got {args!r}")
    return tuple(args)

