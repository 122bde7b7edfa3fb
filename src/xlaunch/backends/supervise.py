"""The caller's side of a launch that starts processes: wait, time out, stop - at any moment.

Everything that forks, imports torch or waits on the engine runs in a launch thread. The caller's
own thread only waits on it, so the stop button (SIGINT, raised as KeyboardInterrupt in the main
thread) never lands inside a fork, an at-fork hook or a half-finished import of torch, where it
would be swallowed or leave a broken module behind. When it lands, the launch is stopped and the
interrupt raised; a launch that had not started any process yet is abandoned at once (its thread
finishes the import it was in and starts nothing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from xlaunch.result.errors import LeftRunning, left_running_text
from xlaunch.result.outcome import Outcome, judge

POLL_S = 0.05  # how often the caller's thread looks at the clock and the launch's own checks


def run_attempts(max_restarts: int, timeout: float | None,
                 one_attempt: Callable[[int, float | None], Outcome]) -> Outcome:
    """Every path's restarts, one loop: attempt after attempt until one succeeds, the launch's
    time is up, or ``max_restarts`` are spent. ``one_attempt(number, seconds left)`` ends only
    once every process of that attempt is gone; the last attempt's outcome keeps the earlier
    ones' exits (`LaunchError.earlier_attempts`) and what any attempt left running."""
    deadline = None if timeout is None else time.monotonic() + timeout
    earlier: list[tuple] = []  # type: ignore[type-arg]
    left_running: tuple[LeftRunning, ...] = ()
    attempt = 0
    while True:
        remaining = None if deadline is None else max(0.001, deadline - time.monotonic())
        outcome = one_attempt(attempt, remaining)
        left_running += outcome.left_running
        outcome = dataclasses.replace(outcome, earlier_attempts=tuple(earlier),
                                      left_running=left_running)
        if (attempt >= max_restarts or outcome.timed_out or outcome.leader_failure is not None
                or judge(outcome) is None):
            return outcome
        earlier.append(outcome.exits)
        attempt += 1


class Supervised(Protocol):
    """What a backend's launch offers its supervisor."""

    def run(self) -> None:
        """In the launch thread: start everything and return once every process has ended."""

    def check(self) -> None:
        """In the caller's thread, each poll: any decision that needs a clock (a grace period)."""

    def expire(self) -> None:
        """The timeout passed: note where each rank stands, then stop everything."""

    def stop(self) -> bool:
        """Interrupted: stop everything; True when processes may exist, to wait for them."""

    def end(self) -> list[int]:
        """After everything: every process of the attempt ended; the pids of any left."""

    def left_running(self) -> list[LeftRunning]:
        """After `end`: what the workers started that left the launch's group, still running."""


def run_attempt(launch: Supervised, timeout: float | None,
                facts: Callable[[bool], Outcome]) -> Outcome:
    """One attempt from start to end: supervised, its facts read (``facts(timed_out)``), then
    every process of it ended, whatever happened. The stop button's KeyboardInterrupt says
    whether every worker was stopped, or which process was left; the outcome and the
    interrupt name what a worker started that left the launch's group."""
    ended = False
    try:
        outcome = facts(supervise(launch, timeout))
    except KeyboardInterrupt:
        with signals_deferred():  # a second Ctrl-C must not cut the clean-up short
            left, ended = launch.end(), True
        raise KeyboardInterrupt(interrupted(left, launch.left_running())) from None
    finally:
        if not ended:
            with signals_deferred():
                launch.end()
    return dataclasses.replace(outcome, left_running=tuple(launch.left_running()))


def interrupted(left: list[int], running: list[LeftRunning] | None = None) -> str:
    detached = f"; {left_running_text(running)}" if running else ""
    if not left:
        return f"interrupted: every worker of the launch was stopped{detached}"
    return (f"interrupted: the launch was stopped, but process{'es' if len(left) > 1 else ''} "
            f"{', '.join(map(str, left))} did not end (in uninterruptible I/O?); "
            f"`kill -9 {' '.join(map(str, left))}` ends {'them' if len(left) > 1 else 'it'}"
            f"{detached}")


def supervise(launch: Supervised, timeout: float | None) -> bool:
    """Run ``launch`` to its end in a launch thread; True when the timeout stopped it."""
    # An Event, not Thread.join: a Ctrl-C landing in join() marks a running thread as finished
    # (CPython 3.11, bpo-45274's fix releases the thread's own lock).
    finished = threading.Event()

    def run() -> None:
        try:
            launch.run()
        finally:
            finished.set()

    thread = threading.Thread(target=run, name="xlaunch-launch")
    deadline = None if timeout is None else time.monotonic() + timeout
    timed_out = False
    try:
        thread.start()
    except RuntimeError:
        # No thread could start (CPython 3.12.0 and 3.12.1 refuse new threads once the interpreter
        # is shutting down, in an atexit handler; a system out of threads refuses too): nothing
        # ran, so nothing is stopped or waited for (waiting for it hung for ever).
        raise
    except BaseException:  # the stop button as the thread started: it may be running
        with signals_deferred():
            if launch.stop():
                finished.wait()
        raise
    try:
        while not finished.wait(POLL_S):
            launch.check()
            if not timed_out and deadline is not None and time.monotonic() >= deadline:
                timed_out = True
                launch.expire()
    except BaseException:
        with signals_deferred():
            if launch.stop():
                finished.wait()
        raise
    thread.join()  # the thread has finished its work; this only lets it end
    return timed_out


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold off a second Ctrl-C while a stop is cleaning up; it is raised when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: caught.append(number))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt
