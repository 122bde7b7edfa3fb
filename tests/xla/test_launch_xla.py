"""The XLA backend on torch_xla's CPU device: real launches, failures, timeouts, interrupts.

This process imports torch_xla once, so that each launch's pool or leader (forked from it) starts
in a fraction of a second, but it never initialises the XLA runtime: every launch runs in processes
the backend forks, and the last test checks that the runtime here is still untouched. Scenarios
that need a fresh interpreter (a runtime initialised before the launch, a Ctrl-C) run in one.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import pickle
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.xla,
    pytest.mark.timeout(240),
    pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None,
                       reason="needs torch_xla (the xla test tier)"),
]

psutil = pytest.importorskip("psutil")

import xlaunch  # noqa: E402
from xlaunch import LaunchError, LaunchTimeout, ProcessState  # noqa: E402
from xlaunch.backends import xla as xla_backend  # noqa: E402
from xlaunch.detect.environment import detect  # noqa: E402
from xlaunch.plan import make_plan  # noqa: E402
from xlaunch.plan.options import LaunchOptions  # noqa: E402

SUBPROCESS_TIMEOUT_S = 180


@pytest.fixture(scope="module", autouse=True)
def torch_xla_imported() -> Any:
    import torch_xla

    assert not torch_xla._XLAC._xla_runtime_is_initialized()
    return torch_xla


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Any:
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    yield
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not left, f"processes left behind: {left}"


@pytest.fixture
def pids(tmp_path: Path) -> Path:
    """Where replicas note their pid and process group; afterwards none of them may exist."""
    folder = tmp_path / "pids"
    folder.mkdir()
    yield folder
    noted = [tuple(map(int, f.read_text().split())) for f in folder.glob("pid-*")]
    for pid, group in noted:
        assert not _exists(pid), f"replica {pid} outlived its launch"
        assert not _exists(group), f"the launch leader {group} outlived its launch"
        members = [p.pid for p in psutil.process_iter() if _group_of(p.pid) == group]
        assert not members, f"processes of the launch's group {group} left: {members}"


def _exists(pid: int) -> bool:
    try:
        psutil.Process(pid).status()
    except psutil.NoSuchProcess:
        return False
    return True


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def note_pid(folder: str) -> None:
    Path(folder, f"pid-{os.getpid()}").write_text(f"{os.getpid()} {os.getpgrp()}")


def compute(folder: str, scale: float) -> dict[str, Any]:
    import torch
    import torch_xla

    note_pid(folder)
    state = ProcessState()
    tensor = torch.arange(4.0, device=torch_xla.device()) * scale
    xlaunch.wait_for_everyone()
    return dict(tensor=tensor, rank=state.process_index, world=state.num_processes,
                backend=state.backend, world_var=os.environ.get("XLAUNCH_WORLD"),
                device=str(tensor.device), pid=os.getpid(), group=os.getpgrp(), parent=os.getppid())


def test_returns_replica_zero_value_on_the_cpu(pids: Path) -> None:
    import torch

    result = xlaunch.notebook_launcher(compute, (str(pids), 2.0))
    assert isinstance(result["tensor"], torch.Tensor)
    assert result["tensor"].device.type == "cpu"
    assert result["tensor"].tolist() == [0.0, 2.0, 4.0, 6.0]
    assert (result["rank"], result["world"], result["backend"]) == (0, 1, "xla")
    assert result["world_var"] == f"xla:{result['pid']}" and result["device"].startswith("xla")
    # The replica ran in xmp.spawn's pool, a child of the leader, neither of them the caller.
    assert result["pid"] != os.getpid() and result["group"] not in (os.getpgrp(), result["pid"])


def test_two_launches_in_a_row(pids: Path) -> None:
    first = xlaunch.notebook_launcher(compute, (str(pids), 1.0))
    second = xlaunch.notebook_launcher(compute, (str(pids), 3.0), num_processes=1)
    assert first["tensor"].tolist() == [0.0, 1.0, 2.0, 3.0]
    assert second["tensor"].tolist() == [0.0, 3.0, 6.0, 9.0]
    assert first["pid"] != second["pid"]


def test_num_processes_every_device_or_refused_with_the_values_that_work() -> None:
    assert make_plan(detect(), LaunchOptions(num_processes=None)).world_size == 1
    assert make_plan(detect(), LaunchOptions(num_processes=1)).world_size == 1
    with pytest.raises(ValueError, match=r"num_processes=3 .*use None or 1 \(the one device\)$"):
        xlaunch.notebook_launcher(compute, ("unused", 1.0), num_processes=3)


def test_one_replica_of_several_devices_runs_in_the_leader(
        pids: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``nprocs=1``: torch_xla runs the function in the spawning process, here the leader."""
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    plan = make_plan(detect(), LaunchOptions(num_processes=1))
    assert (plan.spec.nprocs, plan.world_size) == (1, 1)
    result = xlaunch.notebook_launcher(compute, (str(pids), 5.0), num_processes=1)
    assert result["tensor"].tolist() == [0.0, 5.0, 10.0, 15.0]
    assert (result["rank"], result["world"]) == (0, 1)
    assert result["parent"] == os.getpid() != result["pid"]  # the leader itself


