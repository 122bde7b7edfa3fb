"""GPUs and CPU processes, carried out by torch elastic's agent.

The engine (`torch.distributed.elastic`) starts, watches, restarts and stops the workers. What this
package adds is what users of the engine run into:

- Root cause first: workers record their own exception (worker.py), and every process's exit
  status and the signals sent to it are kept, so `outcome.judge` can name the rank that failed.
- A single-node launch opens no socket beyond loopback. The engine's static rendezvous starts a
  TCPStore listening on every interface; here one node rendezvouses through a `FileStore` in the
  launch's private directory (a rendezvous backend registered with the engine), workers form their
  process group through another `FileStore`, and gloo/NCCL are told to use the loopback interface.
- A whole-launch ``timeout`` that dumps each rank's Python stack before stopping it, and a stop
  button that works at any moment (supervise.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from xlaunch.backends.elastic.engine import EngineExtras, EngineRun
from xlaunch.backends.elastic.entry import Returned
from xlaunch.backends.ports import choose_port
from xlaunch.backends.supervise import signals_deferred, supervise
from xlaunch.plan.specs import ElasticSpec, LaunchPlan
from xlaunch.result.outcome import Outcome
from xlaunch.worker.launch_dir import LaunchDir, read_rank_reports
from xlaunch.worker.rank import check_picklable


def launch(plan: LaunchPlan, spec: ElasticSpec, function: Callable[..., Any],
           args: tuple[Any, ...], extras: EngineExtras | None = None) -> Outcome:
    """Run ``function(*args)`` in every worker of this node; local rank 0's result in the outcome.

    ``extras``: what a path built on the engine adds (TorchTPU's variables and worker job).
    """
    if spec.start_method != "fork":
        check_picklable(function, args)
    # Bound now, as the launch starts (a plan binds nothing): a taken default port is replaced.
    port = choose_port(spec.port, spec.port_fallback, spec.master_addr,
                       loopback=plan.num_nodes == 1, owner=spec.node_rank == 0)
    launch_dir = LaunchDir.create()
    run = None
    try:
        run = EngineRun(plan, spec, port, function, args, launch_dir, extras)
        timed_out = supervise(run, plan.timeout)
        attempts = run.attempts(timed_out)
        reports = tuple(read_rank_reports(launch_dir.latest_attempt()))
    finally:
        with signals_deferred():  # a second Ctrl-C must not cut the clean-up short
            if run is not None:
                run.end()
            launch_dir.remove()
    results = run.results or {}
    result = results[min(results)] if results else None
    if isinstance(result, Returned):
        result = result.load()
    return Outcome(
        path=plan.path, world_size=plan.world_size,
        exits=attempts[-1] if attempts else (), earlier_attempts=tuple(attempts[:-1]),
        # Keyed by global rank: this node's local rank 0 holds the smallest of its ranks.
        result=result,
        timed_out=timed_out, timeout=plan.timeout,
        exception=run.engine_error, rank_reports=reports)
