"""Run a training function on every TPU core, GPU or CPU process with one call.

Names load on first use, so ``import xlaunch`` stays cheap and imports neither torch nor
torch_xla: a notebook can import it, and ``xlaunch.detect()``, before deciding anything.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_WHERE = {
    "notebook_launcher": "launcher",
    "launch": "launcher",
    "debug_launcher": "launcher",
    "ProcessState": "state",
    "wait_for_everyone": "state",
    "on_main_process": "state",
    "on_local_main_process": "state",
    "on_last_process": "state",
    "on_process": "state",
    "on_local_process": "state",
    "main_process_first": "state",
    "LaunchError": "errors",
    "LaunchTimeout": "errors",
    "ProcessFailure": "errors",
    "detect": "environment",
    "Environment": "environment",
    "DeviceHolder": "holders",
    "last_report": "launcher",
    "LaunchReport": "report",
    "RankReport": "report",
}

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
    "wait_for_everyone",
]

if TYPE_CHECKING:
    from .environment import Environment, detect
    from .errors import LaunchError, LaunchTimeout, ProcessFailure
    from .holders import DeviceHolder
    from .launcher import debug_launcher, last_report, launch, notebook_launcher
    from .report import LaunchReport, RankReport
    from .state import (
        ProcessState,
        main_process_first,
        on_last_process,
        on_local_main_process,
        on_local_process,
        on_main_process,
        on_process,
        wait_for_everyone,
    )


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'xlaunch' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
