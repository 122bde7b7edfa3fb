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
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Protocol

from xlaunch import _compat
from xlaunch.worker.process_tree import ProcessTree

POLL_S = 0.05


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


def stop_processes(children: Sequence[_compat.Child], tree: ProcessTree | None,
                   grace: float) -> None:
    """Every stop: SIGTERM to each process of the launch, SIGKILL to what still runs after ``grace``.

    A worker that handles SIGTERM (an `xlaunch.on_stop` callback, its own handler) saves its
    checkpoint meanwhile; one without a handler ends at once; one that ignores it ends at the
    grace's end. What the workers started themselves, in the launch's process group, gets the
    same SIGTERM and the same SIGKILL.
    """
    started = list(children)
    for child in started:
        child.send(signal.SIGTERM)
    if tree is not None:
        tree.signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and not all(
            child.exitcode is not None or _compat.has_ended(child.pid) for child in started):
        time.sleep(POLL_S / 5)
    for child in started:
        child.send(signal.SIGKILL)
    if tree is not None:
        tree.kill()
