"""Clean-up when the launcher stops a worker: callbacks registered with `on_stop`.

Every stop (the launch's timeout, the stop button, a failed peer, a restart) sends each worker
SIGTERM, then SIGKILL once the launch's grace period (``stop_grace``) has passed. A worker that
wants to save a checkpoint registers a callback; it runs in the process's main thread when
SIGTERM arrives, after which the process ends of that signal, as it would have without one.

XLA replicas run in threads, where ``signal.signal`` raises: there the handler is installed in the
process's main thread when the process starts (`install_handler`), and each replica's callbacks
run there. Until a callback is registered, an elastic worker keeps the default action, so a stop
still ends a worker stuck inside a C++ collective at once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[[], Any])

_CALLBACKS: list[Callable[[], Any]] = []
_LOCK = threading.Lock()
_installed = False
# What the process says of itself when a stop reaches it (an XLA replica's "terminated" record:
# torch_xla's pool ends its processes with SIGTERM too, and the judge must tell the two apart).
_noted: Callable[[int], None] | None = None


def on_stop(callback: F) -> F:
    """Run ``callback()`` if the launcher stops this worker; usable as a decorator.

    Callbacks run newest first, each once, within the launch's ``stop_grace`` seconds.
    """
    if not callable(callback):
        raise TypeError(f"on_stop takes a callable, not {type(callback).__name__}")
    with _LOCK:
        _CALLBACKS.append(callback)
    if not _installed:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError(
                "on_stop: call it from this process's main thread (the function the launcher "
                "runs), where the stop signal can be handled")
        install_handler()
    return callback


def install_handler(note: Callable[[int], None] | None = None) -> None:
    """SIGTERM runs the callbacks (after ``note(signal)``), then ends the process of it; main
    thread only."""
    global _installed, _noted
    signal.signal(signal.SIGTERM, _stopped)
    _installed = True
    if note is not None:
        _noted = note


def reset() -> None:
    """Forget callbacks and the handler (a new worker process, or the end of an inline launch)."""
    global _installed, _noted
    with _LOCK:
        _CALLBACKS.clear()
    _installed = False
    _noted = None


@contextlib.contextmanager
def caller_handler_kept() -> Iterator[None]:
    """While the function runs in the caller's own process (a one-process launch): an `on_stop`
    (or the function's own ``signal.signal``) may replace the caller's SIGTERM handler; it is put
    back when the block ends, whatever happened, so a launch changes no handler of the caller.
    A handler that Python did not install (``getsignal`` is None) cannot be put back: left."""
    if threading.current_thread() is not threading.main_thread():
        yield  # no handler can be installed from another thread
        return
    previous = signal.getsignal(signal.SIGTERM)
    try:
        yield
    finally:
        if previous is not None and signal.getsignal(signal.SIGTERM) is not previous:
            signal.signal(signal.SIGTERM, previous)


def run_callbacks() -> None:
    """Run each registered callback once, newest first; one that fails does not stop the rest."""
    while True:
        with _LOCK:
            if not _CALLBACKS:
                return
            callback = _CALLBACKS.pop()
        try:
            callback()
        except BaseException:  # the stop goes on whatever a callback does
            print("xlaunch: an on_stop callback failed:", file=sys.stderr)
            traceback.print_exc()


def _stopped(signum: int, frame: Any) -> None:
    if _noted is not None:
        try:
            _noted(signum)
        except Exception:  # the stop goes on
            pass
    run_callbacks()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # the process ends of the signal it was sent
