"""One owner of a launch's processes, and a launch that changes nothing it does not own.

Each case failed on the release before the owner (`backends.processes`) existed: a notebook
thread's temporary file deleted with the launch's folder, forkserver launching once, a rank held
alive by its own thread misjudged at a timeout, ``os._exit(75)`` taken for xlaunch's own status,
preset variables of xlaunch's own or gloo's taken silently, ``input()`` in a worker, a message of
50 MB carried whole. Real launches, real processes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

import xlaunch
from xlaunch import LaunchError, LaunchTimeout, notebook_launcher


def sleep_then_rank(seconds):
    import torch.distributed as dist

    time.sleep(seconds)
    return dist.get_rank()


def test_a_notebook_threads_temporary_files_outlive_a_launch():
    made: list[str] = []
    done = threading.Event()

    def notebook_thread():  # a thread of the notebook, writing temporary files all along
        while not done.is_set():
            fd, name = tempfile.mkstemp(prefix="notebook-")
            os.close(fd)
            made.append(name)
            time.sleep(0.05)

    before = tempfile.gettempdir()
    thread = threading.Thread(target=notebook_thread)
    thread.start()
    try:
        assert notebook_launcher(sleep_then_rank, args=(1.5,), num_processes=2) == 0
    finally:
        done.set()
        thread.join()
    try:
        gone = [name for name in made if not os.path.exists(name)]
        assert len(made) > 10 and not gone, f"{len(gone)} went with the launch's folder"
        assert {os.path.dirname(name) for name in made} == {before}
    finally:
        for name in made:
            if os.path.exists(name):
                os.unlink(name)


SPAWNED = """
    import os, sys, xlaunch

    def rank():
        import torch.distributed as dist
        return dist.get_rank(), dist.get_world_size()

    if __name__ == "__main__":
        for method in sys.argv[1:]:
            print(method, xlaunch.notebook_launcher(rank, num_processes=2, start_method=method),
                  flush=True)
"""


def test_spawn_and_forkserver_launch_any_number_of_times(tmp_path: Path):
    script = tmp_path / "spawned.py"
    script.write_text(textwrap.dedent(SPAWNED))
    methods = ["forkserver", "forkserver", "forkserver", "spawn", "spawn"]
    done = subprocess.run([sys.executable, str(script), *methods], capture_output=True,
                          text=True, timeout=600, env={**os.environ, "XLAUNCH_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [f"{method} (0, 2)" for method in methods]



START_METHOD_KEPT = """
    import multiprocessing, sys, xlaunch

    def rank():
        import torch.distributed as dist
        return dist.get_rank()

    if __name__ == "__main__":
        before = multiprocessing.get_start_method(allow_none=True)
        method = sys.argv[1] if sys.argv[1] != "default" else None
        result = xlaunch.notebook_launcher(rank, num_processes=2, start_method=method)
        after = multiprocessing.get_start_method(allow_none=True)
        multiprocessing.set_start_method("spawn")  # the caller's own choice, still open to it
        print(result, before, after, multiprocessing.get_start_method(), flush=True)
"""


@pytest.mark.parametrize("method", ["default", "spawn", "forkserver"])
def test_the_callers_start_method_is_never_set_by_a_launch(tmp_path: Path, method: str):
    """CPython's spawn preparation fixes the default context in the parent (cpython#109263):
    a launch of an explicit spawn or forkserver context used to leave the caller's at "fork"."""
    script = tmp_path / "start_method.py"
    script.write_text(textwrap.dedent(START_METHOD_KEPT))
    done = subprocess.run([sys.executable, str(script), method], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "XLAUNCH_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["0", "None", "None", "spawn"]


FROM_ATEXIT = """
    import atexit, sys, xlaunch

    def ones():
        import torch
        return torch.ones(2) * xlaunch.ProcessState().num_processes

    def at_exit():  # the process's only launch, as it shuts down
        method = sys.argv[1] if sys.argv[1] != "default" else None
        print(xlaunch.notebook_launcher(ones, num_processes=2, start_method=method).tolist(),
              flush=True)

    atexit.register(at_exit)
"""


# CPython 3.12.0 and 3.12.1 refuse new threads and fork() from the start of the interpreter's
# shutdown, atexit handlers included; 3.12.2 refuses them only after every other thread ended
# (cpython gh-113964), as 3.11 and 3.13 do.
NO_THREADS_AT_EXIT = sys.implementation.name == "cpython" and sys.version_info[:3] in (
    (3, 12, 0), (3, 12, 1))


@pytest.mark.parametrize("method", ["default", "spawn"])
def test_a_first_launch_from_an_atexit_handler_works(tmp_path: Path, method: str):
    """torch's first import registers exit hooks as it goes (concurrent.futures.thread's threading
    hook, weakref.finalize's), which Python refuses, or never runs, once it is shutting down.
    Where Python refuses the launch its thread, the launch ends at once with Python's reason."""
    script = tmp_path / "from_atexit.py"
    script.write_text(textwrap.dedent(FROM_ATEXIT))
    done = subprocess.run([sys.executable, str(script), method], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "XLAUNCH_ACCELERATOR": "cpu"})
    if NO_THREADS_AT_EXIT:  # it used to wait for ever for the thread that never started
        assert "can't create new thread at interpreter shutdown" in done.stderr, done.stderr[-3000:]
        assert done.stdout == "", done.stdout
        return
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["[2.0, 2.0]"], done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr

