"""`xlaunch check` on the XLA path (the CPU device): the steps pass, and the training step judges
compilations from torch_xla's own counters, as the launch report reads them."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.xla,
    pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None,
                       reason="needs torch_xla (the xla test tier)"),
]


def test_check_passes_on_the_xla_device_and_reads_the_reports_compilations():
    result = subprocess.run([sys.executable, "-m", "xlaunch", "check", "--json"],
                            env=dict(os.environ), capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stdout + result.stderr
    verdict = json.loads(result.stdout)
    assert verdict["ok"] is True and verdict["plan"]["path"] == "xla"
    steps = {step["name"]: step for step in verdict["steps"]}
    assert "XLA graph(s) compiled in warm-up, none in the 4 steady steps" in steps["training"]["detail"]
    ranks = verdict["report"]["ranks"]
    assert len(ranks) == 1 and ranks[0]["compiles"] >= 1
    assert "XLA graph(s) at most per rank" in steps["result"]["detail"]


def test_a_shape_that_changes_every_step_fails_the_training_step():
    """A batch one row longer at each step: XLA compiles a graph per step, the check says so."""
    code = (
        "from xlaunch.cli import check\n"
        "from xlaunch.cli.check_steps import STEPS, CheckConfig\n"
        "from xlaunch.detect import detect\n"
        "from xlaunch.plan import LaunchOptions, make_plan\n"
        "plan = make_plan(detect(), LaunchOptions(timeout=200.0, report=False))\n"
        "steps = {name: check.Step(name) for name in ('plan', *STEPS, 'result')}\n"
        "verdict = {'error': None}\n"
        "check._launch(plan, steps, verdict, STEPS, CheckConfig(world_size=1, grow_batch=1))\n"
        "print([(s.name, s.ok) for s in steps.values()])\n"
        "print(steps['training'].detail)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], env=dict(os.environ),
                            capture_output=True, text=True, timeout=280)
    assert result.returncode == 0, result.stderr
    first, detail = result.stdout.splitlines()[-2:]
    assert "('barrier', True), ('training', False)" in first, result.stdout
    assert "XLA compilation(s) in the 4 steps after warm-up at an unchanged shape" in detail
