"""The private directory each launch keeps its workers' reports in.

Workers report through files rather than pipes: a record written before a worker exits survives
however that worker then dies, and a stack dumped by `faulthandler` lands there even when the
worker is stuck inside a C++ collective. The directory is made 0700 by this user, so nothing
another local user writes can be read back as a report; the caller reads it once the workers are
done and removes it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import stat
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from xlaunch.result.errors import ProcessFailure
from xlaunch.result.report import RankReport

PREFIX = "xlaunch-"
SHARED_MEMORY = Path("/dev/shm")  # where a returned value's bytes may go (worker/value.py)
# What the launch's owner (backends/processes.py) sends a live rank at a timeout: the rank's
# faulthandler (worker/rank.py) writes every thread's stack into the launch folder.
STACK_SIGNAL = signal.SIGUSR1
STACKS_POLL_S = 0.02  # how often collect_stacks looks for the stacks it asked for
STACKS_WAIT_S = 2.0  # at a timeout: the longest the asked workers' stacks are waited for


def atomic_write(file: Path, data: str | bytes) -> None:
    """Write ``file`` so a reader sees the whole content or nothing, never half of it."""
    partial = file.with_name(file.name + ".partial")
    if isinstance(data, bytes):
        partial.write_bytes(data)
    else:
        partial.write_text(data)
    partial.replace(file)


@dataclass(frozen=True)
class LaunchDir:
    """One launch's directory; ``attempt-N`` folders separate restarts of the workers."""

    folder: str

    @classmethod
    def create(cls) -> LaunchDir:
        """A fresh directory named after this process; leftovers of dead launchers are swept.

        A launcher killed outright (SIGKILL, a kernel restart) cannot remove its directory; the
        next launch by the same user does, once the process that made it is gone.
        """
        sweep_stale(Path(tempfile.gettempdir()), SHARED_MEMORY)
        return cls(tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-"))

    def attempt_path(self, attempt: int) -> Path:
        return Path(self.folder) / f"attempt-{attempt}"

    def attempt_dir(self, attempt: int) -> Path:
        folder = self.attempt_path(attempt)
        folder.mkdir(exist_ok=True)
        return folder

    def attempts(self) -> list[Path]:
        """Every attempt's folder, oldest first."""
        found = Path(self.folder).glob("attempt-*")
        return sorted(found, key=lambda p: int(p.name.split("-")[1]))

    def latest_attempt(self) -> Path | None:
        attempts = self.attempts()
        return attempts[-1] if attempts else None

    @property
    def cancel_marker(self) -> Path:
        return Path(self.folder) / "cancelled"

    def cancel(self) -> None:
        self.cancel_marker.touch()

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        for left in SHARED_MEMORY.glob(f"{Path(self.folder).name}-*"):  # a value's bytes
            with contextlib.suppress(OSError):
                left.unlink()


def sweep_stale(temp: Path, shared: Path | None = None) -> None:
    """Remove launch directories this user owns whose launcher process is gone, and the bytes
    of values their workers left in shared memory."""
    uid = os.getuid()
    for folder, kind in ((temp, stat.S_ISDIR), (shared, stat.S_ISREG)):
        for stale in folder.glob(f"{PREFIX}*-*") if folder is not None else ():
            owner = stale.name[len(PREFIX):].split("-")[0]
            try:
                info = stale.lstat()
            except OSError:
                continue
            if (info.st_uid != uid or not kind(info.st_mode) or not owner.isdigit()
                    or _process_exists(int(owner))):
                continue
            if kind is stat.S_ISDIR:
                shutil.rmtree(stale, ignore_errors=True)
            else:
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


def write_pid(attempt: Path, rank: int, local_rank: int) -> None:
    # One small write; a reader that finds it half-written skips it (worker_places).
    (attempt / f"pid-{rank}").write_text(f"{os.getpid()} {local_rank}")


def worker_pids(attempt: Path) -> dict[int, int]:
    """rank -> pid of the workers that started in this attempt."""
    return {rank: pid for rank, (pid, _) in worker_places(attempt).items()}


def worker_places(attempt: Path) -> dict[int, tuple[int, int]]:
    """rank -> (pid, local rank) of the workers that started in this attempt."""
    places = {}
    for pid_file in attempt.glob("pid-*"):
        try:
            pid, local_rank = pid_file.read_text().split()
            places[int(pid_file.name[4:])] = (int(pid), int(local_rank))
        except (ValueError, OSError):
            continue
    return places


def note(attempt: Path, what: str, number: int) -> None:
    """A fact a worker states about itself (`MARKS`), as an empty file named for it."""
    (attempt / f"{what}-{number}").touch()


# What a worker says of itself: its function returned (by rank); it found the launch stopped
# and ran nothing (by rank); its process received SIGTERM (by pid); its process began (by pid,
# before anything else: an engine's processes are known by it even if they die at once).
MARKS = ("returned", "cancelled", "terminated", "process")


def noted(attempt: Path, what: str) -> frozenset[int]:
    prefix = f"{what}-"
    return frozenset(int(mark.name[len(prefix):]) for mark in attempt.glob(f"{prefix}*")
                     if mark.name[len(prefix):].isdigit())


def record_failure(attempt: Path, failure: ProcessFailure) -> None:
    """The record, its message and traceback bounded; the whole text beside it when cut."""
    failure, whole = failure.bounded()
    if whole is not None:
        atomic_write(attempt / f"failure-{failure.rank}.txt", whole)
    atomic_write(attempt / f"failure-{failure.rank}.json", failure.to_json())


def keep_whole_text(file: Path, rank: int) -> str | None:
    """Move a failure's whole text out of the launch folder (removed at the launch's end) to a
    file of the caller's own that the error names; None when there is none."""
    if not file.exists():
        return None
    fd, kept = tempfile.mkstemp(prefix=f"xlaunch-failure-rank{rank}-", suffix=".txt")
    os.close(fd)
    try:
        os.replace(file, kept)
    except OSError:
        shutil.copyfile(file, kept)
    return kept


def read_failures(attempt: Path | None) -> dict[int, ProcessFailure]:
    """The failure records workers wrote in one attempt, by rank."""
    records: dict[int, ProcessFailure] = {}
    if attempt is None:
        return records
    for file in attempt.glob("failure-*.json"):
        try:
            record = ProcessFailure.from_json(file.read_text(), error_file=str(file))
        except (OSError, ValueError, TypeError):
            continue
        whole = keep_whole_text(file.with_suffix(".txt"), record.rank)
        records[record.rank] = dataclasses.replace(record, full_text=whole) if whole else record
    return records


# faulthandler's words for each fatal signal it catches.
CRASHES = {"Segmentation fault": signal.SIGSEGV, "Aborted": signal.SIGABRT,
           "Bus error": signal.SIGBUS, "Floating point exception": signal.SIGFPE,
           "Illegal instruction": signal.SIGILL}


def read_crashes(attempt: Path) -> dict[int, tuple[int, str]]:
    """pid -> (the fatal signal, faulthandler's dump) of each process that wrote one."""
    crashes = {}
    for crash_file in attempt.glob("crash-*"):
        try:
            text = crash_file.read_text(errors="replace")
            pid = int(crash_file.name[6:])
        except (ValueError, OSError):
            continue
        for words, number in CRASHES.items():
            if f"Fatal Python error: {words}" in text:
                crashes[pid] = (int(number), text.strip())
    return crashes


def read_stacks(attempt: Path) -> dict[int, str]:
    stacks = {}
    for stack_file in attempt.glob("stack-*"):
        try:
            stacks[int(stack_file.name[6:])] = user_frames_first(stack_file.read_text())
        except (ValueError, OSError):
            continue
    return stacks


def collect_stacks(attempt: Path, ranks: list[int], wait: float = STACKS_WAIT_S) -> dict[int, str]:
    """The stacks the ``ranks`` asked (by the launch's owner) wrote. The owner returns once the
    kernel says each dump is whole (`ProcessSet.ask_stacks`); where it cannot say, a file with
    text in it is waited for here, up to ``wait``."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        stacks = read_stacks(attempt)
        if all(stacks.get(rank) for rank in ranks):
            break
        time.sleep(STACKS_POLL_S)
    return {rank: text for rank, text in read_stacks(attempt).items() if rank in ranks}


LAUNCHER_FILES = ("/xlaunch/worker/", "/xlaunch/backends/")


_STDLIB = sysconfig.get_paths()["stdlib"]


def user_frames_first(dump: str) -> str:
    """Each thread's frames of the user's code: the launcher's and the engine's below them go,
    and so do threads that run nothing of the user's (Python's own machinery waiting)."""
    blocks: list[list[str]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x")) or not blocks:
            blocks.append([])
        if line.strip():
            blocks[-1].append(line)
    kept = []
    for block in blocks:
        frames = []
        for line in block:
            if line.lstrip().startswith("File ") and any(name in line for name in LAUNCHER_FILES):
                break
            frames.append(line)
        if any(_users(line) for line in frames):
            kept.append(frames)
    if len(kept) == 1 and kept[0] and kept[0][0].startswith("Current thread"):
        kept[0] = kept[0][1:]  # one thread: its frames say it all
    return "\n".join(line for block in (kept or blocks[:1]) for line in block)


def _users(line: str) -> bool:
    text = line.strip()
    return text.startswith("File ") and _STDLIB not in text or text.startswith("File \"<stdin>")


def read_rank_reports(attempt: Path | None) -> list[RankReport]:
    """The reports of one attempt; of replicas sharing a process, the lowest rank's."""
    if attempt is None:
        return []
    by_pid: dict[int, RankReport] = {}
    for file in attempt.glob("report-*.json"):
        try:
            record = json.loads(file.read_text())
            pid, report = int(record["pid"]), RankReport.from_json(json.dumps(record["report"]))
        except (OSError, ValueError, TypeError, KeyError):
            continue
        if pid not in by_pid or report.rank < by_pid[pid].rank:
            by_pid[pid] = report
    return sorted(by_pid.values(), key=lambda report: report.rank)
