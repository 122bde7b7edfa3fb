"""One process: the caller's own. No engine, no fork, the function runs where it was called.

It still keeps the launcher's promises: the function sees the plan's mixed precision, a failure
arrives as `LaunchError` (the original exception chained below it), and ``timeout`` interrupts
the function in the calling thread and reports where it stood.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

from xlaunch import _compat, stopping
from xlaunch.backends.environment import launch_environment, overlay, worker_environment
from xlaunch.plan.specs import InlineSpec, LaunchPlan
from xlaunch.result.errors import ProcessFailure
from xlaunch.result.outcome import Outcome, RankExit
from xlaunch.result.report import RankReport
from xlaunch.worker.measure import dynamo_since, peak_rss_bytes
from xlaunch.worker.value import to_cpu


class _Expired(BaseException):
    """Raised in the caller's thread when the timeout passes; never escapes this module."""


def launch(plan: LaunchPlan, spec: InlineSpec, function: Callable[..., Any],
           args: tuple[Any, ...]) -> Outcome:
    stack: list[str] = []
    started = time.perf_counter()
    pid = os.getpid()
    ended: dict[str, Any] = {}
    compiled_before = _compat.dynamo_counts()
    stopping.reset()
    try:
        launched = worker_environment(launch_environment(plan, os.environ), attempt=0, pid=None)
        # The caller's SIGTERM handler, which the function's on_stop replaces, is put back after.
        with stopping.caller_handler_kept(), overlay(launched), _deadline(plan.timeout, stack):
            result = function(*args)
        rank_exit = RankExit(rank=0, pid=pid, exitcode=0, returned=True)
        ended["result"] = to_cpu(result)
    except _Expired:
        stopping.run_callbacks()  # a stop like any other: the function's on_stop clean-up
        rank_exit = RankExit(rank=0, pid=pid, signals_sent=frozenset({signal.SIGALRM}),
                             stack="".join(stack))
        ended["timed_out"] = True
    except Exception as error:
        record = ProcessFailure.from_exception(error, rank=0, skip_frames=1)
        rank_exit = RankExit(rank=0, pid=pid, exitcode=1, record=record)
        ended["exception"] = error
    except KeyboardInterrupt:  # the stop button
        stopping.run_callbacks()
        raise
    finally:
        stopping.reset()  # nothing of this launch's function is kept
    measured = (RankReport(0, time.perf_counter() - started, peak_rss_bytes(),
                           **dynamo_since(compiled_before)),)
    return Outcome("inline", 1, (rank_exit,), timeout=plan.timeout, rank_reports=measured, **ended)


@contextlib.contextmanager
def _deadline(timeout: float | None, stack: list[str]) -> Iterator[None]:
    """Raise `_Expired` in this thread after ``timeout`` seconds, keeping its stack first.

    In the main thread a real signal is used, so a blocking call (sleep, a lock, I/O) is cut
    short too; other threads get an asynchronous exception at their next Python instruction.
    """
    if timeout is None:
        yield
        return
    caller = threading.get_ident()
    in_main = threading.current_thread() is threading.main_thread()
    done = threading.Event()

    def expire() -> None:
        if done.wait(timeout):
            return
        frame = sys._current_frames().get(caller)
        frames = traceback.format_stack(frame) if frame is not None else []
        own = [i for i, text in enumerate(frames) if __file__ in text]
        stack.extend(reversed(frames[own[-1] + 1 if own else 0:]))
        if in_main:
            signal.pthread_kill(caller, signal.SIGALRM)
        else:
            _compat.raise_in_thread(caller, _Expired)

    def on_alarm(signum: int, frame: Any) -> None:
        raise _Expired

    previous = signal.signal(signal.SIGALRM, on_alarm) if in_main else None
    watcher = threading.Thread(target=expire, name="xlaunch-timeout", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
        if in_main:
            signal.signal(signal.SIGALRM, previous)
