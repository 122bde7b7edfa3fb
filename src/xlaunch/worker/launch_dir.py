"""The private place each launch keeps everything its workers send back.

Workers report through files rather than pipes: a record written before a worker exits survives
however that worker then dies, and a stack dumped by `faulthandler` lands there even when the
worker is stuck inside a C++ collective. Each launch has two folders of the same random name, one
in the temporary directory (records, failures, stacks, pids, marks) and one in shared memory
(``/dev/shm``: the bytes of a returned value, `worker.value`). Both are created exclusively,
0700 whatever the umask, and every file in them is created exclusively (never one that exists,
never through a symlink), 0600: no other user can read, replace or redirect anything a worker
sends back, at any moment. The caller reads them once the workers are done and removes both; a
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
GROUP_STORE = "group-store"  # the FileStore a one-machine group meets through (made private first)


# A file only this user can read, created here and now: never one that already exists, never
# through a symlink. O_NOFOLLOW and O_CLOEXEC where the platform has them.
_CREATE = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
           | getattr(os, "O_CLOEXEC", 0))


def private_file(file: Path | str) -> int:
    """A new file, 0600 whatever the umask, open for writing: its descriptor."""
    fd = os.open(file, _CREATE, 0o600)
    os.fchmod(fd, 0o600)  # a umask that took the owner's bits would lock the caller out
    return fd


def private_dir(folder: Path | str) -> None:
    """A new folder, 0700 whatever the umask (FileExistsError when the name is taken)."""
    os.mkdir(folder, 0o700)
    os.chmod(folder, 0o700)


def write_private(file: Path, data: str | bytes | memoryview) -> None:
    """Write a new private file whole (`private_file`)."""
    with os.fdopen(private_file(file), "wb") as opened:
        opened.write(data.encode() if isinstance(data, str) else data)


def atomic_write(file: Path, data: str | bytes) -> None:
    """Write ``file`` so a reader sees the whole content or nothing, never half of it."""
    partial = file.with_name(file.name + ".partial")
    try:
        write_private(partial, data)
    except FileExistsError:  # left by a writer of ours that died mid-write: the folder is private
        partial.unlink()
        write_private(partial, data)
    partial.replace(file)


@dataclass(frozen=True)
class LaunchDir:
    """One launch's directory; ``attempt-N`` folders separate restarts of the workers."""

    folder: str

    @classmethod
    def create(cls) -> LaunchDir:
        """Fresh folders named after this process and a random name, in the temporary directory
        and in shared memory; leftovers of dead launchers are swept first.

        Both are created exclusively: a name another user took first is given up for another.
        Without a usable shared memory, values go to the folder on disk. A launcher killed
        outright (SIGKILL, a kernel restart) cannot remove its folders; the next launch by the
        same user does, once the process that made them is gone.
        """
        temp = Path(tempfile.gettempdir())
        sweep_stale(temp, SHARED_MEMORY)
        for _ in range(_NAME_TRIES):
            name = f"{PREFIX}{os.getpid()}-{os.urandom(6).hex()}"
            try:
                private_dir(temp / name)
            except FileExistsError:
                continue
            try:
                private_dir(SHARED_MEMORY / name)
            except FileExistsError:
                os.rmdir(temp / name)
                continue
            except OSError:  # no shared memory here (or not ours to write): values go to disk
                pass
            return cls(str(temp / name))
        raise FileExistsError(errno.EEXIST, f"no free name for a launch folder in {temp} after "
                              f"{_NAME_TRIES} tries")

    @property
    def shared(self) -> Path | None:
        """The launch's folder in shared memory, when it exists and is this user's own, private
        folder (a worker checks before it writes a value there)."""
        folder = SHARED_MEMORY / Path(self.folder).name
        try:
            info = folder.lstat()
        except OSError:
            return None
        if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
                or info.st_mode & 0o077):
            return None
        return folder

    def attempt_path(self, attempt: int) -> Path:
        return Path(self.folder) / f"attempt-{attempt}"

    def attempt_dir(self, attempt: int) -> Path:
        folder = self.attempt_path(attempt)
        with contextlib.suppress(FileExistsError):  # made by the caller or a peer: the launch's
            private_dir(folder)
        return folder

    @property
    def cancel_marker(self) -> Path:
        return Path(self.folder) / "cancelled"

    def cancel(self) -> None:
        with contextlib.suppress(FileExistsError):
            os.close(private_file(self.cancel_marker))

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
        shared = self.shared
        if shared is not None:  # the bytes of values nobody took (a failed launch's)
            shutil.rmtree(shared, ignore_errors=True)


