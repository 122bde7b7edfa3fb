"""What careless notebooks do, on the CPU path: real launches through torch elastic.

A rank that finishes while its peers wait on it, an exit that bypasses the function's return, an
exception that cannot be printed, a worker that ignores SIGTERM, two launches from two threads,
binary and very long output. Each is what a notebook user writes by mistake; each must end with
the right rank blamed and nothing left broken. Tests never assert a duration.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import pytest

import xlaunch
from xlaunch import LaunchError, LaunchTimeout, ProcessState, notebook_launcher


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    monkeypatch.setenv("XLAUNCH_ACCELERATOR", "cpu")


def finish_early_on_rank_one(how):
    if ProcessState().process_index == 1:
        if how == "exit":
            sys.exit(0)
        return "rank one is done"
    xlaunch.wait_for_everyone()  # rank 0 waits for a peer that will never come
    return "rank zero is done"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["return", "exit"])
def test_a_rank_that_finishes_while_its_peer_waits_is_the_root_cause(how):
    # Without a fix the peer waits in the barrier until gloo's 30 minutes: the launch's own
    # timeout (far above the few seconds a closed connection takes) makes that a LaunchTimeout.
    with pytest.raises(LaunchError) as caught:
        notebook_launcher(finish_early_on_rank_one, args=(how,), num_processes=2, timeout=90)
    error = caught.value
    assert not isinstance(error, LaunchTimeout), str(error)
    assert error.root_cause is not None and error.root_cause.rank == 1, str(error)
    assert error.root_cause.cause == "finished-early"
    text = str(error)
    assert "[root cause] rank 1" in text
    assert "while its peers still waited" in text
    assert "rank 0" in text and "wait_for_everyone" in text  # where the peer waited


def reduce_then_return():
    import torch
    import torch.distributed as dist

    value = torch.ones(1)
    dist.all_reduce(value)
    return value.item()


@pytest.mark.timeout(240)
def test_ranks_that_all_finish_normally_are_unaffected():
    for _ in range(8):  # the last collective, then every rank leaves as soon as it can
        assert notebook_launcher(reduce_then_return, num_processes=2) == 2.0


class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("__str__ itself is broken")


def rank_one_misbehaves(how):
    if ProcessState().process_index == 1:
        if how == "interrupt":
            raise KeyboardInterrupt
        if how == "os-exit":
            os._exit(0)
        if how == "unprintable":
            raise Unprintable()
    xlaunch.wait_for_everyone()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("how", "shown"), [
    ("interrupt", "raised KeyboardInterrupt"),
    ("os-exit", "os._exit(0)"),
    ("unprintable", "raised Unprintable"),
])
def test_the_rank_that_misbehaved_is_the_root_cause(how, shown):
    with pytest.raises(LaunchError) as caught:
        notebook_launcher(rank_one_misbehaves, args=(how,), num_processes=2, timeout=90)
    error = caught.value
    assert not isinstance(error, LaunchTimeout), str(error)
    assert error.root_cause is not None and error.root_cause.rank == 1, str(error)
    assert shown in str(error)
    assert "left no record here" not in str(error)


def fail_first_then_hang():
    if ProcessState().restart_count == 0:
        if ProcessState().process_index == 1:
            raise ValueError("first attempt fails")
        xlaunch.wait_for_everyone()
    time.sleep(100)


@pytest.mark.timeout(120)
def test_a_timeout_after_a_restart_lists_the_ranks_that_were_running():
    with pytest.raises(LaunchTimeout) as caught:
        notebook_launcher(fail_first_then_hang, num_processes=2, max_restarts=2, timeout=20)
    error = caught.value
    text = str(error)
    assert "no worker had started" not in text, text
    assert sorted(f.rank for f in error.failures) == [0, 1], text
    assert all(f.cause == "timed-out" and "fail_first_then_hang" in f.stack
               for f in error.failures), text
    assert "exit code 75" not in text
    assert "attempt 1 (restarted) failed first with rank 1" in text


class Model:
    """Stands in for an nn.Module a notebook passes to the launched function."""

    def __init__(self) -> None:
        self.weights = [1.0, 2.0]
        self.device = "cpu"

    def train(self) -> None:
        self.device = "replica"


def test_replicas_that_share_a_process_each_get_their_own_copy_of_the_arguments():
    import threading

    from xlaunch.backends.xla.replica import ReplicaJob, replica_inputs
    from xlaunch.worker.rank import WorkerSetup

    model = Model()
    shared = ReplicaJob(model.train, (model, {"lr": 0.1}), WorkerSetup("unused"), replicas_per_process=2)
    seen: list = []
    threads = [threading.Thread(target=lambda: seen.append(replica_inputs(shared)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    (first_fn, first_args), (second_fn, second_args) = seen
    assert first_args[0] is not second_args[0] and model not in (first_args[0], second_args[0])
    assert first_args[0].weights == model.weights and first_args[1] == {"lr": 0.1}
    assert first_fn.__self__ is not model and first_fn.__self__ is not second_fn.__self__
    first_fn()  # one replica moving its model leaves the other's, and the notebook's, alone
    assert first_fn.__self__.device == "replica" and model.device == "cpu"
    assert second_fn.__self__.device == "cpu"

    alone = ReplicaJob(model.train, (model,), WorkerSetup("unused"))  # one replica per process
    function, args = replica_inputs(alone)
    assert args[0] is model and function == model.train


class Payload:
    """An argument the notebook passes (a 200 MB dataset, say): it must not outlive the launch."""


class Task:
    """A callable the launch is given; its result is a fresh object the caller may drop."""

    def __init__(self, fail: bool) -> None:
        self.fail = fail

    def __call__(self, payload: Payload) -> Payload:
        if self.fail:
            raise ValueError("this launch fails")
        return Payload()


def launch_and_drop(num_processes: int, fail: bool) -> list:
    import gc
    import weakref

    task, payload = Task(fail), Payload()
    refs = [weakref.ref(task), weakref.ref(payload)]
    try:
        result = notebook_launcher(task, args=(payload,), num_processes=num_processes)
        refs.append(weakref.ref(result))
        del result
    except LaunchError:
        pass  # the error itself (and its traceback) is dropped at the end of this block
    del task, payload
    gc.collect()
    return [ref for ref in refs if ref() is not None]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_processes", [1, 2])
@pytest.mark.parametrize("fail", [False, True])
def test_a_launch_keeps_no_reference_to_the_function_its_arguments_or_its_result(
        num_processes, fail):
    assert launch_and_drop(num_processes, fail) == []


def ignore_term_on_rank_zero_while_rank_one_fails():
    import signal

    if ProcessState().process_index == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        time.sleep(100)
    raise ValueError("rank one fails")


@pytest.mark.timeout(25)  # torch elastic's own PContext would wait 30 s before its SIGKILL
def test_a_worker_that_ignores_sigterm_ends_within_the_stop_grace():
    with pytest.raises(LaunchError) as caught:
        notebook_launcher(ignore_term_on_rank_zero_while_rank_one_fails, num_processes=2,
                          stop_grace=1)
    error = caught.value
    assert error.root_cause.rank == 1 and error.root_cause.exc_type == "ValueError"
    stopped = next(f for f in error.failures if f.rank == 0)
    assert stopped.secondary and stopped.exitcode == -9, str(error)


def save_on_stop(folder, how):
    import signal

    rank = ProcessState().process_index

    def save(*_):
        with open(os.path.join(folder, f"saved-{rank}"), "w") as saved:
            saved.write("checkpoint")
        if how == "handler":
            sys.exit(0)

    if how == "handler":
        signal.signal(signal.SIGTERM, save)
    else:
        xlaunch.on_stop(save)
    if how == "peer-fails" and rank == 1:
        raise ValueError("rank one fails")
    time.sleep(100)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["on_stop", "handler"])
def test_a_timeout_lets_each_worker_save_its_checkpoint(tmp_path, how):
    with pytest.raises(LaunchTimeout):
        # long enough for the workers to start on a loaded machine and register their clean-up
        notebook_launcher(save_on_stop, args=(str(tmp_path), how), num_processes=2, timeout=15)
    assert sorted(p.name for p in tmp_path.glob("saved-*")) == ["saved-0", "saved-1"]


@pytest.mark.timeout(120)
def test_a_failed_peer_lets_the_others_save_their_checkpoint(tmp_path):
    with pytest.raises(LaunchError) as caught:
        notebook_launcher(save_on_stop, args=(str(tmp_path), "peer-fails"), num_processes=2)
    assert caught.value.root_cause.rank == 1
    assert (tmp_path / "saved-0").read_text() == "checkpoint"


def test_on_stop_in_one_process_runs_at_the_timeout(tmp_path):
    with pytest.raises(LaunchTimeout):
        notebook_launcher(save_on_stop, args=(str(tmp_path), "on_stop"), num_processes=1,
                          timeout=2)
    assert (tmp_path / "saved-0").exists()


def registers_on_stop(how):
    xlaunch.on_stop(lambda: None)
    if how == "raises":
        raise ValueError("the function failed")
    if how == "times out":
        time.sleep(60)
    return how


@pytest.mark.timeout(120)
def test_a_one_process_launch_puts_the_callers_sigterm_handler_back():
    """The function runs in the caller, where its on_stop installs xlaunch's SIGTERM handler:
    after the launch, however it ended, the caller's own handler is back."""
    import signal

    def mine(signum, frame):
        pass

    before = signal.signal(signal.SIGTERM, mine)
    try:
        for how in ("returns", "raises", "times out"):
            with contextlib.suppress(LaunchError):
                notebook_launcher(registers_on_stop, args=(how,), num_processes=1, timeout=5)
            assert signal.getsignal(signal.SIGTERM) is mine, how
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        assert notebook_launcher(registers_on_stop, args=("returns",), num_processes=1) == "returns"
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)


