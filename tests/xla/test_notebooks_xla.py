"""The TPU notebooks in colab/, run end to end in a Jupyter kernel of this (torch_xla) venv.

The tests on the CPU path (tests/notebooks) cannot reach the notebooks' TPU branch. Here the kernel
gets this tier's ``XLAUNCH_ACCELERATOR=xla PJRT_DEVICE=CPU CPU_NUM_DEVICES=1``: the notebook's
runtime check lets XLA through, and its launch takes the XLA path with one replica, so the TPU
code runs for real: ``xm.optimizer_step``, ``torch_xla.sync()``, bf16 autocast on the XLA device.
An API that torch_xla renames or removes fails here, not in a user's Colab. A last cell, added by
the test, launches the notebook's own ``train`` again with counting wrappers around those calls
and a forward hook, to show that they ran, and on which device and dtype.
"""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernels import kernel_environment

pytestmark = [
    pytest.mark.xla,
    pytest.mark.notebook,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None
                       or importlib.util.find_spec("nbclient") is None,
                       reason="needs torch_xla and nbclient (the xla test tier)"),
]

psutil = pytest.importorskip("psutil")
nbformat = pytest.importorskip("nbformat")

COLAB = Path(__file__).resolve().parents[2] / "colab"
TPU_NOTEBOOKS = ["tpu_colab_quickstart.ipynb", "tpu_kaggle.ipynb"]
KERNEL_NAME = "xlaunch-xla-tests"
CELL_TIMEOUT = 400  # seconds for one cell: the first XLA compilations on a busy 2-core machine
MARK = "XLAUNCH-TEST-PROBE "
PROBE_STEPS = 5

# Launches the notebook's own `train` once more, counting the TPU calls it makes and noting the
# device and dtype of every Linear output (bf16 under autocast on XLA), then prints the findings.
PROBE = f'''
def probe(steps):
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    calls = {{"optimizer_step": 0, "sync": 0}}
    outputs = set()
    real_step, real_sync = xm.optimizer_step, torch_xla.sync

    def counted_step(*args, **kwargs):
        calls["optimizer_step"] += 1
        return real_step(*args, **kwargs)

    def counted_sync(*args, **kwargs):
        calls["sync"] += 1
        return real_sync(*args, **kwargs)

    def note(module, inputs, output):
        if isinstance(module, torch.nn.Linear):
            outputs.add(f"{{output.device.type}} {{output.dtype}}")

    xm.optimizer_step, torch_xla.sync = counted_step, counted_sync
    hook = torch.nn.modules.module.register_module_forward_hook(note)
    try:
        result = train(steps)
    finally:
        hook.remove()
        xm.optimizer_step, torch_xla.sync = real_step, real_sync
    return {{"result": result, "calls": calls, "linear_outputs": sorted(outputs)}}

import json
probed = notebook_launcher(probe, args=({PROBE_STEPS},), mixed_precision="bf16", timeout=600)
print({MARK!r} + json.dumps({{"notebook": result, "probe": probed}}))
'''


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A kernel of the torch_xla venv; the tier's XLAUNCH_ACCELERATOR=xla PJRT_DEVICE=CPU stay."""
    # torch 2.8's CUDA build starts inductor's compile-worker pool when torch_xla is imported:
    # processes of torch's, not of a launch, that would blur the check on what a launch left.
    with kernel_environment(tmp_path_factory, KERNEL_NAME, "xlaunch torch_xla tests",
                            TORCH_WARM_POOL="0") as env:
        env.pop("XLAUNCH_NOTEBOOK_ALLOW_NO_TPU", None)  # XLA must pass the runtime check itself
        yield env


def tagged(nb: nbformat.NotebookNode, tag: str) -> nbformat.NotebookNode:
    (cell,) = [cell for cell in nb.cells if tag in cell.metadata.get("tags", [])]
    return cell


def stdout(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.outputs
                   if o.output_type == "stream" and o.name == "stdout")


def run_notebook(path: Path, env: dict[str, str], cwd: Path) -> tuple[nbformat.NotebookNode, list]:
    """Every cell, then the probe; returns the notebook and what was alive after its own cells."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    own_cells = len(nb.cells)
    nb.cells.append(nbformat.v4.new_code_cell(PROBE))
    client = NotebookClient(nb, kernel_name=KERNEL_NAME, timeout=CELL_TIMEOUT,
                            startup_timeout=180, allow_errors=False)
    seen: list = []
    alive_after_cells: list = []
    with client.setup_kernel(env=env, cwd=str(cwd)):
        kernel = psutil.Process(client.km.provisioner.process.pid)
        try:
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)
                seen.extend(kernel.children(recursive=True))
                if index == own_cells - 1:
                    alive_after_cells = [p for p in kernel.children(recursive=True) if p.is_running()]
        finally:
            seen.extend(kernel.children(recursive=True))
    survivors = [p for p in seen if p.is_running()]
    for process in survivors:
        process.kill()
    assert not survivors, f"processes outlived the kernel (killed now): {survivors}"
    return nb, alive_after_cells


@pytest.mark.parametrize("name", TPU_NOTEBOOKS)
def test_tpu_notebook_runs_its_xla_code_on_the_xla_device(name: str, kernel_env: dict[str, str],
                                                          tmp_path: Path) -> None:
    nb, alive = run_notebook(COLAB / name, kernel_env, tmp_path)
    assert not alive, f"the launch left processes running in the kernel: {alive}"

    env_table = stdout(tagged(nb, "env"))
    assert re.search(r"^  path +xla \(torch_xla xmp.spawn\)", env_table, re.M), env_table
    launch = stdout(tagged(nb, "launch"))
    assert re.search(r"^process 0 of 1 on xla:0: 2048 samples$", launch, re.M), launch
    assert "training worked" in stdout(tagged(nb, "check"))
    machine_check = stdout(tagged(nb, "machine-check"))
    assert "xlaunch check: ok, every step held" in machine_check, machine_check
    if name == "tpu_kaggle.ipynb":  # FSDPv2 under SPMD, on the tier's one CPU device
        assert re.search(r"^FSDPv2 over 1 device\(s\): loss", stdout(tagged(nb, "spmd")), re.M)

    found = json.loads(stdout(nb.cells[-1]).split(MARK, 1)[1])
    result = found["notebook"]
    assert result["device"] == "xla:0" and result["processes"] == 1, result
    assert result["mixed_precision"] == "bf16"
    assert result["final_loss"] < result["initial_loss"] / 4, result  # the XLA steps trained it

    probe = found["probe"]
    assert probe["calls"]["optimizer_step"] == PROBE_STEPS, probe
    assert probe["calls"]["sync"] >= PROBE_STEPS, probe
    # Under autocast the Linear layers ran in bf16 on the XLA device; outside it (the full-data
    # loss) in float32.
    assert "xla torch.bfloat16" in probe["linear_outputs"], probe
    assert all(entry.startswith("xla ") for entry in probe["linear_outputs"]), probe
    assert probe["result"]["device"] == "xla:0"
