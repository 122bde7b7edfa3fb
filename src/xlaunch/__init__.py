"""Run a training function on every TPU core, GPU or CPU process with one call.

``import xlaunch`` imports neither torch nor torch_xla: a notebook can import it, and call
``xlaunch.detect()``, before deciding anything. It does load all of xlaunch itself (a few tens of
milliseconds), so that the first launch in a notebook pays nothing a later one would not.
"""

from __future__ import annotations

__version__ = "0.1.0"

from xlaunch.api import debug_launcher, last_report, launch, notebook_launcher
from xlaunch.detect import DeviceHolder, Environment, detect
from xlaunch.result import LaunchError, LaunchReport, LaunchTimeout, ProcessFailure, RankReport
from xlaunch.state import (
    ProcessState,
    main_process_first,
    on_last_process,
    on_local_main_process,
    on_local_process,
    on_main_process,
    on_process,
    on_stop,
    wait_for_everyone,
)

__all__ = [
    "DeviceHolder",
    "Environment",
    "LaunchError",
    "LaunchReport",
    "LaunchTimeout",
    "ProcessFailure",
    "ProcessState",
    "RankReport",
    "debug_launcher",
    "detect",
    "last_report",
    "launch",
    "main_process_first",
    "notebook_launcher",
    "on_last_process",
    "on_local_main_process",
    "on_local_process",
    "on_main_process",
    "on_process",
    "on_stop",
    "wait_for_everyone",
]