def raise_it(message: str) -> None:
    def deeper() -> None:
        raise ValueError(message)

    deeper()


def test_exception_reaches_the_caller_with_type_message_traceback() -> None:
    with pytest.raises(LaunchError) as caught:
        xlaunch.notebook_launcher(raise_it, ("bad value 42",))
    root = caught.value.root_cause
    assert root is not None and caught.value.failures == [root]
    assert (root.rank, root.exc_type, root.message) == (0, "ValueError", "bad value 42")
    assert "in deeper" in root.traceback and "in raise_it" in root.traceback
    assert "ValueError: bad value 42" in str(caught.value)
    assert isinstance(caught.value, RuntimeError)


def crash_now(folder: str, how: str) -> None:
    note_pid(folder)
    os.write(2, b"last words before the crash\n")  # as C++ code writes: below Python's sys.stderr
    if how == "abort":
        os.abort()
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("how, signal_name, devices", [
    ("abort", "SIGABRT", "1"),  # a replica of xmp.spawn's pool
    ("kill", "SIGKILL", "1"),
    ("abort", "SIGABRT", "2"),  # one replica of two devices: the leader is the replica
])
def test_crashed_replica_reported_with_exit_cause_and_stderr(
        pids: Path, monkeypatch: pytest.MonkeyPatch, how: str, signal_name: str,
        devices: str) -> None:
    monkeypatch.setenv("CPU_NUM_DEVICES", devices)
    with pytest.raises(LaunchError) as caught:
        xlaunch.notebook_launcher(crash_now, (str(pids), how), num_processes=1)
    root = caught.value.root_cause
    assert root is not None and root.rank == 0 and root.exc_type is None
    if how == "kill" and devices == "1":  # its status went to torch_xla's pool: no one else's
        assert root.exitcode is None and "out-of-memory killer" in str(caught.value)
    else:  # the leader's status, or the crash dump the replica's process left
        assert root.exitcode == -getattr(signal, signal_name)
    assert f"killed by {signal_name}" in str(caught.value)
    assert "last words before the crash" in root.stderr_tail
    if how == "abort":  # faulthandler in the replica: the Python stack of the crash
        assert "in crash_now" in root.stderr_tail
    assert "last words before the crash" in str(caught.value)


def stuck_in_user_code(folder: str) -> None:
    note_pid(folder)
    while True:
        time.sleep(0.05)


def test_timeout_stops_everything_and_holds_the_stack(pids: Path) -> None:
    with pytest.raises(LaunchTimeout) as caught:
        xlaunch.notebook_launcher(stuck_in_user_code, (str(pids),), timeout=15)
    failures = caught.value.failures
    assert [f.rank for f in failures] == [0]
    assert "stuck_in_user_code" in failures[0].stack
    assert "timeout=15" in str(caught.value)


