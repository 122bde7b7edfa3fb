"""What each TorchTPU worker runs: load TorchTPU once its rank is set, join ``tpu_dist``, measure.

The engine's workers are spawned, and a spawned worker imports torch before the engine gives it
its rank variables. torch imports its device backends (TorchTPU among them) as it is imported,
and TorchTPU's C++ side reads and keeps variables such as RANK when it loads. So the workers
start with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` and run the autoload here, once RANK, LOCAL_RANK,
WORLD_SIZE and TorchTPU's launch variables are all in the environment: the same entry points
torch would have loaded, in the same way.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from xlaunch import _compat
from xlaunch.backends.elastic.entry import Job
from xlaunch.backends.torch_tpu.measure import WARNINGS, collect
from xlaunch.plan.specs import ElasticSpec
from xlaunch.worker.rank import WorkerSetup

AUTOLOAD_VAR = "TORCH_DEVICE_BACKEND_AUTOLOAD"


class TpuJob(Job):
    def __init__(self, function: Callable[..., Any], args: tuple[Any, ...], setup: WorkerSetup,
                 spec: ElasticSpec, *, autoload: bool = True, autoload_value: str | None = None
                 ) -> None:
        super().__init__(function, args, setup, spec)
        self.autoload = autoload  # False: the user turned torch's autoload off, and keeps it off
        self.autoload_value = autoload_value  # the variable as the user had it (None: unset)

    def _prepare_torch(self, local_rank: int) -> None:
        WARNINGS.install()  # before TorchTPU loads: some of its warnings come at import
        if self.autoload_value is None:
            os.environ.pop(AUTOLOAD_VAR, None)  # the user's own subprocesses autoload as usual
        else:
            os.environ[AUTOLOAD_VAR] = self.autoload_value
        if self.autoload:
            _compat.load_device_backends()

    def _measure(self) -> Callable[[], Mapping[str, Any]] | None:
        return collect
