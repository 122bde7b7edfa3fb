"""SPMD on torch_xla's CPU device with 4 devices: one forked process drives them all.

Every launch here runs in processes the backend forks (this process never starts the runtime);
the tier's conftest sets one device, and these tests set four for themselves.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.xla,
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None,
                       reason="needs torch_xla (the xla test tier)"),
]

import xlaunch  # noqa: E402
from xlaunch import LaunchError, LaunchTimeout  # noqa: E402

DEVICES = 4
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def four_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CPU_NUM_DEVICES", str(DEVICES))


def sharded_batch() -> dict[str, Any]:
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs

    state = xlaunch.ProcessState()
    batch = torch.arange(32.0).reshape(8, 4).to(state.device)
    xs.mark_sharding(batch, state.mesh(), ("data", None))
    return {"spmd": state.is_spmd, "devices": state.num_devices, "rank": state.process_index,
            "world": state.num_processes, "pid": os.getpid(),
            "sharding": torch_xla._XLAC._get_xla_sharding_spec(batch),
            "sum": float(batch.sum().cpu())}


def test_one_process_drives_every_device_and_a_batch_is_sharded_over_the_mesh(capfd) -> None:
    result = xlaunch.notebook_launcher(sharded_batch, spmd=True)
    assert (result["spmd"], result["devices"], result["rank"], result["world"]) == (True, 4, 0, 1)
    assert result["sharding"] == "{devices=[4,1]0,1,2,3}" and result["sum"] == sum(range(32))
    assert result["pid"] != os.getpid()  # forked: this process never holds the devices
    err = capfd.readouterr().err
    assert "launching 1 process driving 4 XLA CPU devices (SPMD)" in err
    assert "SPMD over 4 devices" in err  # the report says what the process drove


def sgd_steps(model: Any, optimizer: Any, x: Any, y: Any, steps: int) -> list[float]:
    """Each step's loss, a graph cut after each step as a TPU loop makes one."""
    import torch
    import torch_xla

    seen = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        torch_xla.sync()
        seen.append(float(loss.detach().cpu()))
    return seen


def losses(spmd: bool) -> list[float]:
    """A small regression, 5 SGD steps; under SPMD the batch is sharded over every device."""
    import torch
    import torch_xla.distributed.spmd as xs

    state = xlaunch.ProcessState()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    model = model.to(state.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1)).to(state.device)
    if spmd:
        xs.mark_sharding(x, state.mesh(), ("data", None))
    return sgd_steps(model, optimizer, x, x.sum(1, keepdim=True), 5)


def test_losses_equal_a_one_device_run(monkeypatch: pytest.MonkeyPatch) -> None:
    sharded = xlaunch.notebook_launcher(losses, (True,), spmd=True, report=False)
    monkeypatch.setenv("CPU_NUM_DEVICES", "1")
    alone = xlaunch.notebook_launcher(losses, (False,), report=False)
    assert len(sharded) == 5 and sharded[-1] < sharded[0]
    assert all(abs(a - b) < 1e-4 for a, b in zip(sharded, alone, strict=True)), (sharded, alone)


def fsdp_v2() -> list[float]:
    import torch
    import torch_xla.distributed.spmd as xs
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
        SpmdFullyShardedDataParallel as FSDPv2,
    )

    state = xlaunch.ProcessState()
    xs.set_global_mesh(state.mesh(axis_names=("fsdp", "model")))
    torch.manual_seed(0)
    model = FSDPv2(torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, 1)).to(state.device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(2)).to(state.device)
    xs.mark_sharding(x, xs.get_global_mesh(), ("fsdp", None))
    return sgd_steps(model, optimizer, x, x[:, :1] * 2, 4)


def test_fsdp_v2_trains_on_the_launchs_mesh() -> None:
    seen = xlaunch.notebook_launcher(fsdp_v2, spmd=True, report=False)
    assert len(seen) == 4 and seen[-1] < seen[0], seen


def trains_after_a_failed_first_attempt(folder: str) -> int:
    """The first attempt fails; the second trains 5 steps on the launch's mesh."""
    state = xlaunch.ProcessState()
    Path(folder, f"attempt-{state.restart_count}").write_text(str(os.getpid()))
    if state.restart_count == 0:
        raise RuntimeError("the first attempt fails")
    import torch_xla.distributed.spmd as xs

    xs.set_global_mesh(state.mesh())  # what FSDPv2 reads; the report names it
    losses(spmd=True)
    return state.restart_count


