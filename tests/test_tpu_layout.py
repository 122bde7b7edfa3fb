"""TPU layouts on fake machines: processes, threads, each worker's variables, and refusals.

Runs without torch_xla: the layout is decided from `detect()` alone, before anything starts.
A legacy TPU Node is recognised here too, and refused by the plan before anything starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.fakes import COLAB, KAGGLE, fake_machine
from xlaunch.detect.environment import detect
from xlaunch.plan import XlaSpec, make_plan
from xlaunch.plan.options import LaunchOptions
from xlaunch.plan.tpu_layout import KAGGLE_PRESETS, ONE_CHIP, TpuLayout, tpu_layout

V3_8 = dict(tpu_chips=4, tpu_device="0x0027", dev="accel")  # Kaggle's TPU: 4 chips x 2 cores
V5E_8 = dict(tpu_chips=8, tpu_device="0x0063", dev="vfio")
V5E_1 = dict(tpu_chips=1, tpu_device="0x0063", dev="vfio")  # Colab's TPU today
KAGGLE_TPU = {**KAGGLE, "TPU_PROCESS_ADDRESSES": "local", "CLOUD_TPU_TASK_ID": "0"}


@pytest.mark.parametrize("environ", [{}, KAGGLE_TPU], ids=["plain", "kaggle-presets"])
@pytest.mark.parametrize("machine, num_processes, expected", [
    # every core: one process per chip, one thread per core; Kaggle's single-process presets go
    (V3_8, None, TpuLayout(4, 2, unset_env=KAGGLE_PRESETS)),
    (V3_8, 8, TpuLayout(4, 2, unset_env=KAGGLE_PRESETS)),
    (V5E_8, None, TpuLayout(8, 1, unset_env=KAGGLE_PRESETS)),
    (V5E_8, 8, TpuLayout(8, 1, unset_env=KAGGLE_PRESETS)),
    # one process: nothing to unset, a single process is what the presets describe
    (V5E_1, None, TpuLayout(1, 1)),
    (V5E_1, 1, TpuLayout(1, 1)),
    # one replica of several: xmp.spawn(nprocs=1), which pins chip 0 itself
    (V3_8, 1, TpuLayout(1, 1, nprocs=1)),
    (V5E_8, 1, TpuLayout(1, 1, nprocs=1)),
])
def test_layouts(tmp_path: Path, environ: dict[str, str], machine: dict[str, Any],
                 num_processes: int | None, expected: TpuLayout) -> None:
    env = detect(environ, root=fake_machine(tmp_path, **machine))
    assert tpu_layout(env, num_processes) == expected
    plan = make_plan(env, LaunchOptions(num_processes=num_processes))
    spec = plan.spec
    assert isinstance(spec, XlaSpec)
    assert (plan.path, plan.dist_backend, spec.start_method) == ("xla", "xla", "fork")
    assert (plan.num_processes, spec.threads_per_process) == (expected.processes,
                                                              expected.threads_per_process)
    assert plan.world_size == expected.replicas
    assert (dict(spec.layout_env), spec.unset_env, spec.nprocs) == (
        dict(expected.env), expected.unset_env, expected.nprocs)


def test_one_chip_with_both_cores_on_v3(tmp_path: Path) -> None:
    """2 on a v3-8: one process on chip 0 (TPU_PROCESS_BOUNDS=1,1,1), a thread per core."""
    env = detect(KAGGLE_TPU, root=fake_machine(tmp_path, **V3_8))
    layout = tpu_layout(env, 2)
    assert (layout.processes, layout.threads_per_process, layout.replicas) == (1, 2, 2)
    assert dict(layout.env) == ONE_CHIP == {
        "TPU_VISIBLE_CHIPS": "0", "TPU_PROCESS_BOUNDS": "1,1,1",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1"}
    assert layout.unset_env == () and layout.nprocs is None
    assert "chip 0" in layout.notes[0]
    assert make_plan(env, LaunchOptions(num_processes=2)).world_size == 2


@pytest.mark.parametrize("machine, num_processes, valid, invalid", [
    (V3_8, 3, ["None or 8 (every core)", "1 (one core)", "2 (one chip, all its cores)"], []),
    (V3_8, 4, ["None or 8", "2 (one chip"], []),
    (V3_8, 16, ["None or 8"], []),
    (V5E_8, 2, ["None or 8 (every core)", "1 (one core)"], ["(one chip"]),
    (V5E_8, 4, ["None or 8", "1 (one core)"], ["(one chip"]),
    (V5E_1, 2, ["None or 1 (every core)"], []),
])
def test_refusals_name_the_values_that_work(tmp_path: Path, machine: dict[str, Any],
                                            num_processes: int, valid: list[str],
                                            invalid: list[str]) -> None:
    env = detect({}, root=fake_machine(tmp_path, **machine))
    with pytest.raises(ValueError) as refused:
        make_plan(env, LaunchOptions(num_processes=num_processes))
    message = str(refused.value)
    assert f"num_processes={num_processes}" in message
    assert f"{env.tpu_chips} chip(s) x {env.cores_per_chip} core(s)" in message
    for text in valid:
        assert text in message
    for text in invalid:
        assert text not in message


def test_tpu_asked_for_without_chips(tmp_path: Path) -> None:
    env = detect({"XLAUNCH_ACCELERATOR": "tpu"}, root=fake_machine(tmp_path))
    with pytest.raises(ValueError, match="no TPU chips"):
        tpu_layout(env, None)


@pytest.mark.parametrize("num_processes, expected", [
    (None, TpuLayout(1, 4)),  # PJRT's CPU client: one process, a thread per device
    (4, TpuLayout(1, 4)),
    (1, TpuLayout(1, 1, nprocs=1)),
])
def test_xla_on_cpu_devices(tmp_path: Path, num_processes: int | None,
                            expected: TpuLayout) -> None:
    environ = {"XLAUNCH_ACCELERATOR": "xla", "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    env = detect(environ, root=fake_machine(tmp_path))
    assert tpu_layout(env, num_processes) == expected
    with pytest.raises(ValueError, match=r"num_processes=2 .*CPU, 4 device.*None or 4"):
        tpu_layout(env, 2)


def test_xla_on_gpus_is_a_process_per_gpu(tmp_path: Path) -> None:
    environ = {"XLAUNCH_ACCELERATOR": "xla", "PJRT_DEVICE": "CUDA", "GPU_NUM_DEVICES": "2"}
    env = detect(environ, root=fake_machine(tmp_path, gpus=2))
    assert tpu_layout(env, None) == TpuLayout(2, 1)


# --- legacy TPU Node ---------------------------------------------------------------------------

TPU_NODE = {**COLAB, "COLAB_TPU_ADDR": "10.0.0.2:8470", "TPU_NAME": "grpc://10.0.0.2:8470"}


def test_a_tpu_node_is_recognised_and_refused_in_one_message_before_anything_starts(
        tmp_path: Path) -> None:
    env = detect(TPU_NODE, root=fake_machine(tmp_path))
    assert env.legacy_tpu_node
    with pytest.raises(RuntimeError) as refused:
        make_plan(env)
    message = str(refused.value)
    assert "legacy TPU Node" in message and "TPU VM" in message and "2025" in message
    assert message.count(". ") <= 4  # one message, not a page