@pytest.mark.timeout(60)
def test_a_launch_whose_thread_cannot_start_raises_at_once(monkeypatch: pytest.MonkeyPatch):
    """Python refuses the launch its thread (no room for one; 3.12.0-1 in an atexit handler):
    the launch raises Python's error at once, with nothing started (it waited for ever)."""
    start = threading.Thread.start

    def refused(thread: threading.Thread) -> None:
        if thread.name == "xlaunch-launch":
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", refused)
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="can't start new thread"):
        notebook_launcher(sleep_then_rank, args=(0,), num_processes=2)
    assert time.monotonic() - began < 30
    monkeypatch.undo()
    assert notebook_launcher(sleep_then_rank, args=(0,), num_processes=2) == 0  # and the next works


def held_by_its_thread():
    import torch.distributed as dist

    def upload_forever():
        while True:
            time.sleep(0.05)

    if dist.get_rank() == 1:
        threading.Thread(target=upload_forever, name="uploader").start()  # not a daemon
    return dist.get_rank()


@pytest.mark.timeout(120)
def test_a_rank_held_alive_by_its_own_thread_is_named_at_the_timeout_with_that_threads_stack():
    with pytest.raises(LaunchTimeout) as caught:
        notebook_launcher(held_by_its_thread, num_processes=2, timeout=6)
    error = caught.value
    assert error.root_cause.rank == 1 and error.root_cause.cause == "held-by-threads"
    text = str(error)
    assert "rank 1 had finished, held by its own threads" in text.splitlines()[0]
    assert "in upload_forever" in text  # the thread that holds it, where it stands
    assert "no worker had started" not in text


def exits_75():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        os._exit(75)
    xlaunch.wait_for_everyone()


def test_a_users_exit_status_is_never_taken_for_xlauncher_own():
    with pytest.raises(LaunchError) as caught:
        notebook_launcher(exits_75, num_processes=2, timeout=60)
    root = caught.value.root_cause
    assert (root.rank, root.exitcode, root.cause) == (1, 75, "died")
    assert caught.value.exitcode == 75


def world_as_seen():
    return xlaunch.ProcessState().backend, os.environ.get("XLAUNCH_WORLD")


def test_a_preset_xlaunch_variable_is_the_launchs_own_again_in_every_worker(monkeypatch):
    monkeypatch.setenv("XLAUNCH_WORLD", "xla")
    monkeypatch.setenv("XLAUNCH_RESTART_COUNT", "7")
    assert xlaunch.ProcessState().backend is None  # the caller is in no XLA world either
    assert notebook_launcher(world_as_seen, num_processes=2) == ("gloo", None)
    assert xlaunch.ProcessState().restart_count == 7  # the caller's own value, left as it was


def test_a_preset_socket_interface_is_named_in_the_launch_line(monkeypatch, capfd):
    from xlaunch.api import run_plan
    from xlaunch.detect import detect
    from xlaunch.plan import LaunchOptions, make_plan

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    monkeypatch.setenv("XLAUNCH_ACCELERATOR", "cpu")
    plan = make_plan(detect(), LaunchOptions(num_processes=2), environ=os.environ)
    assert any("GLOO_SOCKET_IFNAME=eth7" in note and "beyond loopback" in note
               for note in plan.notes)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")  # loopback itself says nothing
    plan = make_plan(detect(), LaunchOptions(num_processes=2), environ=os.environ)
    assert run_plan(plan, os.getpid, ()) > 0
    assert "GLOO_SOCKET_IFNAME" not in capfd.readouterr().err


def asks():
    return input("your name? ")


@pytest.mark.timeout(60)
def test_input_in_a_worker_fails_at_once_saying_workers_have_no_stdin():
    with pytest.raises(LaunchError) as caught:
        notebook_launcher(asks, num_processes=2, timeout=30)
    assert caught.value.root_cause.exc_type == "EOFError"
    assert "workers have no stdin" in caught.value.root_cause.message


