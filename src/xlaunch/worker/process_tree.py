"""One process group per launch, ended as one: workers, and whatever they start themselves.

A worker's own children (a `subprocess`, a data loader's helpers) are not the engine's to stop,
and a worker killed by its parent's death signal cannot stop them either. So every process of a
launch joins one process group, and a tiny guard process leads it: the caller ends the group at the
end of every launch, and should the caller itself die (SIGKILL, a kernel restart), the guard's
pipe from it closes and the guard ends the group. A process group, rather than a cgroup, because it
needs no privileges and holds on every Linux and macOS machine; a worker that leaves the group on
purpose (``start_new_session=True``) leaves it on purpose.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

# Reads until its stdin (a pipe from the caller) closes, then kills its own group, itself included.
# A stop's SIGTERM to the whole group leaves it standing: it must outlive the grace period.
GUARD = ("/bin/sh", "-c", "trap '' TERM; read _unused; kill -KILL 0")
END_WAIT_S = 5.0


@dataclass(frozen=True)
class TreeTicket:
    """What a worker needs to join the group: plain data, forked or pickled to it."""

    pgid: int
    guard_fd: int | None  # the caller's end of the guard's pipe, inherited by forked workers


class ProcessTree:
    """The process group of one launch and its guard."""

    def __init__(self) -> None:
        extra: dict[str, object] = {"process_group": 0} if sys.version_info >= (3, 11) else {
            "preexec_fn": os.setpgrp}
        self._guard = subprocess.Popen(  # a fixed command, no shell input
            GUARD, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True, **extra)  # type: ignore[call-overload]
        assert self._guard.stdin is not None
        self.pgid = self._guard.pid
        self._pipe = self._guard.stdin

    def ticket(self, forked: bool) -> TreeTicket:
        return TreeTicket(self.pgid, self._pipe.fileno() if forked else None)

    def signal(self, number: int) -> None:
        """Send ``number`` to every process still in the group (the guard ignores SIGTERM)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, number)

    def kill(self) -> None:
        """SIGKILL every process still in the group (the guard stays until `end`)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signal.SIGKILL)

    def end(self) -> None:
        """Nothing of this launch is left once this returns (within ``END_WAIT_S``)."""
        self.kill()
        with contextlib.suppress(OSError):
            self._pipe.close()
        deadline = time.monotonic() + END_WAIT_S
        self._guard.wait()  # killed just now: this returns the moment it is gone
        # Killed members whose parent is gone are reaped by init; until then they hold the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            while time.monotonic() < deadline:
                os.killpg(self.pgid, 0)
                time.sleep(0.005)


def join(ticket: TreeTicket | None) -> None:
    """In a worker: let go of the caller's pipe, and join the launch's group."""
    if ticket is None:
        return
    if ticket.guard_fd is not None:
        with contextlib.suppress(OSError):
            os.close(ticket.guard_fd)
    with contextlib.suppress(OSError):
        os.setpgid(0, ticket.pgid)
