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


# --- TorchTPU -----------------------------------------------------------------------------------
# torch-tpu 0.2.0, torch_tpu/_internal/distributed/distributed.py: set_tpu_launch_env() (marked
# experimental) writes its launch variables into os.environ, never overwriting one already set,
# and may write some before it raises ("expected TPU devices, got none"). Each value it generates
# is memoized in torch_tpu/_internal/env_utils.py ``_resolved_values`` and reused even after the
# variable is unset, so a second launch in the same process would get the first one's ports and
# topology; those entries are dropped before each call.
TPU_LAUNCH_VARS = ("TORCH_TPU_SLICEBUILDER_ADDRESSES", "TORCH_TPU_TOPOLOGY",
                   "TORCH_TPU_XPROF_SESSION_ID", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT")


def tpu_launch_env(nproc_per_node: int, nnodes: int | None = None,
                   preset: dict[str, str] | None = None) -> dict[str, str]:
    """The variables TorchTPU's ``set_tpu_launch_env`` computes for this launch.

    ``preset`` values are in place while it runs (it keeps them: NODE_RANK from GCE, the
    rendezvous host). ``os.environ`` is exactly as before afterwards, whether it returned or
    raised: the variables go to the workers, not into the caller.
    """
    import importlib

    importlib.import_module("torch_tpu")  # installs torch.tpu even with autoload turned off
    from torch.tpu import distributed  # type: ignore[attr-defined]

    saved = dict(os.environ)
    _forget_resolved(TPU_LAUNCH_VARS)
    try:
        os.environ.update(preset or {})
        with warnings.catch_warnings():
            # "<TorchTpu/ApiStage/ExperimentalApi/> set_tpu_launch_env is experimental": known.
            warnings.filterwarnings("ignore", message="<TorchTpu/ApiStage/")
            distributed.set_tpu_launch_env(nnodes=nnodes, nproc_per_node=nproc_per_node)
        return {name: value for name, value in os.environ.items() if saved.get(name) != value}
    finally:
        for name in [name for name in os.environ if name not in saved]:
            del os.environ[name]
        for name, value in saved.items():
            if os.environ.get(name) != value:
                os.environ[name] = value
        _forget_resolved(TPU_LAUNCH_VARS)


def _forget_resolved(names: tuple[str, ...]) -> None:
    module = sys.modules.get("torch_tpu._internal.env_utils")
    resolved = getattr(module, "_resolved_values", None)
    if not isinstance(resolved, dict):
        _loud("tpu-resolved", "torch_tpu._internal.env_utils._resolved_values is gone in this "
              "torch-tpu; a second launch in this process may reuse the first one's TorchTPU "
              "ports and topology")
        return
    for name in names:
        resolved.pop(name, None)


def load_device_backends() -> None:
    """torch's device-backend autoload, run late: every ``torch.backends`` entry point, loaded
    and called as torch/__init__.py ``_import_device_backends`` does (torch 2.5-2.13)."""
    from importlib.metadata import entry_points

    for backend in entry_points(group="torch.backends"):
        try:
            backend.load()()
        except Exception as error:
            raise RuntimeError(f"Failed to load the backend extension: {backend.name}. You can "
                               "disable extension auto-loading with "
                               "TORCH_DEVICE_BACKEND_AUTOLOAD=0.") from error


@dataclass(frozen=True)
class CacheStats:
    compiles: int
    hits: int
    compile_seconds: float | None = None


# torch-tpu 0.2.0, torch_tpu/_internal/device/_device_module.py: ``torch.tpu._get_cache_stats()``
# (private) returns the compilation cache's entries, each with ``num_compilations``,
# ``num_cache_hits`` and ``num_cache_reqs`` (CacheEntryStats); ``_get_cache_hits()`` and
# ``_get_cache_misses()`` give the totals. torch_tpu/_loader.py sets ``_LOADED`` once it set up
# the TPU device; asking the cache before the runtime runs would start it.


def tpu_cache_stats() -> CacheStats | None:
    """The compilation cache's counters, or None where TorchTPU's runtime does not run here."""
    loader = sys.modules.get("torch_tpu._loader")
    torch = sys.modules.get("torch")
    tpu = getattr(torch, "tpu", None)
    if loader is None or tpu is None or not getattr(loader, "_LOADED", False):
        return None
    is_initialized = getattr(tpu, "is_initialized", None)
    if is_initialized is None or not is_initialized():
        return None
    try:
        return _cache_stats(tpu)
    except Exception as error:  # a report never fails the training
        _loud("tpu-cache", f"torch.tpu's compilation cache counters could not be read ({error}); "
              "the report shows no compilations for TorchTPU")
        return None


def _cache_stats(tpu: Any) -> CacheStats | None:
    entries = tpu._get_cache_stats() if hasattr(tpu, "_get_cache_stats") else None
    if isinstance(entries, dict):
        entries = list(entries.values())
    if isinstance(entries, (list, tuple)) and all(hasattr(e, "num_compilations") for e in entries):
        seconds = None
        times: list[Any] = [getattr(entry, "compile_time", None) for entry in entries]
        if times and all(hasattr(t, "total_seconds") for t in times):
            seconds = sum(t.total_seconds() for t in times)
        return CacheStats(sum(int(e.num_compilations) for e in entries),
                          sum(int(e.num_cache_hits) for e in entries), seconds)
    if hasattr(tpu, "_get_cache_misses") and hasattr(tpu, "_get_cache_hits"):
        return CacheStats(int(tpu._get_cache_misses()), int(tpu._get_cache_hits()))
    _loud("tpu-cache-shape", "torch.tpu._get_cache_stats() returned an unknown shape in this "
          "torch-tpu; the report shows no compilations for TorchTPU")
    return None


# --- torch.compile (dynamo): what it compiled in this process -----------------------------------
# torch 2.4-2.13, torch/_dynamo/utils.py: ``counters`` (a defaultdict of Counters): "stats"
# "unique_graphs" (graphs captured), "frames" "ok" (frames compiled, recompilations included),
# "graph_break" (one key per break reason). torch/_dynamo/convert_frame.py:
# ``FRAME_COMPILE_COUNTER`` (frame id -> times that frame was compiled).


def dynamo_counts() -> dict[str, Any] | None:
    """torch.compile's running totals in this process; None where dynamo was never imported.

    ``per_frame`` maps each compiled frame to the times it was compiled, so the caller can tell
    recompilations in a stretch of the run (a frame compiled again) from first compilations.
    Read-only: never imports torch or dynamo (a worker that did not use torch.compile pays
    nothing).
    """
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return None
    counters = getattr(utils, "counters", None)
    if not isinstance(counters, dict):
        _loud("dynamo", "torch._dynamo.utils.counters is gone in this torch; the report no longer "
              "says what torch.compile compiled")
        return None
    frames = sys.modules.get("torch._dynamo.convert_frame")
    per_frame = getattr(frames, "FRAME_COMPILE_COUNTER", None)
    if frames is not None and not isinstance(per_frame, dict):
        _loud("dynamo-frames", "torch._dynamo.convert_frame.FRAME_COMPILE_COUNTER is gone in "
              "this torch; the report no longer counts torch.compile's recompilations")
    return {
        "graphs": int(counters.get("stats", {}).get("unique_graphs", 0)),
        "graph_breaks": int(sum(counters.get("graph_break", {}).values())),
        "frames": int(counters.get("frames", {}).get("ok", 0)),
        "per_frame": dict(per_frame) if isinstance(per_frame, dict) else {},
    }
