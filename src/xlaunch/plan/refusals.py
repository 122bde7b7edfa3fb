"""What a launch refuses before anything starts: values out of range, and options left unused.

Every option takes effect on the path a launch takes, or the call is refused naming the option
and the path: an option accepted and then ignored is a trap (a port that is not used, a restart
count nothing honours).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from xlaunch.plan.options import (
    DEFAULT_PORT,
    MIXED_PRECISIONS,
    RDZV_BACKENDS,
    START_METHODS,
    LaunchOptions,
)

if TYPE_CHECKING:
    from xlaunch.plan.specs import LaunchPlan


def check_values(options: LaunchOptions) -> None:
    if options.mixed_precision.strip().lower() not in MIXED_PRECISIONS:
        raise ValueError(f"mixed_precision={options.mixed_precision!r} is not one of "
                         f"{', '.join(MIXED_PRECISIONS)}")
    if options.num_processes is not None and options.num_processes < 1:
        raise ValueError(f"num_processes must be a whole number of at least 1, not {options.num_processes!r}")
    if options.num_nodes < 1:
        raise ValueError(f"num_nodes must be a whole number of at least 1, not {options.num_nodes!r}")
    if not 0 <= options.node_rank < options.num_nodes:
        raise ValueError(f"node_rank={options.node_rank!r} must be between 0 and "
                         f"num_nodes-1={options.num_nodes - 1}")
    if options.max_restarts < 0:
        raise ValueError(f"max_restarts must be a whole number of at least 0, not {options.max_restarts!r}")
    if options.rdzv_backend not in RDZV_BACKENDS:
        raise ValueError(f"rdzv_backend={options.rdzv_backend!r} is not one of "
                         f"{', '.join(RDZV_BACKENDS)}")
    if not options.monitor_interval > 0:
        raise ValueError("monitor_interval must be a positive number of seconds, not "
                         f"{options.monitor_interval!r}")
    if not options.stop_grace >= 0:
        raise ValueError(f"stop_grace must be a number of seconds (0 or more), not "
                         f"{options.stop_grace!r}")
    if options.timeout is not None and not options.timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, not "
                         f"{options.timeout!r}")
    if options.start_method is not None and options.start_method not in START_METHODS:
        raise ValueError(f"start_method={options.start_method!r} is not one of "
                         f"{', '.join(START_METHODS)}")
    if str(options.use_port) != DEFAULT_PORT and not _is_port(options.use_port):
        raise ValueError(f"use_port={options.use_port!r} is not a port number (1-65535)")


def _is_port(value: str | int) -> bool:
    try:
        return 0 < int(value) < 65536
    except ValueError:
        return False


# What each path does with each option; an option given (not left at its default) that the
# path leaves unused is refused, naming the option and the path.
_USED = {
    "xla": {"num_processes", "mixed_precision", "timeout", "start_method", "report",
            "log_line_prefix_template", "compile_cache", "cpu_only", "max_restarts", "stop_grace",
            "spmd"},
    "inline": {"num_processes", "mixed_precision", "timeout", "report", "cpu_only"},
}
_WHY_UNUSED = {
    "xla": "torch_xla forms the TPU world itself: there is no rendezvous, port or engine to set",
    "inline": "one process runs in this process: nothing is started, restarted or rendezvoused "
              "(ask for num_processes=2 or more to start processes)",
}


def refuse_unused(plan: LaunchPlan, options: LaunchOptions) -> None:
    given = options.given()
    if plan.path in ("elastic", "torch_tpu"):  # workers that form a torch.distributed group
        unused = {"compile_cache"} if given.get("compile_cache") not in (None, False) else set()
        if plan.num_nodes == 1 and not options.rdzv_endpoint:
            # One machine has no node to meet: any rdzv_backend is met at once, and its settings
            # have nothing to set.
            unused |= {name for name in ("master_addr", "rdzv_conf") if name in given}
        why = "one machine meets on loopback through files: master_addr and rdzv_conf " \
              "apply to several machines (num_nodes > 1) or a named rdzv_endpoint"
        if unused & {"compile_cache"}:
            why = "compile_cache is torch_xla's compilation cache, used on the XLA path only"
    else:
        unused = {name for name in given if name not in _USED[plan.path]}
        if plan.path == "inline" and given.get("compile_cache") in (False,):
            unused.discard("compile_cache")
        why = _WHY_UNUSED[plan.path]
    if unused:
        names = ", ".join(f"{name}={given[name]!r}" for name in sorted(unused))
        raise ValueError(f"{names}: not used by the {plan.path} launch path "
                         f"({plan.summary()}): {why}. Leave it at its default.")
