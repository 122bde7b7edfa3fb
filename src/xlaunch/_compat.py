"""Every use of another library's private API, in one place.

Each helper names the upstream file and version it follows. Where that private detail is missing
(a newer or older release changed it) the helper warns once, loudly, saying what no longer works,
instead of degrading without a word.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import os
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

_warned: set[str] = set()


def _loud(key: str, text: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"xlaunch: {text}", RuntimeWarning, stacklevel=3)


# --- multiprocessing: which processes a launch started, and which signals were sent to them -----
# CPython 3.10-3.13, Lib/multiprocessing/process.py: BaseProcess.start() adds the started process
# to the module-level set ``_children``; Process.terminate()/kill() send SIGTERM/SIGKILL.


@dataclass
class Child:
    """One process started during a launch, and every signal anyone in the launch sent it."""

    process: Any
    signals_sent: set[int] = field(default_factory=set)

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        try:
            return self.process.exitcode
        except ValueError:  # the process object was closed: its status is gone
            return None

    def send(self, number: int) -> None:
        """Signal this process, noting it first: a death by a signal we sent is not its own."""
        if self.exitcode is not None or has_ended(self.pid):
            return
        self.signals_sent.add(number)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, number)  # type: ignore[arg-type]


def has_ended(pid: int | None) -> bool:
    """Whether a child process has already ended, reaped or not, without reaping it.

    ``Process.exitcode`` says None while another thread is reaping the same process (the pool's
    own management thread does), so a signal sent then would be noted against a process that had
    already ended on its own.
    """
    if pid is None:
        return False
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped already
        return True
    except OSError:
        return False


def kill_and_reap(children: list[Child], within: float) -> None:
    """SIGKILL whatever of ``children`` still runs (noted as the launcher's), then reap them all."""
    for child in children:
        child.send(signal.SIGKILL)
    deadline = time.monotonic() + within
    for child in children:
        with contextlib.suppress(Exception):
            child.process.join(max(0.0, deadline - time.monotonic()))


class _RecordingSet(set):  # type: ignore[type-arg]
    """Stands in for multiprocessing's set of children, remembering every process started."""

    def __init__(self, existing: set[Any], started: list[Child]) -> None:
        super().__init__(existing)
        self.started = started

    def add(self, process: Any) -> None:
        child = Child(process)
        for name, number in (("terminate", signal.SIGTERM), ("kill", signal.SIGKILL)):
            original = getattr(process, name)

            def noted(original: Any = original, number: int = number) -> None:
                # A signal to a process already gone changes nothing.
                if child.exitcode is None and not has_ended(child.pid):
                    child.signals_sent.add(number)
                original()

            setattr(process, name, noted)
        self.started.append(child)
        super().add(process)


@contextlib.contextmanager
def recording_children() -> Iterator[list[Child]]:
    """Every process started in this block, in start order, with the signals sent to each."""
    import multiprocessing.process as mp_process

    started: list[Child] = []
    original = getattr(mp_process, "_children", None)
    if not isinstance(original, set):
        _loud("children", "multiprocessing.process._children is gone in this Python; a worker "
              "killed by a signal can no longer be told from one the launcher stopped")
        yield started
        return
    recorder = _RecordingSet(original, started)
    mp_process._children = recorder  # type: ignore[attr-defined]
    try:
        yield started
    finally:
        original.clear()
        original.update(recorder)
        mp_process._children = original  # type: ignore[attr-defined]


# --- torch_xla ----------------------------------------------------------------------------------
# torch_xla 2.x, torch_xla/csrc/init_python_bindings.cpp: _XLAC._xla_runtime_is_initialized()
# answers without initialising the runtime (every public query initialises it).


def xla_runtime_is_initialized() -> bool:
    """Whether this process already started the XLA runtime; never imports torch_xla."""
    torch_xla = sys.modules.get("torch_xla")
    if torch_xla is None:
        return False
    check = getattr(getattr(torch_xla, "_XLAC", None), "_xla_runtime_is_initialized", None)
    if check is None:
        _loud("xla-init", "torch_xla._XLAC._xla_runtime_is_initialized is missing in this "
              "torch_xla; an XLA device used before the launch is no longer detected")
        return False
    return bool(check())


# --- torch elastic ------------------------------------------------------------------------------
# torch 2.4-2.13, torch/distributed/elastic/agent/server/api.py (and launcher/api.py): with
# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 a c10d rendezvous over a file store does not start the
# TCPStore the agent would otherwise share with its workers.
SHARED_STORE_OFF = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"

# Loggers the engine writes each failure to at ERROR (torch 2.4-2.13); the LaunchError says it
# better, once.
ENGINE_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")


@contextlib.contextmanager
def engine_loggers_quiet() -> Iterator[None]:
    """Quiet each engine logger, not just the parent: its modules set their own levels.

    ``disabled`` rather than a level, which would clear every logger's cache at each launch.
    logging.Logger.manager.loggerDict is CPython's registry of loggers (Lib/logging/__init__.py).
    """
    registry = getattr(getattr(logging.Logger, "manager", None), "loggerDict", None)
    if not isinstance(registry, dict):
        _loud("loggers", "logging's logger registry is gone; the engine's own error logs will "
              "print beside the LaunchError")
        yield
        return
    loggers = [logger for name, logger in list(registry.items())
               if name.startswith(ENGINE_LOGGERS) and isinstance(logger, logging.Logger)]
    saved = [(logger, logger.disabled) for logger in loggers]
    for logger in loggers:
        logger.disabled = True
    try:
        yield
    finally:
        for logger, disabled in saved:
            logger.disabled = disabled


# torch 2.4-2.13, torch/distributed/elastic/multiprocessing/api.py: ``_wrap`` calls the entrypoint,
# puts its return value on ``ret_vals[local_rank]`` (a SimpleQueue, local ``ret_val_``) and then
# waits on ``queue_finished_reading_event`` until every worker has returned: a finished worker's
# process, and its sockets, stay alive meanwhile, so a peer waiting on it in a collective never
# sees it go. The caller reads each queue whatever state the worker's process is in.


def elastic_return_queue() -> Any:
    """The queue torch elastic's ``_wrap`` puts this worker's return value on; None if not found."""
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "_wrap" and code.co_filename.replace(os.sep, "/").endswith(
                "elastic/multiprocessing/api.py"):
            queue = frame.f_locals.get("ret_val_")
            if queue is not None and hasattr(queue, "put"):
                return queue
            break
        frame = frame.f_back  # type: ignore[assignment]
    _loud("elastic-wrap", "torch elastic's worker wrapper (_wrap, ret_val_) is not where it was; "
          "a worker that finishes now stays alive until its peers finish, so a peer waiting on "
          "it in a collective waits until the process group's timeout")
    return None


# CPython 3.10-3.13, Lib/multiprocessing/process.py: a process started by multiprocessing ends
# through BaseProcess._bootstrap, which joins non-daemon threads (threading._shutdown) and runs
# multiprocessing.util._exit_function (finalizers, daemonic children) before os._exit.


def end_like_a_process(code: int) -> NoReturn:
    """End this worker process at once, doing what a multiprocessing process does at its end."""
    current = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not current and not thread.daemon and thread.is_alive():
            thread.join()
    import multiprocessing.util as mp_util

    finish = getattr(mp_util, "_exit_function", None)
    if finish is None:
        _loud("mp-exit", "multiprocessing.util._exit_function is gone; a worker that finishes "
              "early no longer runs multiprocessing's finalizers")
    else:
        with contextlib.suppress(Exception):
            finish()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


# torch 2.4-2.13, torch/multiprocessing/spawn.py: when a worker fails, ProcessContext.join sends
# the others SIGTERM, waits ``_join_procs_with_timeout(30 if grace_period is None else ...)`` and
# only then SIGKILLs (process.kill()); torch elastic's MultiprocessContext calls join(-1) with no
# grace period, so a worker that ignores SIGTERM held every failed launch for 30 s.


@contextlib.contextmanager
def engine_join_grace(grace: float) -> Iterator[None]:
    """While the block runs, the engine's join waits at most ``grace`` s between SIGTERM and SIGKILL."""
    torch_spawn: Any = None
    with contextlib.suppress(ImportError):  # the module: the package's ``spawn`` is a function
        torch_spawn = importlib.import_module("torch.multiprocessing.spawn")
    context: Any = getattr(torch_spawn, "ProcessContext", None)
    original = getattr(context, "_join_procs_with_timeout", None)
    if original is None:
        _loud("join-grace", "torch.multiprocessing's ProcessContext._join_procs_with_timeout is "
              "gone; after a failure the engine may wait its own 30 s before SIGKILL")
        yield
        return

    def bounded(self: Any, timeout: float) -> None:
        original(self, min(timeout, grace))

    context._join_procs_with_timeout = bounded
    try:
        yield
    finally:
        context._join_procs_with_timeout = original


# --- CPython: an exception raised in another thread ---------------------------------------------
# CPython C API PyThreadState_SetAsyncExc (Include/ceval.h), through ctypes.pythonapi.


def raise_in_thread(thread_id: int, exception: type[BaseException]) -> bool:
    """Raise ``exception`` in ``thread_id`` at its next Python instruction; False if impossible."""
    setter = getattr(getattr(ctypes, "pythonapi", None), "PyThreadState_SetAsyncExc", None)
    if setter is None:
        _loud("async-exc", "PyThreadState_SetAsyncExc is not available in this Python; a timeout "
              "outside the main thread cannot interrupt the function")
        return False
    return bool(setter(ctypes.c_ulong(thread_id), ctypes.py_object(exception)))
