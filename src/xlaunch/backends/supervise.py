"""The caller's side of every launch that starts processes: one attempt's life, its timeout, its
stop, and the restarts.

An `Attempt` owns what every path shares - the gate (a stop before anything started starts
nothing), the deadline, the stop, the end and the facts its workers left - and asks its path's
`Starter` only how its processes start and wait for one another, when a path of its own must stop
them (XLA's peers of a failed replica), and which rank each process was.

At the deadline, in this order, on every path (`Attempt.expire`):

1. the ranks that had settled (returned or raised) are read, before anyone is asked anything:
   theirs is their own verdict, the timeout is everyone else's, whatever they do while stopped;
2. the attempt is marked cancelled: a worker that starts from now on runs nothing;
3. each live worker is asked for its Python stack (`ProcessSet.ask_stacks`, which returns once
   every dump is whole);
4. everything is stopped: SIGTERM, the stop's grace, SIGKILL (`ProcessSet.stop`).

Everything that forks, imports torch or waits on the engine runs in a launch thread. The caller's
own thread only waits on it, so the stop button (SIGINT, raised as KeyboardInterrupt in the main
thread) never lands inside a fork, an at-fork hook or a half-finished import of torch, where it
would be swallowed or leave a broken module behind. When it lands, the launch is stopped and the
interrupt raised; a launch that had not started any process yet is abandoned at once, at the stop
button and at the deadline alike (its thread finishes the import or the meeting it was in, and
starts nothing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

from xlaunch.backends.displays import DisplayRelay
from xlaunch.backends.exits import AttemptFiles
from xlaunch.backends.processes import ProcessEnd, ProcessSet
from xlaunch.names import CHECK_S
from xlaunch.plan.specs import LaunchPlan
from xlaunch.result.errors import LeftRunning, ProcessFailure, left_running_text
from xlaunch.result.outcome import Outcome, RankExit, judge, restarting
from xlaunch.worker.launch_dir import (
    LaunchDir,
    Mark,
    cancel,
    collect_stacks,
    noted,
    read_rank_reports,
    settled,
    stack_path,
    worker_pids,
)
from xlaunch.worker.value import read_value


class Starter(Protocol):
    """What a path supplies to its attempts: how their processes start and how they end."""

    def prepare(self, attempt: Attempt) -> None:
        """In the launch thread, before any process: imports, meeting the other nodes."""

    def start(self, attempt: Attempt, owner: ProcessSet) -> None:
        """In the launch thread: start the processes through ``owner``; return once all ended."""

    def must_stop(self, attempt: Attempt) -> bool:
        """In the caller's thread, each `CHECK_S`: whether everything must stop now."""

    def exits(self, attempt: Attempt, ends: Sequence[ProcessEnd],
              files: AttemptFiles) -> tuple[RankExit, ...]:
        """Each rank's end, from the owner's record of each process and the workers' files."""

    def outcome(self, attempt: Attempt, outcome: Outcome) -> Outcome:
        """The attempt's outcome, with what only the path knows (the other nodes') added."""


