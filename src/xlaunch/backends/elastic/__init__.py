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

import os
from collections.abc import Callable
from typing import Any

from xlaunch.backends.displays import DisplayRelay
from xlaunch.backends.elastic.job import DistJob
from xlaunch.backends.elastic.rendezvous import NodeRendezvous
from xlaunch.backends.elastic.starter import DistStarter
from xlaunch.backends.environment import Variables, World, launch_environment
from xlaunch.backends.lines import FOLD_ENV
from xlaunch.backends.live_view import live_view_on
from xlaunch.backends.ports import choose_port
from xlaunch.backends.supervise import Starter, run_launch
from xlaunch.plan.specs import ElasticSpec, LaunchPlan
from xlaunch.result.outcome import Outcome
from xlaunch.worker.launch_dir import LaunchDir
from xlaunch.worker.rank import WorkerSetup, check_picklable


def launch(plan: LaunchPlan, spec: ElasticSpec, function: Callable[..., Any],
           args: tuple[Any, ...], path_env: Variables | None = None,
           job: type[DistJob] = DistJob) -> Outcome:
    """Run ``function(*args)`` in every worker of this node; local rank 0's result in the outcome.

    ``path_env`` and ``job``: what a path built on this one adds (TorchTPU's variables and
    worker).
    """
    if spec.start_method != "fork":
        check_picklable(function, args)
    # Bound now, as the launch starts (a plan binds nothing): a taken default port is replaced.
    port = choose_port(spec.port, spec.port_fallback, spec.master_addr,
                       loopback=plan.num_nodes == 1, owner=spec.node_rank == 0)
    variables = launch_environment(plan, os.environ, path_env)
    nodes = None if spec.loopback_only else NodeRendezvous(plan, spec, port)
    here = None if nodes is not None else World(0, plan.num_processes, plan.num_processes,
                                                master_port=port)
    # In a Jupyter kernel, forked workers' displays reach the cell through the caller.
    fold = spec.log_line_prefix_template is None and os.environ.get(FOLD_ENV, "1") != "0"
    # There too: a live view of the ranks in the cell (XLAUNCH_LIVE_VIEW=0: none).
    live = live_view_on()
    with LaunchDir.made() as launch_dir:
        displays = (DisplayRelay.for_kernel(
            plan.num_processes, fold, launch_dir.folder if live else None,
            plan.num_processes if plan.num_nodes == 1 else 0)
            if spec.start_method == "fork" else None)
        setup = WorkerSetup(launch_dir.folder, variables,
                            line_prefix=spec.log_line_prefix_template or "[rank ${rank}] ",
                            prefix_single=spec.log_line_prefix_template is not None,
                            display_fds=displays.fds if displays is not None else None)

        def starter(number: int) -> Starter:
            def make_job(world: World) -> DistJob:
                return job(function, args, setup, spec, world, number, spec.rdzv_id)

            return DistStarter(spec, plan.num_processes, make_job, here, nodes)

        return run_launch(plan, launch_dir, spec.max_restarts, starter, displays,
                          close=nodes.close if nodes is not None else None)
