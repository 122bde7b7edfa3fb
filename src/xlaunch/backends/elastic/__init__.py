"""GPUs and CPU processes (and TorchTPU's devices, `backends.torch_tpu`): workers that form one
torch.distributed group.

Which engine runs which launch:

- one machine: this node's workers are processes of torch's own process layer (multiprocessing's
  context for the start method, as ``torch.multiprocessing.start_processes`` makes them) started,
  watched, stopped and reaped by the launch's owner (`backends.processes`), each running
  xlaunch's worker wrapper (`job`). Nothing listens on the network: the workers' group meets
  through a `FileStore` in the launch's private folder, and gloo/NCCL use the loopback interface;
- several machines: torch elastic's rendezvous (``static``, ``c10d``) places each node and gives
  the store the workers' group forms through (`rendezvous`); each node's workers start as on one
  machine.

``start_processes`` itself is not called: its wrapper imports torch before a line of xlaunch's in
a spawned worker (TorchTPU needs its variables set before that import), names an error file in
the caller's temporary directory that its ``join`` would unpickle, and turns a KeyboardInterrupt
into exit status 0. torch elastic's agent is not used either: on one machine it has nothing to
meet, and its worker handling reached for private parts of torch (kept off here).

Restarts are the one loop every path shares (`supervise.run_attempts`): each attempt's processes
are all gone before the next starts; with several machines every node restarts and they meet again.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

from xlaunch.backends.displays import DisplayRelay
from xlaunch.backends.elastic.attempt import DistAttempt
from xlaunch.backends.elastic.job import Job, World
from xlaunch.backends.elastic.rendezvous import NodeRendezvous
from xlaunch.backends.lines import FOLD_ENV
from xlaunch.backends.live_view import live_view_on
from xlaunch.backends.ports import choose_port
from xlaunch.backends.supervise import run_attempt, run_attempts, signals_deferred
from xlaunch.plan.specs import ElasticSpec, LaunchPlan
from xlaunch.result.outcome import Outcome
from xlaunch.worker.launch_dir import LaunchDir, read_rank_reports
from xlaunch.worker.rank import WorkerSetup, check_picklable
from xlaunch.worker.value import read_value

# (function, args, setup, spec, world, attempt, run_id) -> what each worker runs
JobFactory = Callable[..., Job]


def launch(plan: LaunchPlan, spec: ElasticSpec, function: Callable[..., Any],
           args: tuple[Any, ...], worker_env: dict[str, str] | None = None,
           job: JobFactory = Job) -> Outcome:
    """Run ``function(*args)`` in every worker of this node; local rank 0's result in the outcome.

    ``worker_env`` and ``job``: what a path built on this one adds (TorchTPU's variables and
    worker).
    """
    if spec.start_method != "fork":
        check_picklable(function, args)
    # Bound now, as the launch starts (a plan binds nothing): a taken default port is replaced.
    port = choose_port(spec.port, spec.port_fallback, spec.master_addr,
                       loopback=plan.num_nodes == 1, owner=spec.node_rank == 0)
    launch_dir = LaunchDir.create()
    nodes = None if spec.loopback_only else NodeRendezvous(plan, spec, port)
    here = World(0, plan.num_processes, plan.num_processes, master_port=port)
    # In a Jupyter kernel, forked workers' displays reach the cell through the caller.
    fold = spec.log_line_prefix_template is None and os.environ.get(FOLD_ENV, "1") != "0"
    # There too: a live view of the ranks in the cell (XLAUNCH_LIVE_VIEW=0: none).
    live = live_view_on()
    displays = (DisplayRelay.for_kernel(
        plan.num_processes, fold, launch_dir.folder if live else None,
        plan.num_processes if plan.num_nodes == 1 else 0)
        if spec.start_method == "fork" else None)
    setup = WorkerSetup(launch_dir.folder, {**worker_variables(plan, spec), **(worker_env or {})},
                        line_prefix=spec.log_line_prefix_template or "[rank ${rank}] ",
                        prefix_single=spec.log_line_prefix_template is not None,
                        display_fds=displays.fds if displays is not None else None)

    def one_attempt(attempt: int, timeout: float | None) -> Outcome:
        def make_job(world: World) -> Job:
            return job(function, args, setup, spec, world, attempt, spec.rdzv_id)

        run = DistAttempt(plan, spec, make_job, launch_dir, attempt,
                          None if nodes is not None else here, nodes)
        if displays is not None and displays.live is not None:  # the owner's record of a stop
            displays.live.owner_stopped = lambda: run.owner is not None and run.owner.stopped()

        def facts(timed_out: bool) -> Outcome:
            exits = run.exits()
            return Outcome(path=plan.path, world_size=plan.world_size, exits=exits,
                           result=read_value(run.folder)[1], timed_out=timed_out,
                           timeout=plan.timeout,
                           rank_reports=tuple(read_rank_reports(run.folder)),
                           leader_failure=run.failure if not timed_out else None,
                           nodes=nodes.after(attempt, exits, timed_out) if nodes else None)

        return run_attempt(run, timeout, facts)

    view = displays.live if displays is not None else None
    ended = False
    try:
        outcome = run_attempts(spec.max_restarts, plan.timeout, one_attempt)
        ended = True
    finally:
        with signals_deferred():
            if displays is not None:  # every worker has ended: what they sent is shown, then freed
                displays.close()
                if view is not None and not ended:  # no report will take its place
                    view.finish(None)
            if nodes is not None:
                nodes.close()
            launch_dir.remove()
    return dataclasses.replace(outcome, live_view=view) if view is not None else outcome


def worker_variables(plan: LaunchPlan, spec: ElasticSpec) -> dict[str, str]:
    """What every worker of the launch gets, besides its place (`Job.rank_variables`)."""
    env: dict[str, str] = plan.worker_variables()
    if spec.socket_ifname is not None:
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):  # the user's own choice wins
            env[name] = os.environ.get(name, spec.socket_ifname)
    if spec.cpu_threads:
        env["OMP_NUM_THREADS"] = str(spec.cpu_threads)
    return env

