"""accelerate's option spellings reach an `Accelerator()` in the workers as `accelerate launch`
gives them: through the variables accelerate reads (ACCELERATE_MIXED_PRECISION,
ACCELERATE_USE_CPU), set in every worker. Real accelerate, real worker processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("accelerate")

SCRIPT = """
    import json, os
    from accelerate import Accelerator

    accelerator = Accelerator()
    print("SEEN " + json.dumps({
        "rank": accelerator.process_index, "world": accelerator.num_processes,
        "mixed_precision": accelerator.mixed_precision, "device": str(accelerator.device),
        "use_cpu": os.environ.get("ACCELERATE_USE_CPU")}), flush=True)
"""
STEERING = ("XLAUNCH_ACCELERATOR", "PJRT_DEVICE", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_CPU")


def run(tmp_path, *options: str) -> list[dict]:
    script = tmp_path / "uses_accelerate.py"
    script.write_text(textwrap.dedent(SCRIPT))
    env = {k: v for k, v in os.environ.items() if k not in STEERING}
    env["XLAUNCH_ACCELERATOR"] = "cpu"
    result = subprocess.run([sys.executable, "-m", "xlaunch", "run", *options, str(script)],
                            env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    seen = [json.loads(line.split("SEEN ", 1)[1]) for line in result.stdout.splitlines()
            if "SEEN " in line]
    return sorted(seen, key=lambda item: item["rank"])


def test_mixed_precision_and_num_processes_reach_accelerator(tmp_path):
    seen = run(tmp_path, "--mixed_precision", "bf16", "--num_processes", "2")
    assert [item["rank"] for item in seen] == [0, 1]
    assert all(item["world"] == 2 and item["mixed_precision"] == "bf16" for item in seen), seen


def test_cpu_reaches_accelerator(tmp_path):
    seen = run(tmp_path, "--cpu", "--num_processes", "2")
    assert all(item["use_cpu"] == "True" and item["device"].startswith("cpu") for item in seen), seen
    assert all(item["mixed_precision"] == "no" and item["world"] == 2 for item in seen), seen


def test_notebook_launcher_mixed_precision_reaches_accelerator(tmp_path):
    code = textwrap.dedent("""
        import xlaunch

        def train():
            from accelerate import Accelerator
            accelerator = Accelerator()
            return accelerator.mixed_precision, accelerator.num_processes

        print("RESULT", xlaunch.notebook_launcher(train, num_processes=2, mixed_precision="BF16"))
    """)
    env = {k: v for k, v in os.environ.items() if k not in STEERING}
    env["XLAUNCH_ACCELERATOR"] = "cpu"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "RESULT ('bf16', 2)" in result.stdout, result.stdout


def test_an_accelerate_option_xlaunch_cannot_honour_is_refused(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("pass\n")
    result = subprocess.run([sys.executable, "-m", "xlaunch", "run", "--dynamo_backend", "inductor",
                             str(script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--dynamo_backend" in result.stderr
