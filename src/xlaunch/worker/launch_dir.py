"""The private place each launch keeps everything its workers send back.

Workers report through files rather than pipes: a record written before a worker exits survives
however that worker then dies, and a stack dumped by `faulthandler` lands there even when the
worker is stuck inside a C++ collective. Each launch has one folder of a random name, in shared
memory (``/dev/shm``, a tmpfs: a file made or removed there costs microseconds, where a disk's
folder cost up to 2 ms to remove here) or, where shared memory cannot be had, in the temporary
directory: its records, failures, stacks, pids and marks, and the bytes of a returned value
(`worker.value`). The bytes shared memory has no room for go to a folder of the same name in the
temporary directory, made only then (`LaunchDir.spill`). Every folder is created exclusively, 0700
whatever the umask, and every file in them is created exclusively (never one that exists, never
through a symlink), 0600: no other user can read, replace or redirect anything a worker sends
back, at any moment. The caller reads them once the workers are done and removes them; a
failure's whole text, when its record had to be cut, moves to the user's own cache folder
(`keep_whole_text`, bounded).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import shutil
import signal
import stat
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from xlaunch.names import POLL_S
from xlaunch.result.errors import ProcessFailure
from xlaunch.result.report import RankReport
from xlaunch.worker.frames import user_frames_first
from xlaunch.worker.private import (
    KEPT_TEXT_BYTES,
    atomic_write,
    keep_whole_text,
    private_dir,
    private_file,
    write_private,
)

PREFIX = "xlaunch-"
SHARED_MEMORY = Path("/dev/shm")  # where a launch keeps its folder, where it can
# What the launch's owner (backends/processes.py) sends a live rank at a timeout: the rank's
# faulthandler (worker/rank.py) writes every thread's stack into the launch folder.
STACK_SIGNAL = signal.SIGUSR1
STACKS_WAIT_S = 2.0  # at a timeout: the longest the asked workers' stacks are waited for

# --- the protocol: every name in a launch's folders, here and nowhere else ---------------------
# In the launch's folder:
OUTPUT_LOCK = "output.lock"  # each rank's prefixed stream writes a line under its lock (made
# with the folder; workers only open it)
XLA_DEBUG = "xla-debug"  # torch_xla's compilation analysis, a file per process (".<pid>")
ATTEMPT = "attempt-{}"  # a folder per attempt, holding what its workers left:
CANCELLED = "attempt.cancelled"  # the attempt was stopped: a worker that starts now runs nothing
PID = "pid-{}"  # by rank: "<pid> <local rank>", written before the rank runs anything
FAILURE = "failure-{}.json"  # by rank: its exception (a `ProcessFailure`), bounded
FAILURE_TEXT = "failure-{}.txt"  # by rank: that record's whole text, when it had to be cut
STACK = "stack-{}"  # by rank: every thread's stack, when the owner asks (STACK_SIGNAL)
CRASH = "crash-{}"  # by pid: an XLA process's dump at a fatal signal
REPORT = "report-{}.json"  # by rank: its `RankReport`
LEADER_FAILURE = "leader.json"  # what failed in the XLA launch leader before any replica ran
GROUP_STORE = "group-store"  # the FileStore a one-machine group meets through (made private first)
SCRIPT_GROUP_STORE = "script-group-{}"  # by call: the FileStore a script's own group meets
# through (`worker.script`: its ``init_process_group``), made private first by one of its ranks
RESULT = "value.record"  # local rank 0's value: its record, committed last (worker/value.py)
VALUE = "{}-value-{}"  # by attempt and index: each large buffer of that value (in the attempt's
# folder, or in the launch's folder in shared memory)


class Mark:
    """What a worker states about itself, as an empty file ``<mark>-<number>`` (`note`)."""

    RETURNED = "returned"  # by rank: its function returned, and its value (if any) was sent whole
    SENDING = "sending"  # by rank: it began to send its value back
    CANCELLED = "cancelled"  # by rank: it found the launch stopped and ran nothing
    TERMINATED = "terminated"  # by pid: its process received SIGTERM
    BEGAN = "began"  # by pid: an engine's process began (known even if it dies at once)


@dataclass(frozen=True)
class LaunchDir:
    """One launch's directory; ``attempt-N`` folders separate restarts of the workers."""

    folder: str

    @classmethod
    def create(cls) -> LaunchDir:
        """A fresh folder named after this process and a random name, in shared memory where it
        can be made there, else in the temporary directory; the first launch of a process sweeps
        the leftovers of dead launchers first.

        Created exclusively: a name another user took first is given up for another. A launcher
        killed outright (SIGKILL, a kernel restart) cannot remove its folders; the next process
        of the same user to launch does, once the process that made them is gone.
        """
        temp = Path(tempfile.gettempdir())
        _sweep_once(temp)
        # Shared memory with next to no room (a container's 64 MiB, filled) would fail the
        # first record a worker writes: the temporary directory serves then.
        bases = (SHARED_MEMORY, temp) if _free(SHARED_MEMORY) >= SHARED_ROOM_NEEDED else (temp,)
        for _ in range(_NAME_TRIES):
            name = f"{PREFIX}{os.getpid()}-{_pid_namespace()}-{os.urandom(6).hex()}"
            for base in bases:
                try:
                    private_dir(base / name)
                except FileExistsError:
                    break  # another name
                except OSError:  # no shared memory here (or not ours to write)
                    continue
                # Made here, with the folder: workers open it, never create it (`output`).
                os.close(private_file(base / name / OUTPUT_LOCK))
                return cls(str(base / name))
        raise FileExistsError(errno.EEXIST, f"no free name for a launch folder in {temp} after "
                              f"{_NAME_TRIES} tries")

    @classmethod
    @contextlib.contextmanager
    def made(cls) -> Iterator[LaunchDir]:
        """`create`, for a launch whose set-up follows: removed again if that set-up raises (a
        launch that runs removes it at its end, `supervise.run_launch`)."""
        launch_dir = cls.create()
        try:
            yield launch_dir
        except BaseException:
            launch_dir.remove()
            raise

    def spill(self, make: bool = False) -> Path | None:
        """The folder on disk for a value's bytes that shared memory has no room for: the
        temporary directory's folder of this launch's name, made (exclusively) when ``make``.
        None where the launch's folder is on disk already, or where that name is not this
        user's own private folder (another user made it first)."""
        if Path(self.folder).parent != SHARED_MEMORY:
            return None
        folder = Path(tempfile.gettempdir()) / Path(self.folder).name
        if make:
            with contextlib.suppress(FileExistsError):
                private_dir(folder)
        try:
            info = folder.lstat()
        except OSError:
            return None
        if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
                or info.st_mode & 0o077):
            return None
        return folder

    def attempt_path(self, attempt: int) -> Path:
        return Path(self.folder) / ATTEMPT.format(attempt)

    def newest_attempt(self) -> Path | None:
        """The launch's newest attempt folder (a restart starts another), if any yet."""
        head, _ = ATTEMPT.split("{}")
        numbers = [int(name[len(head):]) for name in _listed(Path(self.folder))
                   if name.startswith(head) and name[len(head):].isdigit()]
        return self.attempt_path(max(numbers)) if numbers else None

    def attempt_dir(self, attempt: int) -> Path:
        """The attempt's folder, made (by the caller, before any of its workers starts)."""
        folder = self.attempt_path(attempt)
        private_dir(folder)
        return folder

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        spill = self.spill()
        if spill is not None:  # the bytes of a value nobody took (a failed launch's)
            shutil.rmtree(spill, ignore_errors=True)


