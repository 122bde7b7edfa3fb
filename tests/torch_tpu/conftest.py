"""The torch_tpu tier: the real torch-tpu package (torch 2.13.0 CPU, libtpu) on a host with no TPU.

Nothing here may start TorchTPU's runtime: libtpu would query the cloud metadata server and hang.
``TPU_SKIP_MDS_QUERY=1`` is set by the test command and again here for a direct pytest run.

The launch tests make exactly two substitutions, in on_cpu/ (gloo for ``tpu_dist``, the CPU for
the ``tpu`` device), registered as a ``torch.backends`` entry point: on the path of these tests
and of the workers they spawn, and nowhere else.
"""

import os
import sys
from pathlib import Path

ON_CPU = str(Path(__file__).parent / "on_cpu")

os.environ["TPU_SKIP_MDS_QUERY"] = "1"
os.environ.pop("XLAUNCH_ACCELERATOR", None)
os.environ.pop("XLAUNCH_TPU_RUNTIME", None)
sys.path.insert(0, ON_CPU)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [ON_CPU, os.environ.get("PYTHONPATH")]))