def test_max_restarts_reruns_the_spmd_process_and_the_report_has_its_mesh(tmp_path: Path) -> None:
    assert xlaunch.notebook_launcher(trains_after_a_failed_first_attempt, (str(tmp_path),),
                                     spmd=True, max_restarts=1) == 1
    pids = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert sorted(pids) == ["attempt-0", "attempt-1"] and len(set(pids.values())) == 2
    (rank,) = xlaunch.last_report().ranks
    assert (rank.devices, rank.mesh) == (DEVICES, "(4,) ('data',)")
    assert rank.compiles and rank.executions and rank.steps == 5


def raises() -> None:
    def deeper() -> None:
        raise ValueError("bad shard 3")

    deeper()


def test_a_raise_reaches_the_caller_with_its_traceback() -> None:
    with pytest.raises(LaunchError) as caught:
        xlaunch.notebook_launcher(raises, spmd=True, report=False)
    root = caught.value.root_cause
    assert (root.rank, root.exc_type, root.message) == (0, "ValueError", "bad shard 3")
    assert "in deeper" in root.traceback


def waits_forever() -> None:
    while True:
        time.sleep(0.05)


def test_a_timeout_stops_the_process_and_shows_where_it_stood() -> None:
    with pytest.raises(LaunchTimeout) as caught:
        xlaunch.notebook_launcher(waits_forever, spmd=True, timeout=8, report=False)
    assert [f.cause for f in caught.value.failures] == ["timed-out"]
    assert "in waits_forever" in caught.value.failures[0].stack


def replicas() -> int:
    return xlaunch.ProcessState().num_processes


def test_spmd_then_a_launch_of_replicas_then_spmd_again() -> None:
    assert xlaunch.notebook_launcher(sharded_batch, spmd=True, report=False)["devices"] == 4
    assert xlaunch.notebook_launcher(replicas, report=False) == 4  # 4 replicas (threads)
    assert xlaunch.notebook_launcher(sharded_batch, spmd=True, report=False)["devices"] == 4


def calls_use_spmd() -> None:
    import torch_xla.runtime as xr

    xr.use_spmd()


def test_use_spmd_inside_a_launch_without_it_is_refused_naming_spmd_true() -> None:
    with pytest.raises(LaunchError) as caught:
        xlaunch.notebook_launcher(calls_use_spmd, report=False)
    root = caught.value.root_cause
    assert root.exc_type == "RuntimeError" and "spmd=True" in root.message  # not a SIGSEGV
    assert xlaunch.notebook_launcher(calls_use_spmd, spmd=True, report=False) is None  # harmless


INTERRUPTED = """
    import os, signal, sys, time
    from pathlib import Path
    import xlaunch

    def sleeper(folder):
        Path(folder, "started").write_text(str(os.getpid()))
        while True:
            time.sleep(0.05)

    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        xlaunch.notebook_launcher(sleeper, (sys.argv[1],), spmd=True, report=False)
    except KeyboardInterrupt as stop:
        pid = int(Path(sys.argv[1], "started").read_text())
        try:
            os.kill(pid, 0)
            print("ALIVE", pid, flush=True)
        except ProcessLookupError:
            print("INTERRUPTED", stop, flush=True)
    print("NEXT", xlaunch.notebook_launcher(int, ("7",), spmd=True, report=False), flush=True)
"""


def test_the_stop_button_ends_an_spmd_launch_and_the_next_one_works(tmp_path: Path) -> None:
    script = subprocess.Popen([sys.executable, "-c", textwrap.dedent(INTERRUPTED), str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "started").exists():
            assert script.poll() is None, script.communicate()
            assert time.monotonic() < deadline, "the SPMD process never started"
            time.sleep(0.1)
        script.send_signal(signal.SIGINT)
        out, err = script.communicate(timeout=180)
    finally:
        if script.poll() is None:
            script.kill()
            script.communicate()
    assert script.returncode == 0, err[-3000:]
    assert "INTERRUPTED interrupted: every worker of the launch was stopped" in out, out
    assert "NEXT 7" in out, out


def xlaunch_command(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "xlaunch", *args], capture_output=True,
                          text=True, timeout=280, env=env)


def test_check_spmd_shards_multiplies_and_trains_on_every_device() -> None:
    done = xlaunch_command("check", "--spmd", "--json")
    verdict = json.loads(done.stdout)
    assert done.returncode == 0 and verdict["ok"] is True, done.stdout + done.stderr[-2000:]
    names = [step["name"] for step in verdict["steps"]]
    assert names == ["plan", "devices", "sharding", "matmul", "training", "result"]
    assert "{devices=[4,1]0,1,2,3}" in verdict["steps"][2]["detail"]


def test_env_spmd_shows_the_plan() -> None:
    done = xlaunch_command("env", "--spmd", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads(done.stdout)["plan"]
    assert plan["spec"]["spmd_devices"] == 4 and plan["num_processes"] == 1
