"""What machine is this: `detect()` reads environment variables and files, and returns plain data.

Nothing here imports torch or torch_xla, starts a device or touches the network, so detection is
safe in a notebook cell before any launch, and a test can describe a fake machine as a folder.
"""

from __future__ import annotations

from xlaunch.detect.environment import Environment, detect
from xlaunch.detect.holders import DeviceHolder
from xlaunch.detect.machine import Machine

__all__ = ["DeviceHolder", "Environment", "Machine", "detect"]
