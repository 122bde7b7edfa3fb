"""The worker's side of the launch's process tree (the owner's side is `backends.processes`).

Every process of a launch joins one process group that the launch's owner signals as one, so
what a worker starts itself (a `subprocess`, a data loader's helpers) ends with the launch. A
worker that leaves the group on purpose (``start_new_session=True``) leaves it on purpose.
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class TreeTicket:
    """What a worker needs to join the group: plain data, forked or pickled to it."""

    pgid: int
    guard_fd: int | None  # the caller's end of the guard's pipe, inherited by forked workers
    caller_pid: int = 0  # the process that holds that pipe: only its own children close it


_JOINED = threading.Lock()
_joined_pid = 0


def join(ticket: TreeTicket | None) -> None:
    """In a worker: let go of the caller's pipe and join the launch's group, once per process.

    Replicas that are threads of one process (v2/v3 chips) each call this: the descriptor is
    closed once, by the first, and only in a process the caller forked itself. A process forked
    from a worker has no such descriptor any more, and that number may be another file by then.
    """
    global _joined_pid
    if ticket is None:
        return
    with _JOINED:
        if _joined_pid == os.getpid():
            return
        _joined_pid = os.getpid()
        if ticket.guard_fd is not None and os.getppid() == ticket.caller_pid:
            with contextlib.suppress(OSError):
                os.close(ticket.guard_fd)
        with contextlib.suppress(OSError):
            os.setpgid(0, ticket.pgid)
