"""Who holds the TPU: real processes holding a fake machine's device files open."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fakes import fake_machine
from xlaunch.cli.env import env_report, format_report
from xlaunch.detect.environment import detect
from xlaunch.detect.holders import DeviceHolder, tpu_holders
from xlaunch.detect.machine import Machine
from xlaunch.plan import make_plan

HOLD = "import sys, time; held = open(sys.argv[2]); print('holding', flush=True); time.sleep(120)"


def tpu_host(tmp_path: Path, **machine) -> str:
    """A fake TPU host whose processes are this machine's: its proc is the real /proc."""
    root = fake_machine(tmp_path, **machine)
    (Path(root) / "proc").symlink_to("/proc")
    return root


@pytest.fixture
def holder(tmp_path: Path):
    """A v4 host whose /dev/accel0 a real child process holds open."""
    root = tpu_host(tmp_path, tpu_chips=4, tpu_device="0x005e", dev="accel")
    device = Path(root) / "dev" / "accel0"
    child = subprocess.Popen([sys.executable, "-c", HOLD, "--tag-for-tests", str(device)],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "holding"
    yield root, child, str(device)
    child.kill()
    child.wait()


def test_detect_names_the_process_holding_a_tpu(holder) -> None:
    root, child, device = holder
    env = detect({}, root=root)
    assert env.tpu_holders == (DeviceHolder(child.pid, env.tpu_holders[0].command, device),)
    assert "--tag-for-tests" in env.tpu_holders[0].command


def test_a_launch_on_a_held_tpu_is_refused_before_anything_starts(holder) -> None:
    root, child, device = holder
    with pytest.raises(RuntimeError) as refused:
        make_plan(detect({}, root=root))
    text = str(refused.value)
    assert f"pid {child.pid}" in text and device in text and "--tag-for-tests" in text
    assert f"kill {child.pid}" in text


def test_xlaunch_env_lists_the_holders(holder) -> None:
    root, child, device = holder
    report = env_report({}, root=root)
    assert report["environment"]["tpu_holders"][0]["pid"] == child.pid
    assert f"pid {child.pid}" in format_report(report) and "The TPU is in use" in report["refusal"]


def test_this_process_holding_the_tpu_is_told_to_restart(tmp_path: Path) -> None:
    root = tpu_host(tmp_path, tpu_chips=1, tpu_device="0x0063", dev="vfio")
    with open(Path(root) / "dev" / "vfio" / "0"):
        with pytest.raises(RuntimeError, match="That process is this one.*Restart the runtime"):
            make_plan(detect({}, root=root), machine=Machine.here())


def test_nobody_holds_a_free_tpu(tmp_path: Path) -> None:
    root = tpu_host(tmp_path, tpu_chips=1, tpu_device="0x0063", dev="vfio")
    assert detect({}, root=root).tpu_holders == ()
    assert tpu_holders(Path(root)) == ()


def test_the_scan_finds_nothing_among_hundreds_of_other_processes(tmp_path: Path) -> None:
    """The time it took is printed (pytest -s), for the docs; it is not asserted."""
    root = tpu_host(tmp_path, tpu_chips=8, tpu_device="0x0063", dev="vfio")
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(200)]
    try:
        started = time.perf_counter()
        env = detect({}, root=root)
        elapsed = time.perf_counter() - started
        processes = sum(entry.isdigit() for entry in os.listdir("/proc"))
    finally:
        for sleeper in sleepers:
            sleeper.kill()
            sleeper.wait()
    assert env.tpu_holders == ()
    print(f"detect() with {processes} processes running: {elapsed * 1000:.1f} ms")
