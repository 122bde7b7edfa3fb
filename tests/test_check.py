"""`xlaunch check` as a user runs it: a real launch of 2 CPU processes and a verdict.

Every test starts real workers (cheap on CPU). What is checked is what a user sees: the exit
status, one line per step, the verdict, the JSON; a failure names its step and shows the error.
Nothing asserts a duration.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from xlaunch.cli import check
from xlaunch.cli.check_steps import STEPS, CheckConfig
from xlaunch.detect import detect
from xlaunch.plan import LaunchOptions, make_plan

STEERING = ("XLAUNCH_ACCELERATOR", "PJRT_DEVICE", "CPU_NUM_DEVICES", "GPU_NUM_DEVICES")
ALL_STEPS = ["plan", *STEPS, "result"]


def xlaunch_check(*args: str, accelerator: str = "cpu") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in STEERING}
    env["XLAUNCH_ACCELERATOR"] = accelerator
    return subprocess.run([sys.executable, "-m", "xlaunch", "check", *args], env=env,
                          capture_output=True, text=True, timeout=280)


def test_check_passes_on_two_cpu_processes_with_every_step_timed():
    result = xlaunch_check()
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "xlaunch check"
    rows = lines[1:-1]
    assert [row.split()[1] for row in rows] == ALL_STEPS, result.stdout
    assert all(row.split()[0] == "ok" and " s  " in row for row in rows), result.stdout
    assert "2 CPU processes through torch.multiprocessing" in rows[0]
    assert "2 rank(s) started" in rows[1] and "sum 3 on every rank" in rows[2]
    assert "none in the 4 steady steps" in rows[4], rows[4]
    assert lines[-1].startswith("xlaunch check: ok, every step held")


def test_check_json_says_ok_and_carries_the_plan_and_report():
    result = xlaunch_check("--json")
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)
    assert verdict["ok"] is True and verdict["failed_step"] is None
    assert [step["name"] for step in verdict["steps"]] == ALL_STEPS
    assert all(step["ok"] and step["seconds"] is not None for step in verdict["steps"])
    assert verdict["plan"]["world_size"] == 2
    assert [rank["rank"] for rank in verdict["report"]["ranks"]] == [0, 1]


def test_check_takes_the_launch_options():
    result = xlaunch_check("--json", "--num_processes", "1")  # accelerate's spelling
    assert result.returncode == 0, result.stderr
    verdict = json.loads(result.stdout)
    assert verdict["plan"]["world_size"] == 1 and verdict["plan"]["path"] == "inline"


def test_a_forced_accelerator_without_its_hardware_fails_saying_so():
    result = xlaunch_check(accelerator="cuda")
    assert result.returncode == 1
    assert "FAIL plan" in result.stdout.replace("  ", " ")
    assert "xlaunch check: FAILED at step plan" in result.stdout
    assert "no GPU is visible" in result.stdout
    verdict = json.loads(xlaunch_check("--json", accelerator="cuda").stdout)
    assert verdict["ok"] is False and verdict["failed_step"] == "plan"
    assert all(step["ok"] is None for step in verdict["steps"][1:])


def test_a_step_that_fails_in_the_workers_is_named_with_the_error(monkeypatch):
    """Workers told to expect 3 ranks while 2 run: the ranks step fails in each, by name."""
    monkeypatch.setenv("XLAUNCH_ACCELERATOR", "cpu")
    plan = make_plan(detect(), LaunchOptions(num_processes=2, timeout=200.0, report=False))
    steps = {name: check.Step(name) for name in ALL_STEPS}
    verdict: dict[str, object] = {"error": None}
    check._launch(plan, steps, verdict, STEPS, CheckConfig(world_size=3))
    assert steps["ranks"].ok is False
    assert "sees rank" in steps["ranks"].detail and "planned 3 ranks" in steps["ranks"].detail
    assert all(steps[name].ok is None for name in STEPS[1:])
    assert "CheckFailed: ranks:" in str(verdict["error"])


@pytest.mark.parametrize("rows", [0, 1])
def test_training_step_counts_torch_compile_graphs(rows):
    """One process: the steady loop compiles in warm-up only; dynamo's counters say so. In a
    fresh interpreter: a compiled backward here would start autograd's device threads in the test
    process (torch's CUDA builds), and every later forked launch of the suite would be spawned."""
    code = ("import json\nfrom xlaunch.cli.check_steps import CheckConfig, run_checks\n"
            f"print(json.dumps(run_checks(CheckConfig(world_size=1, grow_batch={rows}))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "XLAUNCH_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    training = json.loads(done.stdout.strip().splitlines()[-1])["training"]
    assert training["compiler"] == "torch.compile" and training["warmup_compiles"] >= 1
    assert training["steady_compiles"] == 0  # dynamo marks the growing dimension dynamic


def test_a_one_process_check_forms_a_group_of_one_and_all_reduces_over_it():
    """One process is the caller's own: the check forms a real process group of one there (gloo
    on the CPU, NCCL on a GPU), so its all-reduce is the path's collective, not skipped."""
    result = xlaunch_check("--num_processes", "1")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {row.split()[1]: row for row in result.stdout.splitlines()[1:-1]}
    assert "1 rank(s) started" in rows["ranks"] and "(gloo)" in rows["ranks"], rows["ranks"]
    assert "sum 1 on every rank (gloo)" in rows["all-reduce"], rows["all-reduce"]


def test_the_group_of_one_ends_with_the_check():
    # In its own interpreter: the check's training steps run a backward in the calling process,
    # which starts autograd's device threads on torch's CUDA builds, and the plans of the tests
    # after it would then spawn their workers (the machine fact `autograd_threads`).
    code = textwrap.dedent("""
        import json, torch.distributed as dist
        from xlaunch.cli.check_steps import CheckConfig, run_checks
        done = run_checks(CheckConfig(world_size=1))
        print(json.dumps([done["details"]["all-reduce"], dist.is_initialized()]))
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == ["sum 1 on every rank (gloo)",
                                                                 False]


def test_the_cuda_check_script_says_there_is_nothing_to_check_without_a_gpu(tmp_path):
    """scripts/check-cuda.sh checks the CUDA path where nvidia-smi is; elsewhere it exits 0."""
    import shutil
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "check-cuda.sh"
    bash = shutil.which("bash")
    assert bash is not None
    assert subprocess.run([bash, "-n", str(script)]).returncode == 0
    tools = tmp_path / "bin"  # what the script needs before it looks for nvidia-smi, and no more
    tools.mkdir()
    (tools / "dirname").symlink_to(shutil.which("dirname"))
    result = subprocess.run([bash, str(script)], env={"PATH": str(tools)}, capture_output=True,
                            text=True, timeout=30)
    assert (result.returncode, result.stdout) == (0, "no GPU: nothing to check\n"), result.stderr
