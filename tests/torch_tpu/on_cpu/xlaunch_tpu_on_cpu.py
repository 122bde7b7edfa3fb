"""The torch_tpu tier's two substitutions, and nothing else: gloo for ``tpu_dist``, the CPU for
the ``tpu`` device. This machine has no TPU, so TorchTPU registers neither.

Loaded the way TorchTPU itself is, as a ``torch.backends`` entry point (this folder's dist-info),
by the same autoload the TorchTPU workers run once their rank is set. Only this tier's conftest
puts the folder on the path; nothing a user installs or sets can reach it.
"""

from __future__ import annotations

import os


def load() -> None:
    import torch
    import torch.distributed as dist

    if not dist.is_available() or "tpu_dist" in dist.Backend.backend_list:
        return

    def gloo(store, rank, size, timeout):  # register_backend's creator: (store, rank, size, timeout)
        return dist.ProcessGroupGloo(store, rank, size, timeout)

    dist.Backend.register_backend("tpu_dist", gloo, devices=["cpu"])

    import xlaunch.state

    xlaunch.state._tpu_device = lambda: torch.device("cpu")
    # What the worker's environment held when the TorchTPU autoload ran (the tests read it).
    os.environ["XLAUNCH_TEST_RANK_AT_AUTOLOAD"] = os.environ.get("RANK", "unset")
