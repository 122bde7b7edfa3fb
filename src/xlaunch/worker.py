"""What every backend does inside a worker, and the files a launch leaves for its caller.

Workers report through a private per-launch directory rather than through pipes: a record written
before a worker exits survives however that worker then dies, its nanosecond timestamp says which
rank failed first, and a stack dumped by `faulthandler` lands there even when the worker is stuck
inside a C++ collective. The caller reads the directory once the engine is done and removes it.
"""

from __future__ import annotations

import faulthandler
import io
import json
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from .errors import ProcessFailure

STACK_SIGNAL = signal.SIGUSR1
CANCELLED_EXIT = 75  # a worker started after the launch was stopped exits at once with this
MIXED_PRECISION_VAR = "XLAUNCH_MIXED_PRECISION"
WORLD_VAR = "XLAUNCH_WORLD"  # "xla" inside XLA workers; tells ProcessState which world it is in


@dataclass(frozen=True)
class LaunchDir:
    """A private directory for one launch; ``attempt`` separates restarts of the workers."""

    path: str

    @classmethod
    def create(cls) -> LaunchDir:
        """A fresh directory named after this process; leftovers of dead launchers are swept.

        A launcher killed outright (SIGKILL, a kernel restart) cannot remove its directory; the
        next launch on the machine does, once the process that made it is gone.
        """
        for stale in Path(tempfile.gettempdir()).glob("xlaunch-*-*"):
            owner = stale.name.split("-")[1]
            if owner.isdigit() and not _process_exists(int(owner)):
                shutil.rmtree(stale, ignore_errors=True)
        return cls(tempfile.mkdtemp(prefix=f"xlaunch-{os.getpid()}-"))

    def attempt_path(self, attempt: int) -> Path:
        return Path(self.path) / f"attempt-{attempt}"

    def attempt_dir(self, attempt: int) -> Path:
        folder = self.attempt_path(attempt)
        folder.mkdir(exist_ok=True)
        return folder

    def latest_attempt(self) -> Path | None:
        attempts = sorted(Path(self.path).glob("attempt-*"), key=lambda p: int(p.name.split("-")[1]))
        return attempts[-1] if attempts else None

    @property
    def cancel_marker(self) -> Path:
        return Path(self.path) / "cancelled"

    def cancel(self) -> None:
        self.cancel_marker.touch()

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def worker_pids(attempt: Path) -> dict[int, int]:
    """rank -> pid of the workers that started in this attempt."""
    pids = {}
    for pid_file in attempt.glob("pid-*"):
        try:
            pids[int(pid_file.name[4:])] = int(pid_file.read_text())
        except (ValueError, OSError):
            continue
    return pids


def read_failures(attempt: Path | None) -> dict[int, ProcessFailure]:
    """The failure records workers wrote in one attempt, by rank."""
    records: dict[int, ProcessFailure] = {}
    if attempt is None:
        return records
    for record in attempt.glob("failure-*.json"):
        try:
            data = json.loads(record.read_text())
        except (OSError, ValueError):
            continue
        records[data["rank"]] = ProcessFailure(**data, error_file=str(record))
    return records


def read_stacks(attempt: Path) -> dict[int, str]:
    stacks = {}
    for stack_file in attempt.glob("stack-*"):
        try:
            stacks[int(stack_file.name[6:])] = _user_frames_first(stack_file.read_text())
        except (ValueError, OSError):
            continue
    return stacks


def dump_stacks(attempt: Path, pids: dict[int, int], wait: float = 2.0) -> dict[int, str]:
    """Ask each live worker for its Python stack (faulthandler) and collect what arrives."""
    asked = {}
    for rank, pid in pids.items():
        try:
            os.kill(pid, STACK_SIGNAL)
            asked[rank] = pid
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        stacks = read_stacks(attempt)
        if all(stacks.get(rank) for rank in asked):
            break
        time.sleep(0.02)
    return {rank: text for rank, text in read_stacks(attempt).items() if rank in asked}