_NAME_TRIES = 100
SHARED_ROOM_NEEDED = 16 * 2**20  # free in shared memory for a launch's folder to be made there


def _free(folder: Path) -> int:
    try:
        room = os.statvfs(folder)
    except OSError:
        return 0
    return room.f_bavail * room.f_frsize


def _pid_namespace() -> str:
    """This process's pid namespace, in a launch folder's name: a sweep judges a launcher gone
    only by a pid of its own namespace (containers may share /dev/shm and a user id)."""
    try:
        return os.readlink("/proc/self/ns/pid").strip("pid:[]")
    except OSError:
        return "0"
_SWEPT: set[Path] = set()  # the temporary directories this process swept


def _sweep_once(temp: Path) -> None:
    """A launcher that died leaves its folders; a process's first launch removes them. (Later
    ones find none that this process could have left: it is alive.)"""
    if temp not in _SWEPT:
        _SWEPT.add(temp)
        sweep_stale(temp, SHARED_MEMORY)


def sweep_stale(temp: Path, shared: Path | None = None) -> None:
    """Remove launch folders this user owns whose launcher process is gone, in the temporary
    directory and in shared memory."""
    uid, namespace = os.getuid(), _pid_namespace()
    for folder in (temp, shared):
        for stale in folder.glob(f"{PREFIX}*-*") if folder is not None else ():
            owner, *rest = stale.name[len(PREFIX):].split("-")
            try:
                info = stale.lstat()
            except OSError:
                continue
            if len(rest) > 1 and rest[0] != namespace:  # another pid namespace's: not judged
                continue
            if info.st_uid != uid or not owner.isdigit() or _process_exists(int(owner)):
                continue
            if stat.S_ISDIR(info.st_mode):
                shutil.rmtree(stale, ignore_errors=True)
            elif stat.S_ISREG(info.st_mode):  # a value's bytes, as releases before 0.2 left them
                with contextlib.suppress(OSError):
                    stale.unlink()


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def write_pid(attempt_dir: Path, rank: int, local_rank: int) -> None:
    # One small write; a reader that finds it half-written skips it (worker_places).
    write_private(attempt_dir / PID.format(rank), f"{os.getpid()} {local_rank}")


