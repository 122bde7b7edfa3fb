"""Which processes hold a TPU open: the "TPU already in use" a launch would otherwise hit late.

A TPU chip is a device file (``/dev/accelN`` on v2-v4, ``/dev/vfio/N`` on v5e and later) that one
process at a time may hold. A process from an earlier run - a kernel that touched the TPU, a
training script still running - makes the next launch fail deep inside the runtime. Each process's
open files are links under ``/proc/PID/fd``; reading them is cheap and needs no TPU library.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_DEVICE = re.compile(r"(accel\d+|vfio/\d+)$")


@dataclass(frozen=True)
class DeviceHolder:
    """A process holding a TPU device file open."""

    pid: int
    command: str
    device: str  # the device file, as the process opened it

    def describe(self) -> str:
        return f"pid {self.pid} ({self.command}) holds {self.device}"


def tpu_holders(root: Path) -> tuple[DeviceHolder, ...]:
    """Processes (those of ``root/proc``) whose open files include a TPU device file of ``root``."""
    proc = root / "proc"
    devices = str(root / "dev") + os.sep
    held = []
    try:
        pids = [entry for entry in os.listdir(proc) if entry.isdigit()]
    except OSError:
        return ()
    for pid in pids:
        device = _held_device(proc / pid / "fd", devices)
        if device is not None:
            held.append(DeviceHolder(int(pid), _command(proc / pid), device))
    return tuple(sorted(held, key=lambda holder: holder.pid))


def _held_device(fd_dir: Path, devices: str) -> str | None:
    try:
        fds = os.listdir(fd_dir)
    except OSError:  # gone, or another user's process we may not look into
        return None
    for fd in fds:
        try:
            target = os.readlink(fd_dir / fd)
        except OSError:
            continue
        if target.startswith(devices) and _DEVICE.search(target):
            return target
    return None


def _command(process: Path) -> str:
    try:
        raw = (process / "cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)[:200] or "?"