def world_size():
    return ProcessState().num_processes


@pytest.mark.timeout(240)
def test_two_launches_from_two_threads_both_work_or_the_second_is_refused_at_once():
    import tempfile
    import threading

    temp = tempfile.gettempdir()
    for _ in range(4):
        outcomes: list = []

        def launch(outcomes=outcomes):
            try:
                outcomes.append(notebook_launcher(world_size, num_processes=2, timeout=60))
            except RuntimeError as error:
                outcomes.append(error)

        threads = [threading.Thread(target=launch) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert tempfile.tempdir in (None, temp) and tempfile.gettempdir() == temp
        assert 2 in outcomes, outcomes  # at least one launch worked
        for outcome in outcomes:
            assert outcome == 2 or (not isinstance(outcome, LaunchError)
                                    and "another launch is already running" in str(outcome)), outcome
        os.rmdir(tempfile.mkdtemp())  # the process's own temporary files still work
    assert notebook_launcher(world_size, num_processes=2) == 2


def run_script(tmp_path, body):
    import subprocess
    import textwrap

    script = tmp_path / "careless.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "XLAUNCH_ACCELERATOR": "cpu"}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=200, env=env)


@pytest.mark.timeout(240)
def test_worker_output_is_a_full_text_stream(tmp_path):
    done = run_script(tmp_path, """
        import sys, xlaunch
        def write():
            out = sys.stdout
            out.buffer.write("binary \\u00e9".encode() + b"\\n")
            out.reconfigure(line_buffering=True)
            print("name", out.name, "tty", out.isatty(), "lines", out.line_buffering,
                  "errors", out.errors, "encoding", out.encoding, "writable", out.writable())
            sys.stderr.buffer.write(b"to stderr\\n")
            sys.stderr.buffer.flush()
        xlaunch.notebook_launcher(write, num_processes=2)
    """)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] binary \u00e9\n" in done.stdout
        assert f"[rank {rank}] name <stdout> tty False lines True errors " in done.stdout
        assert f"[rank {rank}] to stderr\n" in done.stderr


