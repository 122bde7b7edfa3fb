"""Nothing another local user wrote is trusted, and output of any shape flows through.

TPU VMs and university machines are shared: a file the launch reads back must never be one that
another user could have planted in a shared temp directory, and the start-up sweep must never
touch another user's directories. Output without newlines must pass through in linear time.
"""

from __future__ import annotations

import ctypes
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from xlaunch.worker.launch_dir import PREFIX, sweep_stale
from xlaunch.worker.output import PrefixedStream

IN_CREATE, IN_MOVED_TO = 0x100, 0x80


def created_names(fd: int) -> list[str]:
    """Every name an inotify watch saw created in the directory."""
    names = []
    while True:
        try:
            data = os.read(fd, 65536)
        except BlockingIOError:
            return names
        offset = 0
        while offset < len(data):
            _, _, _, length = struct.unpack_from("iIII", data, offset)
            raw = data[offset + 16:offset + 16 + length]
            names.append(raw.split(b"\0", 1)[0].decode())
            offset += 16 + length


FAILING_LAUNCH = """
    import os, tempfile, xlaunch
    # Python's own first look at the temp directory (a probe file it makes and deletes) comes
    # before the launch; the watch counts from this marker on.
    open(os.path.join(tempfile.gettempdir(), "begin"), "w").close()
    def fail():
        if xlaunch.ProcessState().process_index == 1:
            raise ValueError("rank 1 failed")
        xlaunch.wait_for_everyone()
    try:
        xlaunch.notebook_launcher(fail, num_processes=2)
    except xlaunch.LaunchError as error:
        print("root", error.root_cause.rank)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="inotify is Linux's")
def test_a_failing_launch_creates_nothing_in_a_shared_temp_directory(tmp_path: Path) -> None:
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    shared.chmod(0o1777)
    script = tmp_path / "fail.py"
    script.write_text(textwrap.dedent(FAILING_LAUNCH))
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(os.O_NONBLOCK)
    assert fd >= 0 and libc.inotify_add_watch(fd, str(shared).encode(), IN_CREATE | IN_MOVED_TO) >= 0
    try:
        env = {**os.environ, "XLAUNCH_ACCELERATOR": "cpu", "TMPDIR": str(shared)}
        result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                                env=env, timeout=120)
        assert result.stdout.strip() == "root 1", result.stderr[-2000:]
        seen = created_names(fd)
        created = seen[seen.index("begin") + 1:]
    finally:
        os.close(fd)
    # Nothing is made there where the launch's folder is in shared memory; elsewhere the launch's
    # own directory (0700, this user's) is the only thing.
    if os.access("/dev/shm", os.W_OK):
        assert created == [], created
    assert created and all(name.startswith(PREFIX) for name in created) or created == [], created
    assert [p.name for p in shared.iterdir()] == ["begin"]  # and it was removed


def test_the_sweep_removes_only_this_users_directories_of_dead_launchers(tmp_path: Path) -> None:
    probe = subprocess.Popen(["true"])  # once reaped, its pid belongs to no process
    probe.wait()
    dead = probe.pid
    mine_dead = tmp_path / f"{PREFIX}{dead}-abc"
    mine_alive = tmp_path / f"{PREFIX}{os.getpid()}-abc"
    theirs_dead = tmp_path / f"{PREFIX}{dead}-xyz"
    for folder in (mine_dead, mine_alive, theirs_dead):
        folder.mkdir()
    if os.getuid() == 0:
        os.chown(theirs_dead, 65534, 65534)
    sweep_stale(tmp_path)
    assert not mine_dead.exists() and mine_alive.exists()
    assert theirs_dead.exists() == (os.getuid() == 0)  # only root can make another user's here


def test_the_sweep_leaves_a_folder_of_another_pid_namespace(tmp_path: Path) -> None:
    """A container sharing /dev/shm and a user id: its launcher's pid means nothing here, so its
    folder is not judged (this namespace's is, by the same dead pid)."""
    from xlaunch.worker.launch_dir import _pid_namespace

    probe = subprocess.Popen(["true"])
    probe.wait()
    here = tmp_path / f"{PREFIX}{probe.pid}-{_pid_namespace()}-abc"
    elsewhere = tmp_path / f"{PREFIX}{probe.pid}-1{_pid_namespace()}-abc"
    for folder in (here, elsewhere):
        folder.mkdir()
    sweep_stale(tmp_path)
    assert not here.exists() and elsewhere.exists()


class Recorded:
    """A stream that keeps each write it receives."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> None:
        self.writes.append(text)

    def flush(self) -> None:
        pass


def test_a_line_written_a_character_at_a_time_goes_out_once_whole() -> None:
    out = Recorded()
    stream = PrefixedStream(out, "[rank 1] ")
    for _ in range(50_000):
        stream.write(".")
    assert out.writes == []  # nothing re-scanned or re-sent while the line grows
    stream.write("\n")
    assert out.writes == ["[rank 1] " + "." * 50_000 + "\n"]


BIG_OUTPUT = """
    import sys, xlaunch
    def dots():
        if xlaunch.ProcessState().process_index == 1:  # one rank: two 200k-character writes to
            for _ in range(200_000):                    # one pipe would interleave, as any would
                print(".", end="")
            print("\\r50%", end="", flush=True)
            print("\\r100%")
        print("done")
    xlaunch.notebook_launcher(dots, num_processes=2)
"""


def test_two_hundred_thousand_characters_without_a_newline_flow_through(tmp_path: Path) -> None:
    script = tmp_path / "dots.py"
    script.write_text(textwrap.dedent(BIG_OUTPUT))
    env = {**os.environ, "XLAUNCH_ACCELERATOR": "cpu"}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, env=env,
                            timeout=120)  # bytes: text mode would turn each \r into a newline
    assert result.returncode == 0, result.stderr[-2000:]
    line = "[rank 1] " + "." * 200_000 + "\r[rank 1] 50%\r[rank 1] 100%\n"
    assert line.encode() in result.stdout
    assert b"[rank 0] done\n" in result.stdout and b"[rank 1] done\n" in result.stdout
