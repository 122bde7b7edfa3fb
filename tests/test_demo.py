"""`xlaunch demo` as the README runs it: a real training in real CPU worker processes.

The subprocess tests keep the run short (a few steps); what they check is behaviour a user sees:
the exit status, both ranks' lines, the per-epoch loss and the agreement check. Nothing asserts a
duration; a hang ends at the subprocess timeout.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch

from xlaunch.cli.demo import default_num_processes, ranks_agree
from xlaunch.detect.environment import Environment

STEERING = ("XLAUNCH_ACCELERATOR", "PJRT_DEVICE", "CPU_NUM_DEVICES", "GPU_NUM_DEVICES",
            "OMP_NUM_THREADS")
PASS_LINE = re.compile(r"^\[rank 0\] PASS: all 2 rank\(s\) hold identical parameters "
                       r"\(\d+ values, checksum (-?\d+\.\d+)\); loss (\d+\.\d+) -> (\d+\.\d+)$", re.M)


def xlaunch_demo(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in STEERING}
    env["XLAUNCH_ACCELERATOR"] = "cpu"
    return subprocess.run([sys.executable, "-m", "xlaunch", "demo", "--timeout", "150", *args],
                          env=env, capture_output=True, text=True, timeout=180)


def test_two_processes_train_and_agree():
    result = xlaunch_demo("--num-processes", "2", "--epochs", "2", "--steps", "6")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("xlaunch demo\n")
    assert re.search(r"^  launch +elastic .*: 2 CPU processes .*world size 2, gloo", out, re.M)
    assert "2 epoch(s) x 6 steps" in out and "mixed precision no" in out
    for rank in (0, 1):  # every rank reports its shard and its final parameters
        assert f"[rank {rank}] rank {rank}/2: training on 1024 of 2048 samples on cpu" in out
        assert re.search(rf"^\[rank {rank}\] rank {rank}: done, parameter checksum ", out, re.M)
    assert "[rank 0] epoch 1/2: mean loss over 2 rank(s)" in out
    assert "[rank 0] epoch 2/2: mean loss over 2 rank(s)" in out
    assert "[rank 1] epoch" not in out  # loss and the verdict are the main process's to print
    checks = PASS_LINE.findall(out)
    assert len(checks) == 1, out
    checksum, first_loss, last_loss = checks[0]
    assert float(last_loss) < float(first_loss)  # it learns, it does not just run
    assert f"[rank 1] rank 1: done, parameter checksum {checksum}" in out
    assert "epoch 2/2" in result.stderr  # the main process's progress bar


def test_bf16_mixed_precision_under_spawn():
    """spawn pickles the launched function: it must be a module-level function."""
    result = xlaunch_demo("--num-processes", "2", "--epochs", "1", "--steps", "3",
                          "--mixed-precision", "bf16", "--start-method", "spawn")
    assert result.returncode == 0, result.stderr
    assert "mixed precision bf16" in result.stdout and "(gloo, spawn)" in result.stdout
    assert len(PASS_LINE.findall(result.stdout)) == 1, result.stdout


def test_bad_value_exits_2():
    result = xlaunch_demo("--mixed-precision", "fp8")
    assert result.returncode == 2
    assert "mixed_precision='fp8' is not one of no, fp16, bf16" in result.stderr


def test_two_processes_by_default_on_a_cpu_only_machine():
    assert default_num_processes(Environment("local", "cpu", 1)) == 2
    assert default_num_processes(Environment("local", "cuda", 4)) is None
    assert default_num_processes(Environment("colab", "tpu", 4, tpu_generation="v2/v3", tpu_chips=2,
                                             cores_per_chip=2, xla_device="TPU")) is None
    assert default_num_processes(Environment("local", "cpu", 1, xla_device="CPU")) is None


@pytest.mark.parametrize("rows, agree", [
    ([[1.0, 2.0], [1.0, 2.0], [1.0, 2.0]], True),
    ([[1.0, 2.0], [1.0, 2.0 + 1e-6]], False),
    ([[1.0, 2.0]], True),
])
def test_agreement_is_exact(rows, agree):
    agreed, difference = ranks_agree(torch.tensor(rows, dtype=torch.float64))
    assert agreed is agree and (difference == 0.0) is agree