_NAME_TRIES = 100


def sweep_stale(temp: Path, shared: Path | None = None) -> None:
    """Remove launch folders this user owns whose launcher process is gone, in the temporary
    directory and in shared memory."""
    uid = os.getuid()
    for folder in (temp, shared):
        for stale in folder.glob(f"{PREFIX}*-*") if folder is not None else ():
            owner = stale.name[len(PREFIX):].split("-")[0]
            try:
                info = stale.lstat()
            except OSError:
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


def write_pid(attempt: Path, rank: int, local_rank: int) -> None:
    # One small write; a reader that finds it half-written skips it (worker_places).
    write_private(attempt / f"pid-{rank}", f"{os.getpid()} {local_rank}")


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
    """A fact a worker states about itself, as an empty file named for it. What a worker says:
    its function returned, and its value (local rank 0's) was sent whole (``returned``, by rank);
    it began to send its value (``sending``, by rank); it found the launch stopped and ran
    nothing (``cancelled``, by rank); its process received SIGTERM (``terminated``, by pid); its
    process began (``process``, by pid, before anything else: an engine's processes are known
    by it even if they die at once)."""
    with contextlib.suppress(FileExistsError):  # said before: once is enough
        os.close(private_file(attempt / f"{what}-{number}"))


def settled(attempt: Path) -> frozenset[int]:
    """The ranks whose function has returned (its value sent) or raised, as their files say now:
    read at a timeout, before anything is stopped, they are the ranks the timeout did not cut."""
    failed = {name[8:-5] for name in (file.name for file in attempt.glob("failure-*.json"))}
    return noted(attempt, "returned") | {int(rank) for rank in failed if rank.isdigit()}


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


KEPT_TEXT_BYTES = 4 * 2**20  # of a failure's whole text, what is kept (its start)
KEPT_TEXTS = 20  # whole texts kept in the user's cache folder, the newest


def failures_folder() -> Path:
    """Where the whole texts of cut failures are kept: the user's own cache folder, 0700."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xlaunch" / "failures"


def keep_whole_text(file: Path, rank: int) -> str | None:
    """Copy a failure's whole text out of the launch folder (removed at the launch's end) into
    the user's cache folder (0700; the file 0600, its first `KEPT_TEXT_BYTES`, the newest
    `KEPT_TEXTS` kept), for the error to name; None when there is none or it cannot be kept."""
    try:
        source = open(file, "rb")
    except OSError:
        return None
    folder = failures_folder()
    with source:
        try:
            folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            info = folder.lstat()
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                return None
            os.chmod(folder, 0o700)
            kept = folder / f"rank{rank}-{time.strftime('%Y%m%d-%H%M%S')}-{os.urandom(4).hex()}.txt"
            text = source.read(KEPT_TEXT_BYTES + 1)
            if len(text) > KEPT_TEXT_BYTES:
                text = text[:KEPT_TEXT_BYTES] + b"\n(cut: the first %d bytes are kept)\n" % (
                    KEPT_TEXT_BYTES)
            write_private(kept, text)
        except OSError:
            return None
    _prune(folder)
    return str(kept)


def _prune(folder: Path) -> None:
    with contextlib.suppress(OSError):
        texts = sorted(folder.glob("rank*.txt"), key=lambda path: path.stat().st_mtime)
        for old in texts[:-KEPT_TEXTS]:
            old.unlink()


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