class Attempt:
    """One attempt of a launch: its processes started, watched, stopped, and what they left."""

    def __init__(self, plan: LaunchPlan, launch_dir: LaunchDir, number: int,
                 starter: Starter) -> None:
        self.plan, self.launch_dir, self.number, self.starter = plan, launch_dir, number, starter
        self.folder = launch_dir.attempt_dir(number)
        self.owner: ProcessSet | None = None
        self.stacks: dict[int, str] = {}
        self.settled_at_deadline: frozenset[int] | None = None  # see exits.AttemptFiles
        self.failure: ProcessFailure | None = None  # the launch failed before any worker ran
        self._gate = threading.Lock()
        self.cancelled = threading.Event()  # stopped or expired: nothing starts from now on
        self._prepared = False
        self._finished = threading.Event()

    # --- in the launch thread ----------------------------------------------------------------

    def run(self) -> None:
        """Start everything, and return once every process has ended."""
        try:
            self.starter.prepare(self)
            self._prepared = True
            with self._gate:
                if self.cancelled.is_set():
                    return
                self.owner = ProcessSet(self.plan.stop_grace)
            self.starter.start(self, self.owner)
        except BaseException as error:  # reported as the launch's own failure
            self.failure = dataclasses.replace(ProcessFailure.from_exception(error, rank=0),
                                               pid=None)
        finally:
            self._finished.set()

    # --- in the caller's thread --------------------------------------------------------------

    def check(self) -> None:
        if not self._finished.is_set() and self.starter.must_stop(self):
            self.stop_all()

    def expire(self) -> bool:
        """The deadline passed: where each rank stood, then every process stopped. True when the
        launch thread is about to end (as `stop`)."""
        self.settled_at_deadline = settled(self.folder)
        cancel(self.folder)
        with self._gate:
            self.cancelled.set()
            owner = self.owner
        if owner is not None:
            pids = worker_pids(self.folder)
            files: dict[int, list[Path]] = {}
            for rank, pid in pids.items():
                files.setdefault(pid, []).append(stack_path(self.folder, rank))
            asked = set(owner.ask_stacks(set(pids.values()), files))
            stacks = collect_stacks(self.folder, [r for r, pid in pids.items() if pid in asked])
            by_pid = {pids[rank]: text for rank, text in stacks.items() if text}
            # Replicas that share a process (v2/v3) share its dump.
            self.stacks = {rank: stacks.get(rank) or by_pid.get(pid) or "(no stack arrived)"
                           for rank, pid in pids.items() if pid in asked}
        self.stop_all()
        return owner is not None or self._prepared

    def stop(self) -> bool:
        """Interrupted: stop everything. True when the launch thread is about to end (to wait
        for it); False while it is still importing or meeting the other nodes, which cannot be
        cut short and after which it starts nothing."""
        with self._gate:
            self.cancelled.set()
            started = self.owner is not None
        self.stop_all()
        return started or self._prepared

    def stop_all(self) -> None:
        cancel(self.folder)  # a worker not started yet will not run
        if self.owner is not None:
            self.owner.adopt(noted(self.folder, Mark.BEGAN))
            self.owner.stop()

    def stopped(self) -> bool:
        """The owner's record: this attempt's processes were stopped."""
        return self.owner is not None and self.owner.stopped()

    def end(self) -> list[int]:
        """Every process of the attempt ended; the pids of any that could not be."""
        return self.owner.close() if self.owner is not None else []

    def left_running(self) -> list[LeftRunning]:
        """What the workers started that left the launch's group, still running at its end."""
        return self.owner.left_running if self.owner is not None else []

    # --- the facts ----------------------------------------------------------------------------

    def exits(self) -> tuple[RankExit, ...]:
        """Each rank's end as the owner's records and the workers' files say now."""
        files = AttemptFiles.read(self.folder, self.settled_at_deadline)
        if self.stacks:
            files = dataclasses.replace(files, stacks=self.stacks)
        ends = self.owner.ends() if self.owner is not None else []
        return self.starter.exits(self, ends, files)

    def outcome(self, timed_out: bool) -> Outcome:
        outcome = Outcome(path=self.plan.path, world_size=self.plan.world_size,
                          exits=self.exits(), result=read_value(self.folder)[1],
                          timed_out=timed_out, timeout=self.plan.timeout,
                          rank_reports=tuple(read_rank_reports(self.folder)),
                          leader_failure=self.failure if not timed_out else None)
        return self.starter.outcome(self, outcome)


def run_launch(plan: LaunchPlan, launch_dir: LaunchDir, max_restarts: int,
               starter: Callable[[int], Starter], displays: DisplayRelay | None = None,
               close: Callable[[], None] | None = None) -> Outcome:
    """Every path's launch: attempt after attempt (`run_attempts`), each to its end; then what
    the workers sent is shown and freed, ``close`` called and the launch's folders removed,
    however it ended. ``starter(number)``: the path's starter for that attempt."""
    view = displays.live if displays is not None else None
    ended = False

    def one_attempt(number: int, timeout: float | None) -> Outcome:
        attempt = Attempt(plan, launch_dir, number, starter(number))
        if view is not None:  # the owner's record of a stop
            view.owner_stopped = attempt.stopped
        return run_attempt(attempt, timeout)

    try:
        outcome = run_attempts(max_restarts, plan.timeout, one_attempt)
        ended = True
    finally:
        with signals_deferred():
            if displays is not None:  # every worker has ended: what they sent is shown, then freed
                displays.close()
                if view is not None and not ended:  # no report will take its place
                    view.finish(None)
            if close is not None:
                close()
            launch_dir.remove()
    return dataclasses.replace(outcome, live_view=view) if view is not None else outcome


