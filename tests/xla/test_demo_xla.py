"""`xlaunch demo` on the XLA path: the TPU branch of the demo, run for real on XLA's CPU device.

The conftest sets ``XLAUNCH_ACCELERATOR=xla PJRT_DEVICE=CPU CPU_NUM_DEVICES=1``: one replica, the
only XLA world this machine can run reliably. It still runs every torch_xla call the demo makes
on a TPU (``xm.optimizer_step``, ``xm.all_reduce``, ``xm.all_gather``, bf16 autocast on the XLA
device), so an API torch_xla renamed or removed fails here rather than on a user's TPU.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.xla,
    pytest.mark.timeout(240),
    pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None,
                       reason="needs torch_xla (the xla test tier)"),
]


def test_demo_trains_on_the_xla_device_in_bf16():
    result = subprocess.run(
        [sys.executable, "-m", "xlaunch", "demo", "--epochs", "2", "--steps", "3",
         "--mixed-precision", "bf16", "--timeout", "180"],
        env=dict(os.environ), capture_output=True, text=True, timeout=220,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert re.search(r"^  launch +xla \(torch_xla xmp.spawn\)", out, re.M), out
    assert "mixed precision bf16" in out
    assert "rank 0/1: training on 2048 of 2048 samples on xla:0" in out
    assert "epoch 2/2: mean loss over 1 rank(s)" in out
    verdict = re.search(r"^PASS: all 1 rank\(s\) hold identical parameters \(\d+ values, "
                        r"checksum -?\d+\.\d+\); loss (\d+\.\d+) -> (\d+\.\d+)$", out, re.M)
    assert verdict, out
    assert float(verdict.group(2)) < float(verdict.group(1))