@pytest.mark.timeout(240)
def test_long_lines_from_two_ranks_are_never_split(tmp_path):
    done = run_script(tmp_path, """
        import xlaunch
        def write():
            letter = "ab"[xlaunch.ProcessState().process_index]
            for _ in range(300):
                print(letter * 65536)
        xlaunch.notebook_launcher(write, num_processes=2)
    """)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("[rank")]
    assert len(lines) == 600
    whole = {"[rank 0] " + "a" * 65536, "[rank 1] " + "b" * 65536}
    broken = [line[:40] + "..." for line in lines if line not in whole]
    assert not broken, f"{len(broken)} lines split or interleaved"


def test_the_docs_say_what_escapes_the_clean_up_and_how_to_clean_up_at_a_stop():
    from pathlib import Path

    docs = Path(__file__).resolve().parents[1] / "docs"
    trouble = (docs / "troubleshooting.md").read_text()
    for words in ("start_new_session=True", "process_group=0", "stop_grace", "xlaunch.on_stop",
                  "SIGKILL"):
        assert words in trouble, words
    assert "on_stop" in (docs / "api" / "state.md").read_text()
    assert "stop_grace" in (docs / "api" / "launch.md").read_text()
    assert "deep copy" in (docs / "api" / "launch.md").read_text()
