"""What careless notebooks do, on the XLA path (torch_xla's CPU device, one replica).

A replica that leaves its process with ``os._exit(0)``, raises ``KeyboardInterrupt`` or an
exception that cannot be printed, or ends with ``sys.exit(21)`` in a script: each is a failure of
that replica, never a silent success, and ``xlaunch run`` exits with the replica's own status.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.xla,
    pytest.mark.timeout(240),
    pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None,
                       reason="needs torch_xla (the xla test tier)"),
]

import xlaunch  # noqa: E402
from xlaunch import LaunchError  # noqa: E402


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("__str__ itself is broken")


def misbehave(how: str) -> Any:
    if how == "os-exit":
        os._exit(0)
    if how == "interrupt":
        raise KeyboardInterrupt
    if how == "unprintable":
        raise Unprintable()
    return "fine"


@pytest.mark.parametrize(("how", "shown"), [
    ("os-exit", "os._exit(0)"),
    ("interrupt", "KeyboardInterrupt"),
    ("unprintable", "Unprintable"),
])
def test_a_replica_that_misbehaves_is_a_failure(how: str, shown: str) -> None:
    with pytest.raises(LaunchError) as caught:
        xlaunch.notebook_launcher(misbehave, (how,), report=False)
    assert caught.value.root_cause is not None and caught.value.root_cause.rank == 0
    assert shown in str(caught.value)


def test_a_replica_that_behaves_still_returns() -> None:
    assert xlaunch.notebook_launcher(misbehave, ("nothing",), report=False) == "fine"


SCRIPT = """
    import sys
    import torch_xla

    def _mp_fn(index):
        print("replica", index, flush=True)
        sys.exit(21)

    if __name__ == "__main__":
        torch_xla.launch(_mp_fn)
"""


def test_xlaunch_run_exits_with_the_status_the_replica_exited_with(tmp_path: Path) -> None:
    script = tmp_path / "exits.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"}
    done = subprocess.run([sys.executable, "-m", "xlaunch", "run", str(script)], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=180)
    assert "replica 0" in done.stdout, done.stderr[-3000:]
    assert done.returncode == 21, done.stderr[-3000:]


class Payload:
    """An argument the notebook passes (a 200 MB dataset, say): it must not outlive the launch."""


def use(payload: Payload, fail: bool) -> str:
    if fail:
        raise ValueError("this launch fails")
    return "done"


@pytest.mark.parametrize("num_processes", [None, 1])  # the pool from the caller; the leader
@pytest.mark.parametrize("fail", [False, True])
def test_a_launch_keeps_no_reference_to_its_arguments(num_processes: int | None,
                                                       fail: bool) -> None:
    import gc
    import weakref

    payload = Payload()
    ref = weakref.ref(payload)
    try:
        xlaunch.notebook_launcher(use, (payload, fail), num_processes=num_processes, report=False)
    except LaunchError:
        pass
    del payload
    gc.collect()
    assert ref() is None


def save_on_stop(folder: str) -> None:
    import time

    def save() -> None:
        Path(folder, f"saved-{os.getpid()}").write_text("checkpoint")

    xlaunch.on_stop(save)  # a replica is a thread: signal.signal would raise here
    Path(folder, "registered").write_text("")
    time.sleep(100)


@pytest.mark.parametrize("num_processes", [None, 1])  # the pool from the caller; the leader
def test_a_replica_saves_its_checkpoint_at_the_timeout(tmp_path: Path,
                                                       num_processes: int | None) -> None:
    with pytest.raises(xlaunch.LaunchTimeout) as caught:
        xlaunch.notebook_launcher(save_on_stop, (str(tmp_path),), num_processes=num_processes,
                                  timeout=20, report=False)
    assert (tmp_path / "registered").exists(), str(caught.value)
    assert [p.read_text() for p in tmp_path.glob("saved-*")] == ["checkpoint"], str(caught.value)
    assert [f.cause for f in caught.value.failures] == ["timed-out"]


def own_rank() -> int:
    return xlaunch.ProcessState().process_index


def test_two_replicas_in_one_process_launch_again_and_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """The v2/v3 layout (two replicas as threads of one process): each replica joins the launch's
    tree, and the caller's descriptor they inherited is closed once per process, never twice
    (the second close hit another file: EBADF in a replica's pid file, 5 launches in 205)."""
    monkeypatch.setenv("CPU_NUM_DEVICES", "2")
    results = [xlaunch.notebook_launcher(own_rank, report=False) for _ in range(40)]
    assert results == [0] * 40
