"""TPU devices through TorchTPU (``torch-tpu``), carried out as the `elastic` path is.

The engine, its rendezvous, the root-cause records, the stop button and the timeout are those of
the `elastic` backend; TorchTPU adds what its launch protocol needs (``torch_tpu/_internal/
distributed/distributed.py``, 0.2.0):

- its own launch variables, computed in the caller by ``set_tpu_launch_env`` when the launch
  starts (through `_compat`: it is experimental and writes into ``os.environ``, which is put back),
  and handed to every worker;
- a free port for rank 0's handshake coordinator (``TORCH_TPU_INTERNAL_HANDSHAKE_PORT``; its
  default, 36423, collides between two launches on one host);
- ``spawn``, with each rank's variables set before TorchTPU loads: torch imports its device
  backends when it is imported, and TorchTPU's C++ side reads (and keeps) variables such as RANK
  then. A worker's first lines are xlaunch's (`elastic.job.run_worker` needs no torch): they set
  its rank and TorchTPU's variables, and only then does it import torch (`entry.TpuJob`).

What listens where, on one host: the workers' process-group store is a file in the launch's
private folder (no socket); gloo and the handshake clients use 127.0.0.1.
TorchTPU's handshake coordinator (rank 0, ZMQ) binds ``tcp://*:<port>``, every interface, and
offers no setting for the address; libtpu's slice builder listens on the ports of
``TORCH_TPU_SLICEBUILDER_ADDRESSES`` (named ``localhost:<port>``), on the interface libtpu chooses.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from xlaunch import _compat
from xlaunch.backends import elastic
from xlaunch.backends.ports import free_port
from xlaunch.backends.torch_tpu.entry import TpuJob
from xlaunch.plan.specs import LaunchPlan, TorchTpuSpec
from xlaunch.result.outcome import Outcome

HANDSHAKE_PORT_VAR = "TORCH_TPU_INTERNAL_HANDSHAKE_PORT"
DEFAULT_HANDSHAKE_PORT = "36423"  # TorchTPU's own default, what every host of a slice assumes


def launch(plan: LaunchPlan, spec: TorchTpuSpec, function: Callable[..., Any],
           args: tuple[Any, ...]) -> Outcome:
    """Run ``function(*args)`` in one spawned process per TPU device of this host."""
    require_torch_tpu()
    return elastic.launch(plan, spec, function, args, worker_env=launch_variables(plan, spec),
                          job=TpuJob)


def launch_variables(plan: LaunchPlan, spec: TorchTpuSpec) -> dict[str, str]:
    """What TorchTPU's ``set_tpu_launch_env`` gives this launch, plus the handshake port.

    Values the user set in the environment are kept (TorchTPU never overwrites one either).
    """
    preset: dict[str, str] = {}
    if plan.num_nodes > 1:
        # TorchTPU derives NODE_RANK from JOB_COMPLETION_INDEX or by starting the TPU runtime in
        # a child process; GCE gives it as TPU_WORKER_ID, which the plan read.
        preset = {"NODE_RANK": str(spec.node_rank), "NNODES": str(plan.num_nodes),
                  "MASTER_ADDR": spec.master_addr, "MASTER_PORT": str(spec.port)}
    variables = _compat.tpu_launch_env(plan.num_processes, plan.num_nodes, preset)
    if HANDSHAKE_PORT_VAR not in os.environ:
        # Several hosts must agree on the coordinator's port: TorchTPU's default, unless set.
        variables[HANDSHAKE_PORT_VAR] = (str(free_port()) if plan.num_nodes == 1
                                         else DEFAULT_HANDSHAKE_PORT)
    return variables


def require_torch_tpu() -> None:
    import importlib.util

    if importlib.util.find_spec("torch_tpu") is not None:
        return
    from xlaunch.detect.runtime import install_line

    raise ModuleNotFoundError(
        "No module named 'torch_tpu': the TorchTPU path needs it. Install it with: "
        f"{install_line(runtime='torch_tpu')}", name="torch_tpu")
