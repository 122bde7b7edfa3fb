"""TPU cores (and XLA's CPU/GPU devices) through torch_xla's ``xmp.spawn``.

The caller never starts the XLA runtime itself. For the usual launch (every device, fork) the
launch thread calls ``xmp.spawn(start_method="fork")`` and the replicas are the caller's own
children (`pool`); for one replica, spawn/forkserver and legacy TPU Nodes a launch leader is forked
first and calls ``xmp.spawn`` there (`via_leader` on the caller's side, `in_leader` in the forked
leader). Every process of a launch sits in one process tree the caller can end at once.
Everything torch_xla-specific is in this package, imported inside functions (it takes seconds to
import and may query the TPU metadata server), so a successor runtime can sit beside it.

Modules: `attempt` (what both ways share: watching, stopping, the facts left), `pool`,
`via_leader`, `in_leader`, `replica` (what each replica runs), `metrics` (the report's XLA figures),
`tail` (the launch's stderr), `tpu_node` (legacy TPU Nodes).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from collections.abc import Callable
from typing import Any

from xlaunch import _compat
from xlaunch.backends.supervise import signals_deferred, supervise
from xlaunch.backends.xla.pool import PoolRun
from xlaunch.backends.xla.replica import Job
from xlaunch.backends.xla.tpu_node import prepare_tpu_node
from xlaunch.backends.xla.via_leader import LeaderRun
from xlaunch.detect.runtime import install_line
from xlaunch.names import WORLD_VAR
from xlaunch.plan.specs import LaunchPlan, XlaSpec
from xlaunch.result.outcome import Outcome, RankExit, judge
from xlaunch.worker.launch_dir import LaunchDir, read_rank_reports
from xlaunch.worker.rank import WorkerSetup, check_picklable


def launch(plan: LaunchPlan, spec: XlaSpec, function: Callable[..., Any],
           args: tuple[Any, ...]) -> Outcome:
    """Run ``function(*args)`` on every replica of ``plan``; replica 0's result in the outcome."""
    refuse_initialised_runtime()
    env = {WORLD_VAR: "xla", **plan.worker_variables(), **spec.worker_env}
    if spec.legacy_tpu_node:  # configured (or refused, naming the torch_xla it needs) first
        env.update(prepare_tpu_node(os.environ))
    require_torch_xla()
    if spec.start_method != "fork":
        check_picklable(function, args)
    launch_dir = LaunchDir.create()
    setup = WorkerSetup(
        launch_dir.folder, env,
        # Two replicas sharing a process (v2/v3 threads) would share one prefixed stdout.
        line_prefix=spec.line_prefix if spec.threads_per_process == 1 else None,
        prefix_single=spec.line_prefix != XlaSpec.line_prefix)
    deadline = None if plan.timeout is None else time.monotonic() + plan.timeout
    earlier: list[tuple[RankExit, ...]] = []
    try:
        for attempt in range(spec.max_restarts + 1):
            job = Job(function, args, setup, attempt, compile_cache=spec.compile_cache,
                      replicas_per_process=spec.threads_per_process, stop_grace=plan.stop_grace)
            outcome = _attempt(plan, spec, job, deadline)
            outcome = dataclasses.replace(outcome, earlier_attempts=tuple(earlier))
            if outcome.timed_out or judge(outcome) is None:
                return outcome
            earlier.append(outcome.exits)
        return outcome
    finally:
        with signals_deferred():
            launch_dir.remove()


def _attempt(plan: LaunchPlan, spec: XlaSpec, job: Job, deadline: float | None) -> Outcome:
    # The pool straight from the caller when it forks; otherwise a leader holds what spawn and
    # forkserver leave running (multiprocessing's resource tracker, the fork server) and ends it.
    direct = spec.nprocs is None and spec.start_method == "fork" and not spec.legacy_tpu_node
    run = PoolRun(plan, spec, job) if direct else LeaderRun(plan, spec, job)
    remaining = None if deadline is None else max(0.001, deadline - time.monotonic())
    try:
        timed_out = supervise(run, remaining)
        exits, failure, result = run.exits(), run.failure, run.result()
        reports = tuple(read_rank_reports(run.attempt))
    finally:
        with signals_deferred():  # a second Ctrl-C must not cut the clean-up short
            run.end()
    return Outcome(path="xla", world_size=plan.world_size, exits=exits, result=result,
                   timed_out=timed_out, timeout=plan.timeout, rank_reports=reports,
                   leader_failure=failure if not timed_out else None)


def require_torch_xla() -> None:
    """Without torch_xla the launch leader would fail at its first line: say so here, first."""
    if importlib.util.find_spec("torch_xla") is not None:
        return
    raise ModuleNotFoundError(
        f"No module named 'torch_xla': the XLA path needs it. Install it with: "
        f"{install_line(runtime='torch_xla')}",
        name="torch_xla")


def refuse_initialised_runtime() -> None:
    if not _compat.xla_runtime_is_initialized():
        return
    raise RuntimeError(
        "The XLA runtime is already initialised in this process, and torch_xla cannot start "
        "replicas after that. Something in an earlier cell used the XLA device: an XLA tensor or "
        "model (.to(torch_xla.device())), torch_xla.device() / xm.xla_device(), or an ordinal or "
        "world-size query (xr.global_ordinal(), xr.world_size()). Restart the kernel and launch "
        "before any cell touches the XLA device (do that work inside the launched function)."
    )