def worker_pids(attempt_dir: Path) -> dict[int, int]:
    """rank -> pid of the workers that started in this attempt."""
    return {rank: pid for rank, (pid, _) in worker_places(attempt_dir).items()}


def worker_places(attempt_dir: Path) -> dict[int, tuple[int, int]]:
    """rank -> (pid, local rank) of the workers that started in this attempt."""
    places = {}
    for rank, pid_file in _numbered(attempt_dir, PID):
        try:
            pid, local_rank = pid_file.read_text().split()
            places[rank] = (int(pid), int(local_rank))
        except (ValueError, OSError):
            continue
    return places


def cancel(attempt_dir: Path) -> None:
    """Mark the attempt stopped: a worker of it that starts from now on runs nothing (a restart's
    attempt is a new one, not stopped)."""
    with contextlib.suppress(FileExistsError):
        os.close(private_file(attempt_dir / CANCELLED))


def cancelled(attempt_dir: Path) -> bool:
    return (attempt_dir / CANCELLED).exists()


def note(attempt_dir: Path, mark: str, number: int) -> None:
    """A fact a worker states about itself (a `Mark`), as an empty file named for it."""
    with contextlib.suppress(FileExistsError):  # said before: once is enough
        os.close(private_file(attempt_dir / f"{mark}-{number}"))


def settled(attempt_dir: Path) -> frozenset[int]:
    """The ranks whose function has returned (its value sent) or raised, as their files say now:
    read at a timeout, before anything is stopped, they are the ranks the timeout did not cut."""
    return noted(attempt_dir, Mark.RETURNED) | {rank for rank, _ in _numbered(attempt_dir, FAILURE)}


def noted(attempt_dir: Path, mark: str) -> frozenset[int]:
    """The numbers a `Mark` was noted for in this attempt."""
    return frozenset(number for number, _ in _numbered(attempt_dir, mark))


def written_at(attempt_dir: Path, name: str) -> dict[int, float]:
    """number -> when its file was written, of the files named ``name`` (a `Mark`, or a pattern
    such as `PID`) in this attempt."""
    times = {}
    for number, file in _numbered(attempt_dir, name):
        with contextlib.suppress(OSError):
            times[number] = file.stat().st_mtime
    return times


def failed_any(attempt_dir: Path) -> bool:
    """Whether some rank of this attempt has recorded a failure."""
    return any(True for _ in _numbered(attempt_dir, FAILURE))


def _listed(folder: Path) -> list[str]:
    try:
        return os.listdir(folder)
    except OSError:
        return []


