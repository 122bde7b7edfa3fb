"""A worker's grandchild that leaves the launch's process group (``os.setsid()``) and lives on.

Such a process inherits the worker's descriptors, multiprocessing's sentinel pipe among them.
Before the owner waited on its workers' pids, a launch waited on those descriptors: a timeout
of 5 s returned after the grandchild's 120 s, and the stop button the same. Now the grandchild
holds nothing up and is named, with its pid, as left running; it is not killed (it left the
group on purpose), so each test kills its own stray at the end.

Real launches, real processes; each test bounds its duration, since a hang is the failure.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

import xlaunch
from xlaunch import LaunchTimeout, debug_launcher

GRANDCHILD_S = 120


def detach_a_grandchild(folder: str) -> None:
    """Fork a process that starts a session of its own and sleeps; its pid goes to ``folder``."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setsid()
            time.sleep(GRANDCHILD_S)
        finally:
            os._exit(0)
    Path(folder, "grandchild.part").write_text(str(pid))
    os.rename(Path(folder, "grandchild.part"), Path(folder, "grandchild"))


def detach_then_sleep(folder: str, seconds: float) -> str:
    if xlaunch.ProcessState().process_index == 0:
        detach_a_grandchild(folder)
    time.sleep(seconds)
    return "returned"


def grandchild(folder: Path) -> int:
    return int((folder / "grandchild").read_text())


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture
def strays(tmp_path: Path) -> Iterator[Path]:
    """A folder the grandchild's pid is written to; the grandchild is killed afterwards."""
    yield tmp_path
    note = tmp_path / "grandchild"
    if note.exists():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(note.read_text()), signal.SIGKILL)


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XLAUNCH_ACCELERATOR", "cpu")


@pytest.mark.timeout(200)
def test_a_detached_grandchild_does_not_hold_a_timeout_up_and_is_named(strays: Path) -> None:
    started = time.monotonic()
    with pytest.raises(LaunchTimeout) as caught:
        debug_launcher(detach_then_sleep, args=(str(strays), 100), num_processes=2, timeout=5)
    took = time.monotonic() - started
    pid = grandchild(strays)
    assert took < 15, f"the timeout of 5 s took {took:.1f} s"
    assert f"{pid}" in str(caught.value), str(caught.value)[-2000:]
    assert running(pid), "the detached grandchild was killed; it is only to be named"


@pytest.mark.timeout(200)
def test_a_launch_that_returns_with_a_detached_grandchild_returns_at_once_and_warns(
        strays: Path, capfd: pytest.CaptureFixture[str]) -> None:
    started = time.monotonic()
    value = debug_launcher(detach_then_sleep, args=(str(strays), 0), num_processes=2)
    took = time.monotonic() - started
    pid = grandchild(strays)
    assert value == "returned"
    assert took < 10, f"the launch took {took:.1f} s"
    warnings = [line for line in capfd.readouterr().err.splitlines()
                if line.startswith("xlaunch:") and str(pid) in line]
    assert warnings, "no warning named the detached grandchild"
    assert running(pid)


STOPPED = """
    import os, signal, sys, time, xlaunch
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as a notebook kernel does
    sys.path.insert(0, sys.argv[2])
    from test_detached import detach_then_sleep

    try:
        xlaunch.notebook_launcher(detach_then_sleep, args=(sys.argv[1], 100), num_processes=2)
    except KeyboardInterrupt as stop:
        print("KeyboardInterrupt:", stop, flush=True)
"""


@pytest.mark.timeout(200)
def test_the_stop_button_is_not_held_up_by_a_detached_grandchild(strays: Path) -> None:
    script = strays / "stopped.py"
    script.write_text(textwrap.dedent(STOPPED))
    env = {**os.environ, "XLAUNCH_ACCELERATOR": "cpu"}
    out_file, err_file = strays / "out", strays / "err"
    # Files, not pipes: the grandchild inherits the caller's stdout and stderr, and a pipe would
    # not read end-of-file before it ends.
    with open(out_file, "w") as out, open(err_file, "w") as err:
        caller = subprocess.Popen(
            [sys.executable, str(script), str(strays), str(Path(__file__).parent)],
            stdout=out, stderr=err, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (strays / "grandchild").exists():
            assert caller.poll() is None, err_file.read_text()[-2000:]
            assert time.monotonic() < deadline, "the grandchild never started"
            time.sleep(0.05)
        time.sleep(0.5)  # both ranks asleep
        stopped = time.monotonic()
        caller.send_signal(signal.SIGINT)
        try:
            caller.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the stop button had not ended the launch 30 s later")
        took = time.monotonic() - stopped
    finally:
        caller.kill()
        caller.wait()
    pid = grandchild(strays)
    printed = out_file.read_text()
    assert took < 8, f"the stop took {took:.1f} s"
    assert printed.startswith("KeyboardInterrupt:"), err_file.read_text()[-2000:]
    assert f"{pid}" in printed, printed
    assert running(pid)

@pytest.mark.timeout(120)
@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfd", "status-polled"])
def test_the_owner_sees_a_worker_end_whatever_its_detached_grandchild_holds(
        strays: Path, monkeypatch: pytest.MonkeyPatch, pidfds: bool) -> None:
    """Where the kernel has no pidfds (macOS, Linux before 5.3) the status is polled instead."""
    from xlaunch.backends import processes

    if not pidfds:
        monkeypatch.setattr(processes, "_pidfd", lambda pid: None)
    owner = processes.ProcessSet(grace=1.0)
    try:
        worker = owner.start("fork", detach_a_grandchild, (str(strays),), "xlaunch-detacher")
        started = time.monotonic()
        ended = owner.wait([worker], 20)
        took = time.monotonic() - started
    finally:
        left = owner.close()
    pid = grandchild(strays)
    assert ended == [worker] and took < 5, f"the end was seen {took:.1f} s later"
    assert left == []
    assert [process.pid for process in owner.left_running] == [pid]
    assert running(pid)


def ends_at_once() -> None:
    return None


def test_the_owner_leaves_no_descriptor_behind_across_300_attempts() -> None:
    """Each attempt opens a pidfd per worker (and the guard's pipe); its close closes them."""
    from xlaunch.backends.processes import ProcessSet

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    def one_attempt() -> None:
        owner = ProcessSet(grace=1.0)
        try:
            worker = owner.start("fork", ends_at_once, (), "xlaunch-fd-check")
            while not owner.wait([worker], 5.0):
                pass
        finally:
            assert owner.close() == []

    one_attempt()  # what the first start opens once (multiprocessing's own), before counting
    before = open_fds()
    for _ in range(300):
        one_attempt()
    assert open_fds() == before
