"""TPU cores (and XLA's CPU/GPU devices) through torch_xla's ``xmp.spawn``.

The caller never starts the XLA runtime itself: ``xmp.spawn`` forks the replicas' processes,
from the launch thread or from a launch leader (`attempt` says which and why), and the launch's
owner (`backends.processes`) holds their tree and does every stop. Everything torch_xla-specific
is in this package, imported inside functions (it takes seconds to import and may query the TPU
metadata server), so a successor runtime can sit beside it.

Modules: `starter` (how an attempt's replicas start and end), `pool` (``xmp.spawn`` from the
launch thread), `leader` (from a forked leader), `replica` (what each replica runs), `metrics`
(the report's XLA figures), `tail` (the launch's stderr).
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

from xlaunch.backends.displays import DisplayRelay
from xlaunch.backends.environment import launch_environment, xla_layer
from xlaunch.backends.lines import FOLD_ENV
from xlaunch.backends.live_view import live_view_on
from xlaunch.backends.supervise import Starter, run_launch
from xlaunch.backends.xla.replica import ReplicaJob
from xlaunch.backends.xla.starter import XlaStarter
from xlaunch.detect.runtime import install_line
from xlaunch.plan.specs import LaunchPlan, XlaSpec
from xlaunch.result.outcome import Outcome
from xlaunch.worker.launch_dir import LaunchDir
from xlaunch.worker.rank import WorkerSetup, check_picklable


def launch(plan: LaunchPlan, spec: XlaSpec, function: Callable[..., Any],
           args: tuple[Any, ...]) -> Outcome:
    """Run ``function(*args)`` on every replica of ``plan``; replica 0's result in the outcome."""
    require_torch_xla()
    if spec.start_method != "fork":
        check_picklable(function, args)
    with LaunchDir.made() as launch_dir:
        path_env = xla_layer(spec, os.environ, launch_dir.folder)
        variables = launch_environment(plan, os.environ, path_env)
        displays = relay_displays(plan, spec, launch_dir)
        setup = WorkerSetup(
            launch_dir.folder, variables, line_prefix=spec.line_prefix,
            prefix_single=spec.line_prefix != XlaSpec.line_prefix,
            display_fds=displays.fds if displays is not None else None,
            # Replicas sharing a process (v2/v3 threads): each thread's lines get its own rank.
            threads_share_streams=spec.threads_per_process > 1)

        def starter(number: int) -> Starter:
            job = ReplicaJob(function, args, setup, number, compile_cache=spec.compile_cache,
                             replicas_per_process=spec.threads_per_process)
            return XlaStarter(spec, plan.world_size, job, path_env)

        return run_launch(plan, launch_dir, spec.max_restarts, starter, displays)


def relay_displays(plan: LaunchPlan, spec: XlaSpec, launch_dir: LaunchDir) -> DisplayRelay | None:
    """In a Jupyter kernel, forked replicas' displays (and text) reach the cell through the caller,
    as on the elastic path: one socket per replica process, each inherited through ``xmp.spawn``'s
    fork (and a leader's), and the live view of the ranks, read from the marks the replicas leave
    in the launch folder (``XLAUNCH_LIVE_VIEW=0``: none). A rank's row shows once its replica
    started (on a pod a host's replicas are not ranks 0..n-1). Not where replicas are threads of
    one process (v2/v3): they share the kernel session a replica's displays are routed through
    (XLA's CPU device with several devices is one process too). Not under spawn/forkserver."""
    if spec.start_method != "fork" or spec.threads_per_process != 1:
        return None
    fold = spec.line_prefix == XlaSpec.line_prefix and os.environ.get(FOLD_ENV, "1") != "0"
    return DisplayRelay.for_kernel(plan.num_processes, fold,
                                   launch_dir.folder if live_view_on() else None)


def require_torch_xla() -> None:
    """Without torch_xla the launch would fail at its first line: say so here, first."""
    if importlib.util.find_spec("torch_xla") is not None:
        return
    raise ModuleNotFoundError(
        f"No module named 'torch_xla': the XLA path needs it. Install it with: "
        f"{install_line(runtime='torch_xla')}",
        name="torch_xla")

