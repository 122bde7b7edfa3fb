"""The one owner of a launch's processes: it starts them, holds their tree and the stop grace,
stops them (SIGTERM, the grace, SIGKILL), reaps them, and records which signals reached each.

Modelled on torch elastic's ``PContext`` (start, poll, close): every signal xlaunch sends to a
worker is sent from this module (a layout test checks it), and the judge reads the records kept
here instead of reconstructing afterwards who was stopped.

The tree is one POSIX process group per attempt, led by a tiny guard process that holds a pipe
from the caller: every process of the launch joins it (workers, what an engine starts, what the
workers start themselves), a stop signals the whole group, and should the caller die (SIGKILL, a
kernel restart) the guard's pipe closes and the guard kills the group. A process group rather than
a cgroup: it needs no privileges and holds on every Linux and macOS machine.

Two kinds of process are owned:

- started here (`start`): a process of multiprocessing's context for the start method (the same
  context ``torch.multiprocessing`` uses), running xlaunch's worker wrapper. Its exit status is
  known exactly, and it is reaped here, under the owner's lock, so a signal is never sent to a
  process that has already ended;
- an engine's (`adopt`): ``xmp.spawn``'s pool processes, which the pool starts and reaps. They
  are known by the pid each wrote as it began, and signalled only through the group (a pid the
  pool has reaped could belong to another process by then); how they ended is in the records
  they leave themselves.

The owner sees a started process end from its pid: a pidfd (Linux 5.3+) turns readable the moment
it ends; elsewhere its status is polled. Never from multiprocessing's sentinel, a pipe every
process the worker forks inherits: a grandchild that left the group (``os.setsid()``) would keep
it open, and a wait on it, as long as it lives. Such a process is named when the attempt closes
(`escaped`), and left running.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xlaunch._compat import default_start_method_kept
from xlaunch.backends.escaped import held_pipes, writers
from xlaunch.names import POLL_S
from xlaunch.result.errors import LeftRunning
from xlaunch.worker.launch_dir import STACK_SIGNAL, STACKS_WAIT_S
from xlaunch.worker.process_tree import TreeTicket

# Reads until its stdin (a pipe from the caller) closes, then kills its own group, itself included.
# A stop's SIGTERM to the whole group leaves it standing: it must outlive the grace period.
GUARD = ("/bin/sh", "-c", "trap '' TERM; read _unused; kill -KILL 0")
END_WAIT_S = 5.0  # after the end's SIGKILL: how long killed members may take to be reaped


class LaunchStopped(Exception):
    """A process was to start after the launch had been stopped: it is not started."""


@dataclass(frozen=True)
class ProcessEnd:
    """How one process of the launch ended, as its owner saw it."""

    pid: int | None
    exitcode: int | None  # None: not seen ending (an engine's process); negative: that signal
    signals_sent: frozenset[int] = frozenset()  # the owner's signals that reached it alive
    adopted: bool = False  # an engine started it; its end is in its own records


class ProcessSet:
    """Every process of one attempt of a launch: started, waited on, stopped and reaped; the
    signals it sent each (`ProcessEnd.signals_sent`, which the judge reads)."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self._started: list[Any] = []  # multiprocessing processes, in start order
        self._adopted: dict[int, None] = {}  # an engine's pids, in the order they reported
        self._signals: dict[int, set[int]] = {}
        self._pidfds: dict[int, int] = {}  # a started process's pid -> its pidfd, where there is one
        self.left_running: list[LeftRunning] = []  # known once `close` returns
        self._lock = threading.Lock()  # reaping, and signalling only what has not ended
        self._stopping = threading.Lock()  # one stop sequence at a time
        self._stopped = False
        extra: dict[str, object] = {"process_group": 0} if sys.version_info >= (3, 11) else {
            "preexec_fn": os.setpgrp}
        self._guard = subprocess.Popen(  # a fixed command, no shell input
            GUARD, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            close_fds=True, **extra)  # type: ignore[call-overload]
        assert self._guard.stdin is not None
        self.pgid = self._guard.pid
        self._pipe = self._guard.stdin

    def ticket(self, forked: bool) -> TreeTicket:
        """What a worker needs to join the tree (a forked one also inherits the guard's pipe)."""
        return TreeTicket(self.pgid, self._pipe.fileno() if forked else None, os.getpid())

    # --- start ----------------------------------------------------------------------------

    def start(self, method: str, target: Callable[..., Any], args: tuple[Any, ...],
              name: str) -> Any:
        """Start ``target(*args)`` in a new process; refused once the launch is being stopped."""
        context: Any = multiprocessing.get_context(method)
        with self._lock:
            if self._stopped:
                raise LaunchStopped(name)
            process = context.Process(target=target, args=args, name=name, daemon=False)
            with default_start_method_kept():  # spawn's preparation would fix the caller's
                process.start()
            self._started.append(process)
            pidfd = _pidfd(process.pid)  # not reaped yet: only this owner reaps it, under the lock
            if pidfd is not None:
                self._pidfds[process.pid] = pidfd
        with contextlib.suppress(OSError):  # the child joins itself too; this closes the gap
            os.setpgid(process.pid, self.pgid)
        return process

    def adopt(self, pids: Iterable[int]) -> None:
        """An engine's processes, as they reported themselves."""
        with self._lock:
            for pid in pids:
                self._adopted.setdefault(pid)

    @property
    def started(self) -> list[Any]:
        return list(self._started)

    def exitcode(self, process: Any) -> int | None:
        """The process's status if it has ended (reaping it), else None."""
        with self._lock:
            return process.exitcode  # type: ignore[no-any-return]

    def wait(self, processes: Sequence[Any], timeout: float | None) -> list[Any]:
        """Those of ``processes`` that have ended, reaped, waiting up to ``timeout`` for one.

        Each end is seen from the pid: its pidfd, where the kernel has them, else its status
        polled each `POLL_S`. A pidfd turns readable once the status exists (a fork server's child
        has it a moment later, from the server: that one is polled until then).
        """
        if not processes:
            return []
        deadline = None if timeout is None else time.monotonic() + timeout
        seen: set[int] = set()  # pidfds found readable: ended, status still to come
        while True:
            ended = [p for p in processes if self.exitcode(p) is not None]
            left = None if deadline is None else deadline - time.monotonic()
            if ended or (left is not None and left <= 0):
                return ended
            with self._lock:
                fds = [self._pidfds.get(p.pid) for p in processes]
            watched = [fd for fd in fds if fd is not None and fd not in seen]
            if len(watched) < len(fds):  # some are polled
                left = POLL_S if left is None else min(left, POLL_S)
            if watched:
                seen |= _readable(watched, left)
            elif left is not None:
                time.sleep(left)

    def stopped(self) -> bool:
        return self._stopped

    # --- stop --------------------------------------------------------------------------------

    def ask_stacks(self, pids: Iterable[int], files: Mapping[int, Sequence[Path]] | None = None,
                   wait: float = STACKS_WAIT_S) -> list[int]:
        """Ask each live worker for its Python stack (faulthandler writes it to its file), and
        return once each asked one has written all of it, or has ended, or ``wait`` has passed.

        faulthandler writes a dump in many small writes, so a file with text in it may be half a
        dump. When the dump is done is a fact the kernel keeps: the signal is pending until a
        thread takes it, and blocked in that thread while the handler runs (faulthandler's
        handler does not chain, so it does not unblock itself). Between the two, while the kernel
        sets up the handler's frame, the signal is neither: so where ``files`` names a pid's
        stack files (several ranks may share a process), it is done only once one of them has
        also grown. Where /proc does not say (macOS), the reader settles for a file with text.
        """
        files = files or {}
        asked = []
        before: dict[int, frozenset[int]] = {}
        sizes: dict[int, tuple[int, ...]] = {}
        for pid in pids:
            if self._member(pid):
                before[pid] = _threads_blocking(pid, STACK_SIGNAL)
                sizes[pid] = _sizes(files.get(pid, ()))
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, STACK_SIGNAL)
                    asked.append(pid)
        deadline = time.monotonic() + wait
        waiting = set(asked)
        while waiting and time.monotonic() < deadline:
            # The file first, then the masks: a file grown means the handler had begun, so the
            # signal was blocked from then on; the masks read after it free of the signal mean
            # the handler has ended since (read the other way round, a file grown a moment
            # after masks read in that gap would pass a dump still being written).
            grown = {pid for pid in waiting if pid not in files or _sizes(files[pid]) != sizes[pid]}
            waiting = {pid for pid in waiting if not _zombie(pid) and (
                pid not in grown or _handling(pid, STACK_SIGNAL, before[pid]))}
            if waiting:
                time.sleep(POLL_S)
        return asked

    def stop(self) -> None:
        """SIGTERM to every live process and the whole tree; SIGKILL after the grace to what is
        left. A worker that handles SIGTERM (an `on_stop` callback) saves its checkpoint
        meanwhile; one without a handler ends at once. A second stop while one runs waits for it.
        """
        with self._stopping:
            if self._stopped:
                return
            with self._lock:
                self._stopped = True  # nothing starts any more
            self._signal(signal.SIGTERM)
            deadline = time.monotonic() + self.grace
            while time.monotonic() < deadline and self._any_alive():
                live = [p for p in self._started if self.exitcode(p) is None]
                if live:
                    self.wait(live, min(POLL_S * 5, max(0.0, deadline - time.monotonic())))
                else:
                    time.sleep(POLL_S)
            if self._any_alive():
                self._signal(signal.SIGKILL)  # still running after the grace

    def close(self) -> list[int]:
        """The end of every attempt: nothing of it is left once this returns (within
        ``END_WAIT_S``), or the pids of what is, returned. What still runs is killed (noted, when
        it was a worker), every started process is reaped, then the guard. What a worker started
        that left the group is not waited for: it is named in `left_running`."""
        with self._stopping:
            with self._lock:
                self._stopped = True
            if self._any_alive():
                self._signal(signal.SIGKILL)  # the launch ended
            self._killpg(signal.SIGKILL)  # what the workers left running, the guard too
        deadline = time.monotonic() + END_WAIT_S
        pending = self.started
        while pending and time.monotonic() < deadline:
            pending = [p for p in pending if p not in self.wait(pending, deadline - time.monotonic())]
        for process in self._started:
            if process.exitcode is not None:
                process.join()  # ended: no wait, it only leaves multiprocessing's list of children
        with contextlib.suppress(OSError):
            self._pipe.close()
        self._guard.wait()  # killed just now: this returns the moment it is gone
        left = self._group_left(deadline)
        self.left_running = self._escaped()
        with self._lock:
            for pidfd in self._pidfds.values():
                os.close(pidfd)
            self._pidfds.clear()
        return left

    def _group_left(self, deadline: float) -> list[int]:
        """Killed members whose parent is gone are reaped by init; until then they hold the
        group: the pids of what is left of it at ``deadline``."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            while True:
                os.killpg(self.pgid, 0)
                if time.monotonic() >= deadline:
                    break
                time.sleep(POLL_S / 2)
            return [p.pid for p in self._started if p.exitcode is None] or [self.pgid]
        return [p.pid for p in self._started if p.exitcode is None]

    def _escaped(self) -> list[LeftRunning]:
        """What still holds an ended worker's sentinel once the group is gone: processes the
        workers started that left the group (looked for only when a sentinel is held)."""
        ended = [p.sentinel for p in self._started if p.exitcode is not None]
        found = writers(held_pipes(ended), {os.getpid()})
        return [process for process in found if not self._in_tree(process.pid)]

    def _signal(self, number: int) -> None:
        """``number`` to every live process, recorded for each process it reached alive."""
        with self._lock:
            reached = []
            for process in self._started:
                if self._running(process):
                    reached.append(process.pid)
                    if not self._in_tree(process.pid):  # not yet joined: the group would miss it
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(process.pid, number)
            reached += [pid for pid in self._adopted if self._member(pid)]
            for pid in reached:
                self._signals.setdefault(pid, set()).add(number)
            self._killpg(number)

    def _killpg(self, number: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, number)  # the guard ignores SIGTERM; the grace is its to outlive

    def _any_alive(self) -> bool:
        with self._lock:
            return any(self._running(p) for p in self._started) or any(
                self._member(pid) for pid in self._adopted)

    @staticmethod
    def _running(process: Any) -> bool:
        """Not ended: its status unknown (reaping it if it has ended) and not reaped by another
        thread meanwhile (multiprocessing reaps finished children whenever any process starts)."""
        if process.exitcode is not None:
            return False
        try:
            return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
        except ChildProcessError:  # reaped already: its status is on the process object now
            return False

    def _in_tree(self, pid: int) -> bool:
        try:
            return os.getpgid(pid) == self.pgid
        except OSError:
            return False

    def _member(self, pid: int) -> bool:
        """A live process of the tree (not one that has ended, nor a stranger given the pid)."""
        return self._in_tree(pid) and not _zombie(pid)

    # --- the facts --------------------------------------------------------------------------

    def ends(self) -> list[ProcessEnd]:
        """Every process of the attempt: the started ones in start order, then the engine's."""
        with self._lock:
            ends = [ProcessEnd(p.pid, p.exitcode, frozenset(self._signals.get(p.pid, ())))
                    for p in self._started]
            ends += [ProcessEnd(pid, None, frozenset(self._signals.get(pid, ())), adopted=True)
                     for pid in self._adopted]
        return ends


