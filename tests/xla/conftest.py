"""The torch_xla tier runs XLA on the CPU device, one device per process.

One CPU device is torch_xla's own test setting: with two or more, threads compiling the same
collective race and XLA aborts the process. Tests that want a bigger machine raise
``CPU_NUM_DEVICES`` for themselves and run no collective across devices.
"""

import os

os.environ["PJRT_DEVICE"] = "CPU"
os.environ["CPU_NUM_DEVICES"] = "1"
os.environ["XLAUNCH_ACCELERATOR"] = "xla"  # the XLA path, whatever the machine has
