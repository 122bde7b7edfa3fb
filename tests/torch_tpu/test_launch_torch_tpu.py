"""The whole TorchTPU path, launched for real on this machine's CPU.

Detection (a fake v4 host: two VFIO devices), the plan, TorchTPU's own ``set_tpu_launch_env``
in the caller (``TORCH_TPU_TOPOLOGY`` given as on a host), torch elastic, spawned workers that
load TorchTPU once their rank is set, the ``tpu_dist`` process group, ProcessState and the report:
all real, but for the two substitutions of on_cpu/ (gloo for ``tpu_dist``, the CPU for ``tpu``).
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest

import xlaunch
from tests.fakes import fake_machine
from xlaunch import _compat
from xlaunch.api import run_plan
from xlaunch.detect import detect
from xlaunch.plan import LaunchOptions, make_plan


@pytest.fixture
def v4(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A v4 host with two devices, as TorchTPU would see it; its topology given as on a host."""
    monkeypatch.setenv("TORCH_TPU_TOPOLOGY", "1,2,1")
    env = detect({}, root=fake_machine(tmp_path, tpu_chips=2, tpu_device="0x005e", dev="vfio"))
    assert (env.tpu_runtime, env.device_count) == ("torch_tpu", 2)

    def launch(function, args=(), **options):
        return run_plan(make_plan(env, LaunchOptions(**options)), function, args)

    return launch


def inside() -> dict:
    import torch
    import torch.distributed as dist

    state = xlaunch.ProcessState()
    value = torch.tensor([float(state.process_index + 1)], device=state.device)
    dist.all_reduce(value)
    state.wait_for_everyone()
    with state.autocast():
        product = torch.ones(2, 2, device=state.device) @ torch.ones(2, 2, device=state.device)
    return {
        "backend": state.backend, "group": str(dist.get_backend()), "device": str(state.device),
        "rank": state.process_index, "world": state.num_processes, "sum": value.item(),
        "autocast_dtype": str(product.dtype),
        "torch_tpu_loaded": "torch_tpu._loader" in sys.modules,
        "rank_at_autoload": os.environ.get("XLAUNCH_TEST_RANK_AT_AUTOLOAD"),
        "autoload_var": os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD"),
        **{name: os.environ.get(name) for name in (
            "TORCH_TPU_TOPOLOGY", "TORCH_TPU_SLICEBUILDER_ADDRESSES",
            "TORCH_TPU_INTERNAL_HANDSHAKE_PORT", "MASTER_ADDR")},
    }


def test_the_torch_tpu_path_runs_end_to_end(v4, capfd) -> None:
    result = v4(inside, mixed_precision="bf16")
    # TorchTPU's launch variables went to the workers only.
    assert not {*_compat.TPU_LAUNCH_VARS, "TORCH_TPU_INTERNAL_HANDSHAKE_PORT"} - {
        "TORCH_TPU_TOPOLOGY"} & set(os.environ)
    assert (result["backend"], result["group"], result["device"]) == ("tpu_dist", "tpu_dist", "cpu")
    assert (result["rank"], result["world"], result["sum"]) == (0, 2, 3.0)
    assert result["autocast_dtype"] == "torch.bfloat16"
    assert result["torch_tpu_loaded"]
    assert result["rank_at_autoload"] == "0"  # TorchTPU loaded once the rank was set
    assert result["autoload_var"] in (None, "1")  # on again, as the user had it (TorchTPU writes "1")
    assert result["TORCH_TPU_TOPOLOGY"] == "1,2,1"
    addresses = result["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
    assert len(addresses) == 2 and all(a.startswith("localhost:") for a in addresses)
    assert int(result["TORCH_TPU_INTERNAL_HANDSHAKE_PORT"]) != 36423
    assert result["MASTER_ADDR"] == "127.0.0.1"
    report = xlaunch.last_report()
    assert report is not None and report.path == "torch_tpu" and len(report.ranks) == 2
    assert "xlaunch report: torch_tpu launch, 2 rank(s)" in capfd.readouterr().err  # printed


def warns() -> None:
    for _ in range(3):
        warnings.warn("Operator 'aten::histc' is not implemented for TPU. Falling back to CPU", stacklevel=1)
    warnings.warn("<TorchTpu/Performance/Example/> a slow path was taken", stacklevel=1)


def test_the_report_counts_fallbacks_and_torch_tpu_warnings(v4, capfd) -> None:
    v4(warns)
    report = xlaunch.last_report()
    assert report is not None
    for rank in report.ranks:
        assert rank.cpu_fallbacks == {"aten::histc": 3}
        assert rank.tpu_warnings["TorchTpu/Performance/Example/"] == 1
        assert rank.compiles is None  # no TorchTPU runtime ran: nothing asked of its cache
    assert any("aten::histc (6 time(s))" in text and "no TPU kernel" in text
               for text in report.warnings)
    assert any("<TorchTpu/Performance/Example/> (2 time(s))" in text for text in report.warnings)
    err = capfd.readouterr().err
    assert err.count("UserWarning: Operator 'aten::histc'") == 2  # once per rank, as Python shows it


def test_a_function_defined_in_a_cell_runs_on_torch_tpu(v4) -> None:
    # Made in place, as in a notebook: it reaches the spawned workers by value (cloudpickle).
    scale = 3

    def cell_function(offset):
        state = xlaunch.ProcessState()
        return (state.process_index + offset) * scale, state.backend

    assert v4(cell_function, (1,)) == (3, "tpu_dist")


def test_the_cpu_path_with_torch_tpu_installed_spawns_a_cell_function(monkeypatch) -> None:
    # The CPU fallback on a machine with torch-tpu installed: every spawned worker autoloads it.
    monkeypatch.setenv("XLAUNCH_ACCELERATOR", "cpu")
    seen = []

    def cell_function():
        import torch.distributed as dist

        return dist.get_world_size(), "torch_tpu" in sys.modules, len(seen)

    assert xlaunch.notebook_launcher(cell_function, num_processes=2, start_method="spawn") == (
        2, True, 0)


def test_xlaunch_check_judges_torch_tpu_compilations_from_its_cache(v4) -> None:
    # What `xlaunch check` runs in each rank, on the TorchTPU path: ranks, all-reduce and barrier
    # hold; the training step counts compilations from TorchTPU's cache, where (no TPU runtime
    # runs here) it finds none, and says so by name instead of passing.
    from xlaunch.cli.check_steps import CheckConfig, run_checks

    with pytest.raises(xlaunch.LaunchError) as failed:
        v4(run_checks, (CheckConfig(world_size=2),))
    assert "CheckFailed: training: TorchTPU counted no compilation" in str(failed.value)
