"""What each TorchTPU worker runs: import torch (and so TorchTPU) once its rank is set, join
``tpu_dist``, measure.

torch imports its device backends (TorchTPU among them) as it is imported, and TorchTPU's C++ side
reads and keeps variables such as RANK when it loads. A spawned worker's first lines are
xlaunch's: its rank's variables and TorchTPU's launch variables are in the environment before
anything in it imports torch, so torch's own autoload (``TORCH_DEVICE_BACKEND_AUTOLOAD``, as the
user has it) loads TorchTPU with everything it reads already there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from xlaunch.backends.elastic.job import DistJob
from xlaunch.backends.torch_tpu.measure import WARNINGS, collect


class TpuJob(DistJob):
    def _prepare_torch(self, local_rank: int) -> None:
        WARNINGS.install()  # before TorchTPU loads: some of its warnings come at import
        import torch  # noqa: F401  (TorchTPU loads here, through torch's device-backend autoload)

    def _measure(self) -> Callable[[], Mapping[str, Any]] | None:
        return collect
