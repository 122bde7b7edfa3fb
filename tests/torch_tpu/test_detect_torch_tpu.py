"""Detection and planning with the real torch-tpu package installed (torch 2.13.0 CPU here).

Detection reads package metadata only: the runtime is found without importing torch_tpu. The
topology tables xlaunch plans with are compared with the installed package's own.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fakes import COLAB, KAGGLE, fake_machine
from xlaunch.detect import detect
from xlaunch.detect.chips import CHIPS
from xlaunch.detect.runtime import install_line, installed_versions
from xlaunch.plan import TorchTpuSpec, XlaSpec, make_plan


def test_this_tier_has_torch_tpu_and_no_torch_xla() -> None:
    versions = installed_versions()
    assert versions["torch-tpu"] == "0.2.0" and versions["libtpu"] and versions["torch_xla"] is None


@pytest.mark.parametrize(("device", "chips", "environ", "generation", "devices"), [
    ("0x0063", 8, KAGGLE, "v5e", 8),  # Kaggle's v5e-8
    ("0x0063", 1, COLAB, "v5e", 1),  # Colab's v5e-1
    ("0x006f", 1, COLAB, "v6e", 1),
    ("0x0062", 4, {}, "v5p", 4),
    ("0x0076", 8, {}, "7x", 8),  # four v7 chips, two devices each
])
def test_a_tpu_that_torch_tpu_knows_runs_it(tmp_path: Path, device: str, chips: int,
                                            environ: dict, generation: str, devices: int) -> None:
    env = detect(environ, root=fake_machine(tmp_path, tpu_chips=chips, tpu_device=device, dev="vfio"))
    assert (env.tpu_runtime, env.tpu_generation, env.device_count, env.xla_device) == (
        "torch_tpu", generation, devices, None)
    assert isinstance(make_plan(env).spec, TorchTpuSpec)


def test_kaggles_v3_8_stays_on_torch_xla(tmp_path: Path) -> None:
    env = detect({**KAGGLE, "TPU_PROCESS_ADDRESSES": "local"},
                 root=fake_machine(tmp_path, tpu_chips=4, tpu_device="0x0027", dev="accel"))
    assert (env.tpu_runtime, env.device_count, env.xla_device) == (None, 8, "TPU")
    assert isinstance(make_plan(env).spec, XlaSpec)
    # torch-tpu cannot drive it and torch 2.13 has no torch_xla: the pair that works.
    assert install_line(env.tpu_generation).startswith(
        'pip install torch==2.9.0 "torch_xla[tpu]==2.9.0"')


def test_the_override_picks_torch_xla_on_a_v5e(tmp_path: Path) -> None:
    env = detect({"XLAUNCH_TPU_RUNTIME": "torch_xla"},
                 root=fake_machine(tmp_path, tpu_chips=8, tpu_device="0x0063", dev="vfio"))
    assert (env.tpu_runtime, env.xla_device) == ("torch_xla", "TPU")


def test_detection_imports_neither_runtime(tmp_path: Path) -> None:
    root = fake_machine(tmp_path, tpu_chips=8, tpu_device="0x0063", dev="vfio")
    code = (f"import sys; from xlaunch.detect import detect; env = detect({{}}, root={str(root)!r}); "
            "print(env.tpu_runtime, sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'torch_tpu', 'torch_xla', 'libtpu')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["torch_tpu", "[]"], out.stderr


def test_the_tables_are_torch_tpus_own() -> None:
    """The chip table's TorchTPU column is the installed torch-tpu's: the ids it runs on, each
    one's generation, devices per chip and topologies."""
    from torch_tpu._internal.utils import hardware

    ours = {pci: chip.torch_tpu for pci, chip in CHIPS.items() if chip.torch_tpu is not None}
    theirs = {pci: dict(table) for pci, table in hardware._TOPOLOGY_BY_TPU_PCI_DEVICE_ID.items()}
    assert {pci: dict(chip.topologies) for pci, chip in ours.items()} == theirs
    # TorchTPU's names, spelled as Environment.tpu_generation spells them ("TPU v7" is 7x).
    names = {pci: name.removeprefix("TPU ").replace("v7", "7x")
             for pci, name in hardware._PCI_DEVICE_ID_TO_NAME.items()}
    assert {pci: chip.generation for pci, chip in ours.items()} == names
    per_chip = {hardware.TpuVersion(hardware._PCI_DEVICE_ID_TO_NAME[pci]).name: chip.devices_per_chip
                for pci, chip in ours.items()}
    assert per_chip == {version.name: hardware._DEVICES_PER_CHIP.get(version, 1)
                        for version in hardware.TpuVersion if version.name != "UNKNOWN"}
