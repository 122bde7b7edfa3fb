"""What every backend does inside a worker: set up, run the user's function, report.

A worker writes its pid before it runs anything, so the caller can tell every rank's process even
when it dies at once, and writes its own record of an exception before it exits, so the caller
knows the rank raised rather than guessing from the order it noticed deaths in.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import faulthandler
import functools
import io
import os
import signal
import string
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any

from xlaunch import _compat, stopping
from xlaunch._compat import dynamo_counts
from xlaunch.result.errors import ProcessFailure
from xlaunch.worker import nested, process_tree
from xlaunch.worker.displays import DisplaySink, route_displays
from xlaunch.worker.hints import hint_for
from xlaunch.worker.launch_dir import (
    OUTPUT_LOCK,
    STACK_SIGNAL,
    LaunchDir,
    Mark,
    cancelled,
    note,
    record_failure,
    stack_path,
    write_pid,
)
from xlaunch.worker.measure import dynamo_since, write_rank_report
from xlaunch.worker.output import PrefixedStream, prefix_replica_thread, rebind_log_handlers
from xlaunch.worker.private import private_file
from xlaunch.worker.value import ValueNotSent, write_value

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)


@dataclass(frozen=True)
class WorkerSetup:
    """What every worker of a launch shares (forked to it, or pickled under ``spawn``)."""

    launch_dir: str
    # The launch's and the path's layers of every worker's environment (backends/environment.py)
    launch_env: Mapping[str, str | None] = field(default_factory=dict)
    line_prefix: str | None = None  # a template (${rank}, ${local_rank}); None: no prefix
    prefix_single: bool = False  # prefix even when the world is one process (a user template)
    tree: process_tree.TreeTicket | None = None
    # A kernel's forked workers: each local rank's socket to the caller for what it displays
    display_fds: tuple[int, ...] | None = None
    # Replicas that are threads of one process (v2/v3): each prefixes its own thread's lines
    threads_share_streams: bool = False


class Worker:
    """The per-process side of a launch."""

    def __init__(self, setup: WorkerSetup, attempt: int, rank: int, local_rank: int,
                 world_size: int) -> None:
        process_tree.join(setup.tree)
        launch_dir = self.launch_dir = LaunchDir(setup.launch_dir)
        self.folder = launch_dir.attempt_path(attempt)  # made by the caller
        self.rank = rank
        self.cancelled = cancelled(self.folder)
        # Before the pid is written: the owner asks for stacks only of a rank whose pid it has
        # read, and STACK_SIGNAL would end a process that had no handler for it.
        self._stack_file: IO[str] = open(private_file(stack_path(self.folder, rank)), "w")
        faulthandler.register(STACK_SIGNAL, file=self._stack_file, all_threads=True, chain=False)
        write_pid(self.folder, rank, local_rank)
        if self.cancelled:
            note(self.folder, Mark.CANCELLED, rank)
            return
        not_interactive()
        nested.refuse_launchers()
        sink = route_displays(setup.display_fds, local_rank, rank)
        own_streams(setup, launch_dir, sink, rank, local_rank, world_size)
        die_with_parent()
        if threading.current_thread() is threading.main_thread():
            # The stop button or Ctrl-C must end a worker at once, even inside a C++ collective;
            # handlers the launching process had installed mean nothing here.
            for number in STOP_SIGNALS:
                signal.signal(number, signal.SIG_DFL)
            stopping.reset()  # callbacks come from this worker's function, not the caller's

    def record_failure(self, error: BaseException, exitcode: int = 1, skip_frames: int = 0) -> None:
        """Write what went wrong, before anything else can go wrong."""
        try:
            failure = ProcessFailure.from_exception(error, rank=self.rank, exitcode=exitcode,
                                                    skip_frames=skip_frames)
        except Exception as broken:  # the record must be written whatever happens
            failure = ProcessFailure(rank=self.rank, pid=os.getpid(), exitcode=exitcode,
                                     exc_type=type(error).__qualname__, timestamp_ns=time.time_ns(),
                                     message=f"(it could not be described: {type(broken).__name__})")
        try:
            hint = hint_for(error)
        except Exception:
            hint = None
        if hint is not None:
            failure = dataclasses.replace(failure, message=f"{failure.message}. {hint}",
                                          traceback=f"{failure.traceback}hint: {hint}\n")
        record_failure(self.folder, failure)
        flush_output()

    def run(self, function: Callable[..., Any], args: tuple[Any, ...],
            measure: Callable[[], Mapping[str, Any]] | None = None, send: bool = False) -> None:
        """Call the function; a failure is recorded and turned into this process's exit status.

        Whichever way it ends, the rank then reports its wall time and peak memory, plus what
        ``measure`` adds (the XLA metrics on that path). ``send``: this rank's value goes back to
        the caller (local rank 0's). The rank says its function returned only once its value is
        sent whole: a rank that dies while sending failed, it did not return.
        """
        if self.cancelled:
            raise SystemExit(0)  # its record says it ran nothing
        started = time.perf_counter()
        compiled_before = dynamo_counts()
        try:
            result = function(*args)
        except SystemExit as stop:
            if stop.code not in (0, None):
                code = stop.code if isinstance(stop.code, int) else 1
                self.record_failure(stop, exitcode=code, skip_frames=1)
                raise
            result = None
        except BaseException as error:  # KeyboardInterrupt too: torch's wrapper makes it exit 0
            self.record_failure(error, skip_frames=1)  # this frame is ours, not the user's
            raise SystemExit(1) from None
        finally:
            self._report(time.perf_counter() - started, measure, compiled_before)
            flush_output()
        if send:
            self.send_back(result)
        note(self.folder, Mark.RETURNED, self.rank)

    def _report(self, wall_seconds: float, measure: Callable[[], Mapping[str, Any]] | None,
                compiled_before: Mapping[str, Any] | None) -> None:
        try:
            extra = {**dynamo_since(compiled_before), **(measure() if measure is not None else {})}
            write_rank_report(self.folder, self.rank, wall_seconds, extra)
        except Exception as error:  # a report must never fail the training
            print(f"xlaunch: rank {self.rank} could not write its report: {error}", file=sys.stderr)

    def send_back(self, result: Any) -> None:
        """The result, moved to the CPU, to the caller; or this rank's failure if it cannot go."""
        note(self.folder, Mark.SENDING, self.rank)
        try:
            write_value(self.launch_dir, self.folder, result)
        except ValueNotSent as error:  # no room anywhere: the error names the file systems
            self.record_failure(error)
            raise SystemExit(1) from None
        except Exception as error:  # reported as this rank's failure
            self.record_failure(TypeError(
                f"the function returned a value that cannot be sent back to the caller "
                f"({type(result).__name__}): {error}"))
            raise SystemExit(1) from None


def own_streams(setup: WorkerSetup, launch_dir: LaunchDir, sink: DisplaySink | None, rank: int,
                local_rank: int, world_size: int) -> None:
    """This worker's ``sys.stdout`` and ``sys.stderr``: each line prefixed with its rank (more
    than one rank, or a template the user gave), and, in a kernel's forked worker (``sink``),
    sent to the caller, which folds and shows them and keeps each rank's last line for the live
    view (a single replica's too, unprefixed). Replicas that are threads of one process each
    prefix their own thread's lines."""
    prefixed = setup.line_prefix is not None and (world_size > 1 or setup.prefix_single)
    if not prefixed and sink is None:
        return
    prefix = string.Template(setup.line_prefix or "").safe_substitute(
        rank=rank, local_rank=local_rank, role_name="default") if prefixed else ""
    lock = os.path.join(launch_dir.folder, OUTPUT_LOCK)  # every rank of the launch's
    caller = {id(sys.stdout): "stdout", id(sys.__stdout__): "stdout",
              id(sys.stderr): "stderr", id(sys.__stderr__): "stderr"}
    if setup.threads_share_streams:
        replaced = prefix_replica_thread(prefix, lock)
    else:
        replaced = True
        live = sink.live_line if sink is not None else None
        sys.stdout = PrefixedStream(sys.stdout, prefix, lock, live,
                                    sink.lines("stdout") if sink is not None else None)
        sys.stderr = PrefixedStream(sys.stderr, prefix, lock, live,
                                    sink.lines("stderr") if sink is not None else None)
    # Handlers made before the launch (a notebook's basicConfig) hold the caller's stream: in
    # this worker they write through the prefixed one.
    if replaced:
        rebind_log_handlers({key: getattr(sys, name) for key, name in caller.items()})


NO_STDIN = ("xlaunch workers have no stdin: input() cannot be answered from a worker. Read the "
            "value before the launch and pass it to the function in args")


class _NoStdin(io.TextIOBase):
    """A worker's stdin: reading it fails at once, saying why (a forked notebook worker would
    otherwise ask the notebook's frontend and wait forever)."""

    def readable(self) -> bool:
        return True

    def read(self, size: int | None = -1) -> str:
        raise EOFError(NO_STDIN)

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]
        raise EOFError(NO_STDIN)


