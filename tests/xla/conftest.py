"""The torch_xla tier runs XLA on the CPU device, one device per process.

One CPU device is torch_xla's own test setting: with two or more, threads compiling the same
collective race and XLA aborts the process. Tests that want a bigger machine raise
``CPU_NUM_DEVICES`` for themselves and run no collective across devices.
"""

import os

os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = "1"
os.environ["XLAUNCH_ACCELERATOR"] = "xla"  # the XLA path, whatever the machine has
# torch 2.8's CUDA build (with triton) starts inductor's compile workers when torch_xla is
# imported; they would count as processes a test left behind.
os.environ.setdefault("TORCH_WARM_POOL", "0")
