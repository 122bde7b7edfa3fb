"""``xlaunch run`` on scripts shaped like pytorch/xla's own examples, unchanged, on the CPU device.

pytorch/xla's examples end in ``torch_xla.launch(_mp_fn, args=(flags,))`` (2.5 and later) or
``xmp.spawn(_mp_fn, args=(flags,), nprocs=...)`` (older ones); ``_mp_fn`` takes the index first.
Each script here runs both with plain ``python`` and with ``xlaunch run``.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.xla,
    pytest.mark.timeout(240),
    pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None,
                       reason="needs torch_xla (the xla test tier)"),
]

EXAMPLE = """
    import argparse
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.xla_multiprocessing as xmp
    import torch_xla.runtime as xr


    def _mp_fn(index, flags):
        torch.manual_seed(0)
        device = torch_xla.device()
        model = torch.nn.Linear(4, 1).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.ones(8, 4, device=device) * flags.scale).pow(2).mean()
        loss.backward()
        xm.optimizer_step(optimizer)
        torch_xla.sync()
        xm.rendezvous("finished")
        print(f"index={{index}} ordinal={{xr.global_ordinal()}} world={{xr.world_size()}} "
              f"loss={{loss.item():.3f}}", flush=True)


    if __name__ == "__main__":
        parser = argparse.ArgumentParser()
        parser.add_argument("--scale", type=float, default=1.0)
        parser.add_argument("--num_cores", type=int, default=None)
        FLAGS = parser.parse_args()
        {launch}
"""
LAUNCHES = {
    "torch_xla.launch": "torch_xla.launch(_mp_fn, args=(FLAGS,))",
    "xmp.spawn": "xmp.spawn(_mp_fn, args=(FLAGS,), nprocs=FLAGS.num_cores)",
}


def run(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "1"}
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.parametrize("launch", LAUNCHES)
def test_an_upstream_style_example_runs_unchanged(tmp_path: Path, launch: str) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(EXAMPLE.format(launch=LAUNCHES[launch])))
    plain = run([sys.executable, str(script), "--scale", "2"], tmp_path)
    assert plain.returncode == 0, plain.stderr[-3000:]
    through = run([sys.executable, "-m", "xlaunch", "run", str(script), "--scale", "2"], tmp_path)
    assert through.returncode == 0, through.stderr[-3000:]
    expected = "index=0 ordinal=0 world=1 loss="
    assert expected in plain.stdout and expected in through.stdout
    assert plain.stdout.split("loss=")[1].split()[0] == through.stdout.split("loss=")[1].split()[0]


OLD_CALLS = """
    import torch_xla.core.xla_model as xm
    print("ordinal", xm.get_ordinal())
"""


def test_a_removed_torch_xla_call_is_named_with_its_replacement(tmp_path: Path) -> None:
    script = tmp_path / "old.py"
    script.write_text(textwrap.dedent(OLD_CALLS))
    result = run([sys.executable, "-m", "xlaunch", "run", str(script)], tmp_path)
    assert result.returncode == 1
    assert "has no attribute 'get_ordinal'" in result.stderr
    assert "use torch_xla.runtime.global_ordinal()" in result.stderr