def _numbered(attempt_dir: Path, name: str) -> list[tuple[int, Path]]:
    """The files of ``attempt`` named ``name`` (a pattern of the protocol, or a `Mark`) with
    their number."""
    head, tail = name.split("{}") if "{}" in name else (f"{name}-", "")
    found = []
    with contextlib.suppress(OSError), os.scandir(attempt_dir) as entries:
        for entry in entries:
            number = entry.name[len(head):len(entry.name) - len(tail)]
            if (entry.name.startswith(head) and entry.name.endswith(tail) and number.isdigit()
                    and len(entry.name) > len(head) + len(tail)):
                found.append((int(number), Path(entry.path)))
    return found


def record_failure(attempt_dir: Path, failure: ProcessFailure) -> None:
    """The record, its message and traceback bounded; the whole text beside it when cut."""
    failure, whole = failure.bounded()
    if whole is not None:  # as much as is kept of it (shared memory is memory); the record says
        with contextlib.suppress(OSError):  # the most, and is written whatever happens here
            atomic_write(attempt_dir / FAILURE_TEXT.format(failure.rank), whole[:KEPT_TEXT_BYTES + 1])
    atomic_write(attempt_dir / FAILURE.format(failure.rank), failure.to_json())


def read_failures(attempt_dir: Path | None) -> dict[int, ProcessFailure]:
    """The failure records workers wrote in one attempt, by rank."""
    records: dict[int, ProcessFailure] = {}
    if attempt_dir is None:
        return records
    for rank, file in _numbered(attempt_dir, FAILURE):
        try:
            record = ProcessFailure.from_json(file.read_text(), error_file=str(file))
        except (OSError, ValueError, TypeError):
            continue
        whole = keep_whole_text(attempt_dir / FAILURE_TEXT.format(rank), record.rank)
        records[record.rank] = dataclasses.replace(record, full_text=whole) if whole else record
    return records


# faulthandler's words for each fatal signal it catches.
CRASHES = {"Segmentation fault": signal.SIGSEGV, "Aborted": signal.SIGABRT,
           "Bus error": signal.SIGBUS, "Floating point exception": signal.SIGFPE,
           "Illegal instruction": signal.SIGILL}


def read_crashes(attempt_dir: Path) -> dict[int, tuple[int, str]]:
    """pid -> (the fatal signal, faulthandler's dump) of each process that wrote one."""
    crashes = {}
    for pid, crash_file in _numbered(attempt_dir, CRASH):
        try:
            text = crash_file.read_text(errors="replace")
        except OSError:
            continue
        for words, number in CRASHES.items():
            if f"Fatal Python error: {words}" in text:
                crashes[pid] = (int(number), text.strip())
    return crashes


def stack_path(attempt_dir: Path, rank: int) -> Path:
    """Where rank ``rank``'s stack is written when the owner asks for it."""
    return attempt_dir / STACK.format(rank)


def read_stacks(attempt_dir: Path) -> dict[int, str]:
    stacks = {}
    for rank, stack_file in _numbered(attempt_dir, STACK):
        try:
            stacks[rank] = user_frames_first(stack_file.read_text())
        except OSError:
            continue
    return stacks


def collect_stacks(attempt_dir: Path, ranks: list[int], wait: float = STACKS_WAIT_S) -> dict[int, str]:
    """The stacks the ``ranks`` asked (by the launch's owner) wrote. The owner returns once the
    kernel says each dump is whole and its file has grown (`ProcessSet.ask_stacks`); where it
    cannot say, a file with text in it is waited for here, up to ``wait``."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        stacks = read_stacks(attempt_dir)
        if all(stacks.get(rank) for rank in ranks):
            break
        time.sleep(POLL_S)
    return {rank: text for rank, text in read_stacks(attempt_dir).items() if rank in ranks}


def read_rank_reports(attempt_dir: Path | None) -> list[RankReport]:
    """The reports of one attempt; of replicas sharing a process, the lowest rank's."""
    if attempt_dir is None:
        return []
    by_pid: dict[int, RankReport] = {}
    for _, file in _numbered(attempt_dir, REPORT):
        try:
            record = json.loads(file.read_text())
            pid, report = int(record["pid"]), RankReport.from_json(json.dumps(record["report"]))
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if pid not in by_pid or report.rank < by_pid[pid].rank:
            by_pid[pid] = report
    return sorted(by_pid.values(), key=lambda report: report.rank)