def run_attempts(max_restarts: int, timeout: float | None,
                 one_attempt: Callable[[int, float | None], Outcome]) -> Outcome:
    """Every path's restarts, one loop: attempt after attempt until one succeeds, the launch's
    time is up, or ``max_restarts`` are spent. ``one_attempt(number, seconds left)`` ends only
    once every process of that attempt is gone; the last attempt's outcome keeps the earlier
    ones' exits (`LaunchError.earlier_attempts`) and what any attempt left running. Each
    restart is said on stderr, naming the failure that ended the attempt."""
    deadline = None if timeout is None else time.monotonic() + timeout
    earlier: list[Outcome] = []
    left_running: tuple[LeftRunning, ...] = ()
    number = 0
    while True:
        remaining = None if deadline is None else max(0.001, deadline - time.monotonic())
        outcome = one_attempt(number, remaining)
        left_running += outcome.left_running
        outcome = dataclasses.replace(outcome, earlier_attempts=tuple(o.exits for o in earlier),
                                      earlier_nodes=tuple(o.nodes for o in earlier),
                                      left_running=left_running)
        if number >= max_restarts or outcome.timed_out or outcome.leader_failure is not None:
            return outcome
        error = judge(outcome)
        if error is None:
            return outcome
        # Said on every node: each judged the same failure (its own, or the one it was told).
        print(f"xlaunch: {restarting(error, number + 2, max_restarts + 1)}", file=sys.stderr,
              flush=True)
        earlier.append(outcome)
        number += 1


def run_attempt(attempt: Attempt, timeout: float | None) -> Outcome:
    """One attempt from start to end: supervised, its facts read, then every process of it ended,
    whatever happened. The stop button's KeyboardInterrupt says whether every worker was
    stopped, or which process was left; the outcome and the interrupt name what a worker started
    that left the launch's group."""
    ended = False
    try:
        outcome = attempt.outcome(supervise(attempt, timeout))
    except KeyboardInterrupt:
        with signals_deferred():  # a second Ctrl-C must not cut the clean-up short
            left, ended = attempt.end(), True
        raise KeyboardInterrupt(interrupted(left, attempt.left_running())) from None
    finally:
        if not ended:
            with signals_deferred():
                attempt.end()
    return dataclasses.replace(outcome, left_running=tuple(attempt.left_running()))


def interrupted(left: list[int], running: list[LeftRunning] | None = None) -> str:
    detached = f"; {left_running_text(running)}" if running else ""
    if not left:
        return f"interrupted: every worker of the launch was stopped{detached}"
    return (f"interrupted: the launch was stopped, but process{'es' if len(left) > 1 else ''} "
            f"{', '.join(map(str, left))} did not end (in uninterruptible I/O?); "
            f"`kill -9 {' '.join(map(str, left))}` ends {'them' if len(left) > 1 else 'it'}"
            f"{detached}")


def supervise(attempt: Attempt, timeout: float | None) -> bool:
    """Run ``attempt`` to its end in a launch thread; True when the timeout stopped it."""
    # An Event, not Thread.join: a Ctrl-C landing in join() marks a running thread as finished
    # (CPython 3.11, bpo-45274's fix releases the thread's own lock).
    finished = threading.Event()

    def run() -> None:
        try:
            attempt.run()
        finally:
            finished.set()

    # Not a daemon: a forked worker's threads inherit the flag of the thread that forked it.
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
        _stop(attempt, finished)
        raise
    try:
        while not finished.wait(CHECK_S):
            attempt.check()
            if not timed_out and deadline is not None and time.monotonic() >= deadline:
                timed_out = True
                if not attempt.expire():
                    # Still importing or meeting the other nodes, in a C call nothing can cut
                    # short (a store connecting tries again after its own timeout): abandoned, as
                    # at the stop button; it starts nothing when it returns.
                    return True
    except BaseException:
        _stop(attempt, finished)
        raise
    thread.join()  # the thread has finished its work; this only lets it end
    return timed_out


def _stop(attempt: Attempt, finished: threading.Event) -> None:
    """Interrupted: stop the attempt, and wait for its thread where it is about to end."""
    with signals_deferred():
        if attempt.stop():
            finished.wait()


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