def _no_input(prompt: object = "") -> str:
    raise EOFError(NO_STDIN)


def not_interactive() -> None:
    """A worker is not an interactive session: no stdin, no prompt (``sys.ps1``, which a kernel
    sets and libraries read as "in a notebook": Lightning then refuses its ``ddp``)."""
    if isinstance(sys.stdin, _NoStdin):
        return
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
    sys.stdin = _NoStdin()
    builtins.input = _no_input
    for name in ("ps1", "ps2"):
        if hasattr(sys, name):
            delattr(sys, name)
    _compat.lightning_in_a_worker()


@contextlib.contextmanager
def native_stdout_to_stderr() -> Iterator[None]:
    """While the group forms, what native code writes to stdout goes to stderr: gloo on torch 2.8
    prints a line per group there (C stdio), which would land in ``xlaunch check --json``'s output
    or a script's own. The worker's stdout is its own again afterwards."""
    flush_output()
    c_library = libc()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        if c_library is not None:
            c_library.fflush(None)  # what C stdio holds goes out now, to stderr
        os.dup2(saved, 1)
        os.close(saved)


def flush_output() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # reporting must not fail on a closed stream
            pass


def check_picklable(function: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Refuse, before anything starts, what ``spawn`` or ``forkserver`` could not send.

    The function and its arguments travel by value (cloudpickle): functions and closures defined
    in a notebook cell go too. What cloudpickle cannot carry either (a lock, an open file, a
    socket, a generator) is refused here, naming the function.
    """
    for what, value in (("function", function), ("args", args)):
        try:
            by_value(value)
        except Exception as error:
            name = getattr(function, "__qualname__", repr(function))
            raise TypeError(
                f"{name}: its {what} cannot be sent to spawned workers, even by value with "
                f"cloudpickle ({error}). Pass only what can be pickled (not a lock, an open file, "
                "a socket or a generator; create those inside the function), or leave "
                "start_method at its default (fork)."
            ) from None


def by_value(value: Any) -> bytes:
    """``value`` pickled by value where plain pickle would name it (notebook functions)."""
    import cloudpickle

    return cloudpickle.dumps(value)


def die_with_parent() -> None:
    """Linux: end this process if the thread that started it ends (even by SIGKILL)."""
    c_library = libc()
    if c_library is not None:
        pr_set_pdeathsig = 1
        c_library.prctl(pr_set_pdeathsig, signal.SIGKILL)


@functools.lru_cache(maxsize=1)
def libc() -> Any:
    """The C library, loaded once (in the caller: forked workers find it loaded)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


libc()  # loaded here, once: every forked worker then has it at hand