def raises_a_huge_message():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("x" * 50_000_000)
    xlaunch.wait_for_everyone()


def test_a_huge_message_is_cut_and_its_start_kept_in_the_users_cache(tmp_path, monkeypatch):
    from xlaunch.worker.private import KEPT_TEXT_BYTES

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with pytest.raises(LaunchError) as caught:
        notebook_launcher(raises_a_huge_message, num_processes=2, timeout=60)
    text = str(caught.value)
    assert len(text) < 100_000
    whole = caught.value.root_cause.full_text
    assert whole and whole in text and whole.startswith(str(tmp_path / "xlaunch" / "failures"))
    kept = Path(whole)
    assert kept.stat().st_mode & 0o777 == 0o600 and kept.parent.stat().st_mode & 0o777 == 0o700
    assert kept.stat().st_size < KEPT_TEXT_BYTES + 100  # bounded: 50 MB a failure would add up
    content = kept.read_text()
    assert content.startswith("Traceback") and "x" * 1_000_000 in content
    assert content.rstrip().endswith(f"(cut: the first {KEPT_TEXT_BYTES} bytes are kept)")


def test_a_returned_tensor_comes_back_whole():
    import torch

    def big():
        import torch.distributed as dist

        return torch.full((1000, 1000), float(dist.get_rank() + 1))

    value = notebook_launcher(big, num_processes=2)
    assert value.shape == (1000, 1000) and float(value.sum()) == 1_000_000.0
    value.add_(1)  # it is the caller's to change
    assert float(value[0, 0]) == 2.0


def many_threads_deep_in_calls(stack_file: str, ready_file: str) -> None:
    """60 threads and the main one, each 40 calls deep, wait forever: a dump of many writes."""
    import faulthandler

    from xlaunch.worker.launch_dir import STACK_SIGNAL

    stack = open(stack_file, "w")
    faulthandler.register(STACK_SIGNAL, file=stack, all_threads=True, chain=False)
    forever = threading.Event()

    def deep(depth: int) -> None:
        if depth:
            deep(depth - 1)
        else:
            forever.wait()

    for _ in range(60):
        threading.Thread(target=deep, args=(40,), daemon=True).start()
    Path(ready_file).write_text("ready")
    deep(40)


def test_the_owner_returns_from_asking_for_stacks_once_each_dump_is_whole(tmp_path: Path):
    from xlaunch.backends.processes import ProcessSet

    owner = ProcessSet(grace=1.0)
    stack, ready = tmp_path / "stack", tmp_path / "ready"
    try:
        worker = owner.start("fork", many_threads_deep_in_calls, (str(stack), str(ready)), "deep")
        while not ready.exists():
            assert worker.is_alive(), "the process ended before it was ready"
            time.sleep(0.01)
        assert owner.ask_stacks([worker.pid], {worker.pid: [stack]}) == [worker.pid]
        read_at_once = stack.read_text()
        owner.stop()
    finally:
        owner.close()
    # The file as it stands once the process is gone: the whole dump, which the owner waited for.
    assert read_at_once == stack.read_text()
    assert read_at_once.count("Thread 0x") + read_at_once.count("Current thread 0x") == 61
    assert read_at_once.count("in deep") >= 61 * 40


def writes_its_stack_late(stack_file: str, ready_file: str) -> None:
    """A handler that writes after the kernel is done with the signal: Python's own handlers run
    later, in the main thread (as a dump not begun yet, the signal taken, its frame being set)."""
    import signal

    from xlaunch.worker.launch_dir import STACK_SIGNAL

    def late(number: int, frame: object) -> None:
        time.sleep(0.5)
        Path(stack_file).write_text("the whole dump\n")

    signal.signal(STACK_SIGNAL, late)
    Path(ready_file).write_text("ready")
    while True:
        time.sleep(0.05)


def test_asking_for_stacks_waits_for_the_file_where_the_kernel_has_nothing_pending(tmp_path: Path):
    """The kernel's masks say nothing between a signal's taking and its handler's start: the
    owner waits for the stack file to grow too (before: it returned at once, the file empty)."""
    from xlaunch.backends.processes import ProcessSet

    owner = ProcessSet(grace=1.0)
    stack, ready = tmp_path / "stack", tmp_path / "ready"
    try:
        worker = owner.start("fork", writes_its_stack_late, (str(stack), str(ready)), "late")
        while not ready.exists():
            assert worker.is_alive(), "the process ended before it was ready"
            time.sleep(0.01)
        assert owner.ask_stacks([worker.pid], {worker.pid: [stack]}) == [worker.pid]
        assert stack.read_text() == "the whole dump\n"
        owner.stop()
    finally:
        owner.close()
