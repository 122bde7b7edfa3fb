"""Which TPU runtime fits, as data: installed versions, chips and torch releases in, a runtime out.

The real packages are installed in the torch_tpu tier (tests/torch_tpu); here the decisions are
checked for every case, and detection with ``XLAUNCH_TPU_RUNTIME`` on fake machines.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes import KAGGLE, fake_machine, torch_release, torch_tpu_line, xla_pin
from xlaunch.detect import detect
from xlaunch.detect.runtime import install_line, installed_runtime, runtime_override

TORCH_TPU = {"torch": "2.13.0+cpu", "torch-tpu": "0.2.0", "torch_xla": None}
TORCH_XLA = {"torch": "2.9.0", "torch_xla": "2.9.0", "torch-tpu": None}


@pytest.mark.parametrize(("chip", "versions", "runtime"), [
    ("0x0063", TORCH_TPU, "torch_tpu"),  # v5e, torch 2.13 + torch-tpu
    ("0x0076", TORCH_TPU, "torch_tpu"),  # v7
    ("0x0027", TORCH_TPU, None),  # v2/v3: TorchTPU does not know them
    ("0x0027", TORCH_XLA, "torch_xla"),
    ("0x0063", TORCH_XLA, "torch_xla"),
    ("0x0063", {**TORCH_XLA, "torch_xla": "2.8.0"}, None),  # torch_xla 2.8 on torch 2.9: broken
    ("0x0063", {**TORCH_TPU, "torch": "2.10.0"}, None),  # below torch-tpu's torch range
    ("0x0063", {**TORCH_TPU, "torch": "2.16.0"}, None),  # above it
    ("0x0063", {"torch": "2.13.0", "torch_xla": None, "torch-tpu": None}, None),
    # torch_xla and torch-tpu both installed: only the one that fits torch counts.
    ("0x006f", {"torch": "2.13.0", "torch_xla": "2.9.0", "torch-tpu": "0.2.0"}, "torch_tpu"),
    ("0x006f", {"torch": "2.9.0", "torch_xla": "2.9.0", "torch-tpu": "0.2.0"}, "torch_xla"),
])
def test_the_installed_runtime_that_fits(chip: str, versions: dict, runtime: str | None) -> None:
    assert installed_runtime(chip, versions) == runtime


@pytest.mark.parametrize(("generation", "torch"), [("v5e", "2.13.0+cpu"), ("v6e", "2.15.1"),
                                                  ("7x", "2.11.0")])
def test_install_line_is_torch_tpu_where_torch_fits(generation: str, torch: str) -> None:
    assert install_line(generation, torch_version=torch) == "pip install torch-tpu"


def test_install_line_fits_the_tpu_and_the_torch() -> None:
    # A Kaggle v3-8 on torch 2.13: torch_xla with its own torch (TorchTPU cannot run there).
    v3 = install_line("v2/v3", torch_version="2.13.0")
    assert v3.startswith('pip install torch==2.9.0 "torch_xla[tpu]==2.9.0"') and "v2/v3" in v3
    assert install_line("v2/v3", torch_version="2.8.0").startswith('pip install "torch_xla[tpu]==2.8.0"')
    # torch 2.9 on a v5e keeps its torch: torch_xla of the same number.
    assert install_line("v5e", torch_version="2.9.0").startswith('pip install "torch_xla[tpu]==2.9.0"')
    # A torch no runtime accepts: torch-tpu with a torch it takes.
    assert install_line("v5e", torch_version="2.10.0").startswith(
        'pip install "torch>=2.11,<2.16" torch-tpu')
    # The XLA path on a CPU device needs torch_xla, whatever torch says.
    assert "torch_xla" in install_line(runtime="torch_xla", torch_version="2.13.0")


def test_override_names_a_runtime_or_is_refused() -> None:
    assert runtime_override({"XLAUNCH_TPU_RUNTIME": "Torch_TPU"}) == "torch_tpu"
    assert runtime_override({}) is None
    with pytest.raises(ValueError, match="XLAUNCH_TPU_RUNTIME='jax' is not one of"):
        runtime_override({"XLAUNCH_TPU_RUNTIME": "jax"})


def test_torch_tpu_counts_vfio_devices(tmp_path: Path) -> None:
    on_tpu = {"XLAUNCH_TPU_RUNTIME": "torch_tpu"}
    env = detect({**KAGGLE, **on_tpu}, root=fake_machine(tmp_path, tpu_chips=8, tpu_device="0x0063",
                                                       dev="vfio"))
    assert (env.tpu_runtime, env.device_count, env.tpu_generation, env.xla_device) == (
        "torch_tpu", 8, "v5e", None)
    # v7: TorchTPU runs a process per device, two devices per chip.
    env = detect(on_tpu, root=fake_machine(tmp_path, tpu_chips=8, tpu_device="0x0076", dev="vfio",
                                           name="v7"))
    assert (env.device_count, env.tpu_chips, env.cores_per_chip, env.tpu_generation) == (8, 4, 2, "7x")
    # 0x0062 is TorchTPU's v5p.
    env = detect(on_tpu, root=fake_machine(tmp_path, tpu_chips=4, tpu_device="0x0062", dev="vfio",
                                           name="v5p"))
    assert (env.device_count, env.tpu_generation) == (4, "v5p")
    # A chip opened through /dev/accel only is no device to TorchTPU.
    env = detect(on_tpu, root=fake_machine(tmp_path, tpu_chips=4, tpu_device="0x005e", dev="accel",
                                           name="v4"))
    assert (env.device_count, env.tpu_chips) == (0, 0)
    # The same v4 on torch_xla: a process per chip.
    env = detect({"XLAUNCH_TPU_RUNTIME": "torch_xla"}, root=fake_machine(
        tmp_path, tpu_chips=4, tpu_device="0x005e", dev="accel", name="v4-xla"))
    assert (env.tpu_runtime, env.device_count, env.xla_device) == ("torch_xla", 4, "TPU")


def test_a_pod_slice_is_read_from_gce_variables(tmp_path: Path) -> None:
    root = fake_machine(tmp_path, tpu_chips=4, tpu_device="0x006f", dev="vfio")
    pod = {"TPU_WORKER_HOSTNAMES": "t1v-0,t1v-1", "TPU_WORKER_ID": "1",
           "XLAUNCH_TPU_RUNTIME": "torch_tpu"}
    env = detect(pod, root=root)
    assert (env.tpu_hosts, env.tpu_host_index) == (("t1v-0", "t1v-1"), 1)
    # One name is a single-host VM (GCE sets it there too): no pod.
    env = detect({**pod, "TPU_WORKER_HOSTNAMES": "t1v-0"}, root=root)
    assert (env.tpu_hosts, env.tpu_host_index) == ((), None)


@pytest.mark.usefixtures("no_tpu_runtime_installed")
def test_env_names_the_install_line_when_no_runtime_fits(tmp_path: Path) -> None:
    from xlaunch.cli.env import env_report, format_report

    # Neither torch_xla nor torch-tpu installed; which line fits depends on this venv's torch.
    v5e = env_report(KAGGLE, root=fake_machine(tmp_path, tpu_chips=8, tpu_device="0x0063", dev="vfio"))
    assert v5e["environment"]["tpu_runtime"] is None
    fits = torch_tpu_line() if (2, 11) <= torch_release() <= (2, 15) else f"=={xla_pin()}"
    assert v5e["missing"] and fits in v5e["missing"][0], v5e["missing"]
    assert "tpu_runtime             none that fits" in format_report(v5e)
    v3 = env_report(KAGGLE, root=fake_machine(tmp_path, tpu_chips=4, tpu_device="0x0027",
                                              dev="accel", name="v3"))
    assert f'"torch_xla[tpu]=={xla_pin()}"' in v3["missing"][0]
