"""Files only this user can read: created exclusively (never one that already exists, never
through a symlink), 0600 whatever the umask, in the launch's private folders (`launch_dir`); and
a failure's whole text, kept in the user's own cache folder once the launch's folder goes."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

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
    """Write a new private file whole (`private_file`); one that could not be written whole (no
    room) is removed, its room back for whoever needs it next (the rank's failure record)."""
    try:
        with os.fdopen(private_file(file), "wb") as opened:
            opened.write(data.encode() if isinstance(data, str) else data)
    except OSError as error:
        if not isinstance(error, FileExistsError):
            with contextlib.suppress(OSError):
                os.unlink(file)
        raise


def atomic_write(file: Path, data: str | bytes) -> None:
    """Write ``file`` so a reader sees the whole content or nothing, never half of it."""
    partial = file.with_name(file.name + ".partial")
    try:
        write_private(partial, data)
    except FileExistsError:  # left by a writer of ours that died mid-write: the folder is private
        partial.unlink()
        write_private(partial, data)
    partial.replace(file)


KEPT_TEXT_BYTES = 4 * 2**20  # of a failure's whole text, what is kept (its start)
KEPT_TEXTS = 20  # whole texts kept in the user's cache folder, the newest


def failures_folder() -> Path:
    """Where the whole texts of cut failures are kept: the user's own cache folder, 0700."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "xlaunch" / "failures"


def keep_whole_text(file: Path, rank: int) -> str | None:
    """Copy a failure's whole text out of the launch folder (removed at the launch's end) into
    the user's cache folder (0700; the file 0600, its first `KEPT_TEXT_BYTES`, the newest
    `KEPT_TEXTS` kept), for the error to name; None when there is none or it cannot be kept.
    Named for its launch, attempt and rank: read again, the text is not kept twice."""
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
            kept = folder / f"rank{rank}-{file.parent.parent.name}-{file.parent.name}{file.suffix}"
            if kept.exists():
                return str(kept)
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