def _pidfd(pid: int) -> int | None:
    """A descriptor that turns readable when ``pid`` ends (Linux 5.3+), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # not Linux, an older kernel or a sandbox refusing it
        return None


def _readable(fds: Sequence[int], timeout: float | None) -> set[int]:
    """Those of ``fds`` that are readable, waiting up to ``timeout`` seconds for one."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    wait_ms = None if timeout is None else max(0, math.ceil(timeout * 1000))
    return {fd for fd, _ in poller.poll(wait_ms)}


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has ended and awaits its parent (Linux's /proc; elsewhere: no)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def _sizes(paths: Iterable[Path]) -> tuple[int, ...]:
    """Each file's size, 0 for one not there."""
    sizes = []
    for path in paths:
        try:
            sizes.append(path.stat().st_size)
        except OSError:
            sizes.append(0)
    return tuple(sizes)


def _signal_masks(pid: int) -> dict[str, tuple[int, int, int]]:
    """thread id -> (its pending, the process's pending, its blocked) signal masks, as Linux's
    /proc gives them; none for a process that has ended, nor where there is no /proc (macOS)."""
    masks = {}
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for thread in threads:
        try:
            with open(f"/proc/{pid}/task/{thread}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
            masks[thread] = (int(fields["SigPnd"], 16), int(fields["ShdPnd"], 16),
                             int(fields["SigBlk"], 16))
        except (OSError, KeyError, ValueError):
            continue  # a thread that ended meanwhile
    return masks


def _threads_blocking(pid: int, number: int) -> frozenset[int]:
    """The threads of ``pid`` that block signal ``number`` of their own accord (before it is
    sent): their blocked mask says nothing about a handler running."""
    bit = 1 << (number - 1)
    return frozenset(int(thread) for thread, (_, _, blocked) in _signal_masks(pid).items()
                     if blocked & bit)


def _handling(pid: int, number: int, blocking_before: frozenset[int]) -> bool:
    """Whether signal ``number``, sent to ``pid``, is still pending or its handler still runs.
    False where /proc cannot say."""
    bit = 1 << (number - 1)
    for thread, (pending, shared, blocked) in _signal_masks(pid).items():
        if (pending | shared) & bit or (blocked & bit and int(thread) not in blocking_before):
            return True
    return False
