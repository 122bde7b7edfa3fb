"""The caller's arguments as one object, checked for type before anything else looks at them.

`notebook_launcher`, `debug_launcher`, ``xlaunch run`` and ``xlaunch demo`` each build one
`LaunchOptions`; the planner reads nothing else. A wrong type is a `TypeError` naming the
parameter, so ``timeout="x"`` never surfaces as a comparison failing deep inside a backend.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# The defaults of notebook_launcher's options, each defined here once: the signature, the command
# line, the options object and the plan's specs read them from here.
DEFAULT_STOP_GRACE = 3.0  # seconds between a stop's SIGTERM and its SIGKILL
DEFAULT_MASTER_ADDR = "127.0.0.1"  # loopback: a one-machine launch listens nowhere else
DEFAULT_RDZV_BACKEND = "static"
DEFAULT_RDZV_ID = "none"
MIXED_PRECISIONS = ("no", "fp16", "bf16")
RDZV_BACKENDS = ("static", "c10d", "etcd", "etcd-v2")
START_METHODS = ("fork", "spawn", "forkserver")


class _Default(float):
    """A default that can be told from the same number passed on purpose (``is`` compares it)."""


class _DefaultPort(str):
    """The default port: it reads as "29500" (``help()`` shows ``use_port='29500'``), yet it can
    be told from the same number passed on purpose (``is`` compares it). Only a port left at its
    default is replaced by a free one when it is taken; a port the caller named is theirs."""


DEFAULT_PORT: str = _DefaultPort("29500")


def port_left_at_default(use_port: str | int) -> bool:
    """Whether the caller left ``use_port`` alone (``"29500"`` passed explicitly is named)."""
    return use_port is DEFAULT_PORT


# accelerate's and torch elastic's default; a value passed on purpose is told from it (refusals).
DEFAULT_MONITOR_INTERVAL: float = _Default(0.1)


@dataclass(frozen=True)
class LaunchOptions:
    """Every argument a launch takes, with `notebook_launcher`'s defaults."""

    num_processes: int | None = None
    mixed_precision: str = "no"
    use_port: str | int = DEFAULT_PORT
    master_addr: str = DEFAULT_MASTER_ADDR
    node_rank: int = 0
    num_nodes: int = 1
    rdzv_backend: str = DEFAULT_RDZV_BACKEND
    rdzv_endpoint: str = ""
    rdzv_conf: Mapping[str, Any] | None = None
    rdzv_id: str = DEFAULT_RDZV_ID
    max_restarts: int = 0
    monitor_interval: float = DEFAULT_MONITOR_INTERVAL
    log_line_prefix_template: str | None = None
    timeout: float | None = None
    start_method: str | None = None
    compile_cache: bool | str | os.PathLike[str] | None = None
    report: bool = True
    stop_grace: float = DEFAULT_STOP_GRACE
    spmd: bool = False  # torch_xla's SPMD: one process per host drives every device
    cpu_only: bool = False  # debug_launcher and ``xlaunch run --cpu``: CPU processes whatever the machine

    def __post_init__(self) -> None:
        for name, (kinds, spelled) in _TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                raise TypeError(f"{name} must be {spelled}, not {type(value).__name__}: {value!r}")

    def given(self) -> dict[str, Any]:
        """The options set to something other than their default, by name."""
        given = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            default = field.default
            if field.name == "monitor_interval":
                if value is not DEFAULT_MONITOR_INTERVAL:
                    given[field.name] = value
            elif value != default and not (field.name == "rdzv_conf" and not value):
                given[field.name] = value
        return given


_NUMBER = (int, float)
_TYPES: dict[str, tuple[tuple[type, ...], str]] = {
    "num_processes": ((int, type(None)), "a whole number or None"),
    "mixed_precision": ((str,), "'no', 'fp16' or 'bf16'"),
    "use_port": ((str, int), "a port number (str or int)"),
    "master_addr": ((str,), "a host name or address (str)"),
    "node_rank": ((int,), "a whole number"),
    "num_nodes": ((int,), "a whole number"),
    "rdzv_backend": ((str,), "a rendezvous backend name (str)"),
    "rdzv_endpoint": ((str,), "'host:port' (str)"),
    "rdzv_conf": ((Mapping, type(None)), "a dict or None"),
    "rdzv_id": ((str,), "a job id (str)"),
    "max_restarts": ((int,), "a whole number"),
    "monitor_interval": (_NUMBER, "a number of seconds"),
    "log_line_prefix_template": ((str, type(None)), "a template string or None"),
    "timeout": ((*_NUMBER, type(None)), "a number of seconds or None"),
    "start_method": ((str, type(None)), "'fork', 'spawn', 'forkserver' or None"),
    "compile_cache": ((bool, str, os.PathLike, type(None)), "None, False, True or a directory"),
    "report": ((bool,), "True or False"),
    "stop_grace": (_NUMBER, "a number of seconds"),
    "spmd": ((bool,), "True or False"),
    "cpu_only": ((bool,), "True or False"),
}
