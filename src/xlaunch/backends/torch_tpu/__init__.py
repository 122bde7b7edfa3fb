"""TPU devices through TorchTPU (``torch-tpu``), carried out as the `elastic` path is.

The engine, its rendezvous, the root-cause records, the stop button and the timeout are those of
the `elastic` backend; TorchTPU adds what its launch protocol needs (``torch_tpu/_internal/
distributed/distributed.py``, 0.2.0):

- its own launch variables, computed in the caller by ``set_tpu_launch_env`` when the launch
  starts, and a free port for rank 0's handshake coordinator: the path's layer of every worker's
  environment (`backends.environment.torch_tpu_layer`);
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

from xlaunch.backends import elastic
from xlaunch.backends.environment import torch_tpu_layer
from xlaunch.backends.torch_tpu.entry import TpuJob
from xlaunch.plan.specs import LaunchPlan, TorchTpuSpec
from xlaunch.result.outcome import Outcome


def launch(plan: LaunchPlan, spec: TorchTpuSpec, function: Callable[..., Any],
           args: tuple[Any, ...]) -> Outcome:
    """Run ``function(*args)`` in one spawned process per TPU device of this host."""
    require_torch_tpu()
    return elastic.launch(plan, spec, function, args,
                          path_env=torch_tpu_layer(plan, spec, os.environ), job=TpuJob)


def require_torch_tpu() -> None:
    import importlib.util

    if importlib.util.find_spec("torch_tpu") is not None:
        return
    from xlaunch.detect.runtime import install_line

    raise ModuleNotFoundError(
        "No module named 'torch_tpu': the TorchTPU path needs it. Install it with: "
        f"{install_line(runtime='torch_tpu')}", name="torch_tpu")
