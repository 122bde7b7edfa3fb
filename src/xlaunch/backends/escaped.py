"""What a worker started that left the launch's process group and still runs: found, not killed.

A process a worker starts inherits its descriptors (``os.fork``, or ``subprocess`` with
``close_fds=False``), among them the write end of the pipe multiprocessing gives each process it
starts (its sentinel): the pipe reads end-of-file only once every holder of that end is gone. So
a worker that has ended, whose sentinel has not, left something running, and once the launch's
group has ended whatever still holds that end left the group on purpose (``os.setsid()``,
``start_new_session=True``, ``process_group=0``). The holders are found the way
`detect.holders` finds a TPU's: each process's open files are links under ``/proc/PID/fd``.

Looked for only when a sentinel is still held, so a launch with nothing left pays one ``poll``
per worker. Not found: a process that closed its inherited descriptors (a daemon's double fork
does), and any where there is no ``/proc`` (macOS); neither holds a launch up, since the owner
waits on pids, not on descriptors.
"""

from __future__ import annotations

import os
import select
from collections.abc import Iterable

from xlaunch.result.errors import LeftRunning


def held_pipes(sentinels: Iterable[int]) -> set[int]:
    """The pipes (their inodes) of ``sentinels`` whose write end someone still holds."""
    poller = select.poll()
    for fd in sentinels:
        poller.register(fd, select.POLLIN)
    at_end = {fd for fd, _ in poller.poll(0)}  # end-of-file (or data): nothing holds it
    held = set()
    for fd in set(sentinels) - at_end:
        try:
            held.add(os.fstat(fd).st_ino)
        except OSError:
            continue
    return held


def writers(pipes: set[int], exclude: set[int]) -> list[LeftRunning]:
    """The processes (but ``exclude``) that hold the write end of one of ``pipes`` open."""
    if not pipes:
        return []
    try:
        pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
    except OSError:
        return []
    names = {f"pipe:[{inode}]" for inode in pipes}
    return [LeftRunning(pid, _command(pid)) for pid in sorted(pids)
            if pid not in exclude and _writes_to(pid, names)]


def _writes_to(pid: int, names: set[str]) -> bool:
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:  # gone, or another user's process we may not look into
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in names and _for_writing(pid, fd):
                return True
        except OSError:
            continue
    return False


def _for_writing(pid: int, fd: str) -> bool:
    """Whether the descriptor is open for writing (the read end holds nothing up)."""
    with open(f"/proc/{pid}/fdinfo/{fd}") as info:
        for line in info:
            if line.startswith("flags:"):
                return int(line.split()[1], 8) & os.O_ACCMODE != os.O_RDONLY
    return False


def _command(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            raw = cmdline.read()
    except OSError:
        return "?"
    return " ".join(part.decode(errors="replace") for part in raw.split(b"\0") if part)[:200] or "?"