def precision_probe() -> dict[str, str]:
    import torch
    import torch_xla

    state = ProcessState()
    a = torch.ones(4, 4, device=torch_xla.device())
    with state.autocast():
        product = a @ a
    return dict(precision=state.mixed_precision, dtype=str(product.dtype))


def test_bf16_reaches_the_replicas_through_autocast() -> None:
    result = xlaunch.notebook_launcher(precision_probe, mixed_precision="BF16")
    assert result == dict(precision="bf16", dtype="torch.bfloat16")
    assert xlaunch.notebook_launcher(precision_probe)["dtype"] == "torch.float32"


def environment_probe() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in
            ("XLAUNCH_TEST_PRESET", "XLAUNCH_TEST_LAYOUT", "XLAUNCH_WORLD",
             "XLAUNCH_MIXED_PRECISION")}


def test_plan_variables_set_and_unset_in_the_workers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """How Kaggle's preset TPU_PROCESS_ADDRESSES is removed: in the launch, not in the caller."""
    monkeypatch.setenv("XLAUNCH_TEST_PRESET", "local")
    plan = make_plan(detect())
    spec = dataclasses.replace(plan.spec, unset_env=("XLAUNCH_TEST_PRESET",),
                               layout_env={"XLAUNCH_TEST_LAYOUT": "1,1,1"})
    outcome = xla_backend.launch(dataclasses.replace(plan, spec=spec), spec, environment_probe, ())
    world = outcome.result.pop("XLAUNCH_WORLD")
    assert outcome.result == {
        "XLAUNCH_TEST_PRESET": None, "XLAUNCH_TEST_LAYOUT": "1,1,1", "XLAUNCH_MIXED_PRECISION": "no"}
    assert world.startswith("xla:")  # the replica's own process, by its pid
    assert os.environ["XLAUNCH_TEST_PRESET"] == "local"
    assert "XLAUNCH_TEST_LAYOUT" not in os.environ and "XLAUNCH_WORLD" not in os.environ


def test_spawn_start_method(pids: Path) -> None:
    import threading

    with pytest.raises(TypeError, match=r"<lambda>: its args cannot be sent to spawned workers"):
        xlaunch.notebook_launcher(lambda lock: 1, (threading.Lock(),), start_method="spawn")
    assert not list(pids.iterdir())  # refused before anything started
    # A function made in place (as in a notebook cell) travels by value.
    assert xlaunch.notebook_launcher(lambda: 41 + 1, start_method="spawn") == 42
    result = xlaunch.notebook_launcher(compute, (str(pids), 1.0), start_method="spawn")
    assert result["tensor"].tolist() == [0.0, 1.0, 2.0, 3.0]