class Worker:
    """The per-process side of a launch: set up, run the user's function, report."""

    def __init__(self, launch_dir: str, attempt: int, rank: int, world_size: int,
                 env: dict[str, str], prefix_output: bool) -> None:
        self.attempt = LaunchDir(launch_dir).attempt_dir(attempt)
        self.rank = rank
        self.world_size = world_size
        self.cancelled = LaunchDir(launch_dir).cancel_marker.exists()
        self._stack_file: IO[str] | None = None
        if self.cancelled:
            return
        os.environ.update(env)
        (self.attempt / f"pid-{rank}").write_text(str(os.getpid()))
        self._stack_file = open(self.attempt / f"stack-{rank}", "w")  # noqa: SIM115
        faulthandler.register(STACK_SIGNAL, file=self._stack_file, all_threads=True, chain=False)
        if prefix_output and world_size > 1:
            sys.stdout = PrefixedStream(sys.stdout, f"[rank {rank}] ")
            sys.stderr = PrefixedStream(sys.stderr, f"[rank {rank}] ")
        die_with_parent()
        if threading.current_thread() is threading.main_thread():
            # The stop button or Ctrl-C must end a worker at once, even inside a C++ collective;
            # handlers the launching process had installed mean nothing here.
            for number in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
                signal.signal(number, signal.SIG_DFL)

    def record_failure(self, error: BaseException, exitcode: int = 1,
                       skip_frames: int = 0) -> None:
        """Write what went wrong, before anything else can go wrong."""
        tb = error.__traceback__
        for _ in range(skip_frames):
            tb = tb.tb_next if tb is not None and tb.tb_next is not None else tb
        record = dict(
            rank=self.rank, pid=os.getpid(), exitcode=exitcode, exc_type=type(error).__qualname__,
            message=str(error), timestamp_ns=time.time_ns(),
            traceback="".join(traceback.format_exception(type(error), error, tb)),
        )
        target = self.attempt / f"failure-{self.rank}.json"
        partial = target.with_suffix(".tmp")
        partial.write_text(json.dumps(record))
        partial.replace(target)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - reporting must not fail on a closed stream
                pass

    def run(self, function: Any, args: tuple[Any, ...]) -> Any:
        """Call the function; a failure is recorded and turned into this process's exit status."""
        if self.cancelled:
            raise SystemExit(CANCELLED_EXIT)
        try:
            return function(*args)
        except SystemExit as stop:
            if stop.code in (0, None):
                return None
            code = stop.code if isinstance(stop.code, int) else 1
            self.record_failure(stop, exitcode=code, skip_frames=1)
            raise
        except KeyboardInterrupt:
            raise
        except BaseException as error:
            self.record_failure(error, skip_frames=1)  # this frame is ours, not the user's
            raise SystemExit(1) from None
        finally:
            for stream in (sys.stdout, sys.stderr):
                if isinstance(stream, PrefixedStream):
                    stream.flush()


def check_picklable(function: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Refuse, before anything starts, what ``spawn`` or ``forkserver`` could not send."""
    for what, value in (("function", function), ("args", args)):
        try:
            pickle.dumps(value)
        except Exception as error:  # noqa: BLE001
            name = getattr(function, "__qualname__", repr(function))
            raise TypeError(
                f"{name}: its {what} cannot be pickled, which start_method='spawn' needs "
                f"({error}). Functions defined in a notebook cannot be pickled: leave "
                "start_method at its default (fork), or move the function into a module."
            ) from None


def to_cpu(value: Any) -> Any:
    """Move tensors in a returned structure to the CPU so the caller can unpickle them."""
    torch = sys.modules.get("torch")
    if torch is None:
        return value
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)((key, to_cpu(item)) for key, item in value.items())
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(to_cpu(item) for item in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(item) for item in value)
    return value


class PrefixedStream(io.TextIOBase):
    """Prefixes each line, and writes whole lines, so ranks' output does not interleave mid-line.

    A carriage return also ends a piece, so a progress bar still redraws in place.
    """

    def __init__(self, stream: Any, prefix: str) -> None:
        self._stream = stream
        self._prefix = prefix
        self._pending = ""
        self._line_started = False  # part of the current line already went out (by a flush)

    def write(self, text: str) -> int:
        self._pending += text
        *complete, self._pending = re.split(r"(?<=[\r\n])", self._pending)
        if complete:
            self._stream.write("".join(self._start(piece) + piece for piece in complete))
            self._stream.flush()
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._stream.write(self._start(self._pending) + self._pending)
            self._pending = ""
            self._line_started = True
        self._stream.flush()

    def _start(self, piece: str) -> str:
        """The prefix this piece needs: none mid-line, none for a bare line end (a progress
        bar's leading carriage return, an empty print)."""
        prefix = "" if self._line_started or piece in ("\r", "\n") else self._prefix
        self._line_started = False
        return prefix

    def isatty(self) -> bool:
        return bool(getattr(self._stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        return int(self._stream.fileno())

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self._stream, "encoding", "utf-8"))

    def writable(self) -> bool:
        return True


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive, and not our directory to sweep
        return True
    return True


def die_with_parent() -> None:
    """Linux: end this worker if the process that started it dies (even by SIGKILL)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _user_frames_first(dump: str) -> str:
    """Keep the frames of the user's code: drop the launcher and engine frames below them."""
    kept = []
    for line in dump.splitlines():
        if f'"{__file__}"' in line:
            break
        if line.strip() and not line.startswith("Current thread"):
            kept.append(line)
    return "\n".join(kept)