def run_script(source: str, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(source), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def test_runtime_initialised_in_the_caller_is_refused() -> None:
    script = run_script("""
        import torch, torch_xla, xlaunch
        torch.ones(1, device=torch_xla.device())  # an earlier cell used the XLA device
        try:
            xlaunch.notebook_launcher(print)
        except RuntimeError as error:
            print("REFUSED", type(error).__name__, error)
    """)
    out, err = script.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    assert script.returncode == 0, err
    assert "REFUSED RuntimeError" in out and "already initialised" in out
    assert "Restart the kernel" in out and "torch_xla.device()" in out


INTERRUPTED = """
    import os, signal, sys, time
    from pathlib import Path
    import xlaunch

    folder = sys.argv[1]

    def sleeper():
        Path(folder, f"pid-{os.getpid()}").write_text(f"{os.getpid()} {os.getpgrp()}")
        while True:
            time.sleep(0.05)

    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started with it ignored
    handler = signal.getsignal(signal.SIGINT)
    try:
        xlaunch.notebook_launcher(sleeper)
    except KeyboardInterrupt:
        pid, group = map(int, next(Path(folder).glob("pid-*")).read_text().split())
        for gone in (pid, group):
            try:
                os.kill(gone, 0)
                print("ALIVE", gone, flush=True)
            except ProcessLookupError:
                pass
        print("INTERRUPTED", flush=True)
    print("HANDLER RESTORED", signal.getsignal(signal.SIGINT) is handler, flush=True)
    print("NEXT", xlaunch.notebook_launcher(int, ("7",)), flush=True)
"""


def test_interrupt_ends_every_process_and_the_next_launch_works(pids: Path) -> None:
    script = run_script(INTERRUPTED, str(pids))
    try:
        deadline = time.monotonic() + SUBPROCESS_TIMEOUT_S
        while not list(pids.glob("pid-*")):
            assert script.poll() is None, script.communicate()
            assert time.monotonic() < deadline, "the replica never started"
            time.sleep(0.1)
        script.send_signal(signal.SIGINT)
        out, err = script.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    finally:
        if script.poll() is None:
            script.kill()
            script.communicate()
    assert script.returncode == 0, err
    assert "INTERRUPTED" in out and "ALIVE" not in out, out
    assert "HANDLER RESTORED True" in out and "NEXT 7" in out, out


def test_fork_needs_nothing_picklable() -> None:
    """xmp.spawn's pool pickles its function even under fork; the launch does not need it to."""
    lock = threading.Lock()
    offset = 3
    assert xlaunch.notebook_launcher(lambda held: offset + held.locked(), (lock,)) == 3


def test_result_that_cannot_be_pickled_is_a_failure_of_rank_zero() -> None:
    with pytest.raises(LaunchError, match="cannot be sent back") as caught:
        xlaunch.notebook_launcher(lambda: (lambda: None))
    assert caught.value.root_cause is not None and caught.value.root_cause.exc_type == "TypeError"
    pickle.dumps(caught.value)  # and the error itself crosses processes


THREADS_SPEAK = """
    import logging, os, sys, threading
    import xlaunch
    logging.basicConfig(format="%(levelname)s %(message)s")  # made before the launch
    # The two replicas' threads meet before either ends: a thread's ident is reused once it ended,
    # so under load replica 1's thread, started after replica 0's ended, could print the same one.
    both_alive = threading.Barrier(2)

    def speak():
        rank = xlaunch.ProcessState().process_index
        both_alive.wait(timeout=120)
        for line in range(3):
            print(f"line {line} from replica {rank} in {os.getpid()}/{threading.get_ident()}")
        print(f"stderr of replica {rank}", file=sys.stderr)
        logging.getLogger("train").warning("logged by replica %d", rank)
        both_alive.wait(timeout=120)
        return rank

    print("RESULT", xlaunch.notebook_launcher(speak), flush=True)
"""


def test_replicas_that_are_threads_of_one_process_each_prefix_their_lines() -> None:
    """Two XLA CPU devices: one process, a replica per thread (as TPU v2/v3 run two); every line
    a replica prints, to stdout, stderr or through a handler made before the launch, carries
    its own rank. No collective: the printing alone (the threads meet at a threading.Barrier)."""
    script = run_script(THREADS_SPEAK, env={**os.environ, "CPU_NUM_DEVICES": "2"})
    out, err = script.communicate(timeout=SUBPROCESS_TIMEOUT_S)
    assert script.returncode == 0, err[-3000:]
    assert "RESULT 0" in out, out
    where = set()
    for rank in (0, 1):
        for line in range(3):
            found = re.findall(rf"^\[rank {rank}\] line {line} from replica {rank} in "
                               r"(\d+/\d+)$", out, re.MULTILINE)
            assert len(found) == 1, out
            where.update(found)
        assert f"[rank {rank}] stderr of replica {rank}\n" in err, err[-3000:]
        assert f"[rank {rank}] WARNING logged by replica {rank}\n" in err, err[-3000:]
    assert len(where) == 2 and len({w.split("/")[0] for w in where}) == 1, where  # 2 threads, 1 process


def test_the_runtime_here_was_never_initialised(torch_xla_imported: Any) -> None:
    assert not torch_xla_imported._XLAC._xla_runtime_is_initialized()
