"""Fake machines for `detect(environ, root)`: a directory tree plus an environ dict.

Detection reads only files under ``root``, so a TPU VM, a Kaggle notebook or a GPU box can be
described as a few files under ``tmp_path`` and tested on any laptop. The trees copy what the
kernel shows on the real machines: one PCI directory per device with ``vendor``/``device`` files,
``/dev/accelN`` for v2-v4 chips, ``/dev/vfio/N`` for v5e and later (with the ``iommu_group`` link
that names it, which TorchTPU follows), and one directory per GPU in ``/proc/driver/nvidia/gpus``.

    root = fake_machine(tmp_path, tpu_chips=4, tpu_device="0x0027", dev="accel")
    env = detect({**KAGGLE, "TPU_PROCESS_ADDRESSES": "local"}, root=root)
"""

from __future__ import annotations

from pathlib import Path

GOOGLE = "0x1ae0"
NVIDIA = "0x10de"
INTEL = "0x8086"
GVNIC = "0x0042"  # Google's virtual NIC: vendor 0x1ae0 on every GCE VM, and not a TPU

# Environment variables as the notebooks set them (a sample: detection looks at prefixes).
COLAB = {"COLAB_RELEASE_TAG": "release-colab_20250101-060000_RC00", "COLAB_GPU": ""}
# Kaggle's image also sets COLAB_* variables; that is why Kaggle is checked first.
KAGGLE = {
    "KAGGLE_KERNEL_RUN_TYPE": "Interactive",
    "KAGGLE_URL_BASE": "https://www.kaggle.com",
    **COLAB,
}


def fake_machine(
    tmp_path: Path,
    *,
    tpu_chips: int = 0,
    tpu_device: str = "0x0027",
    dev: str | None = "accel",
    gpus: int = 0,
    other_vfio: int = 0,
    gvnic: bool = False,
    name: str = "machine",
) -> Path:
    """Build a machine under ``tmp_path/name`` and return its root.

    tpu_chips: TPU chips on the PCI bus, each with PCI device id ``tpu_device``.
    dev: how the chips are opened: ``"accel"`` (/dev/accelN), ``"vfio"`` (/dev/vfio/N) or
        ``None`` (visible on the bus but not passed into this container).
    gpus: NVIDIA GPUs known to the driver (/proc/driver/nvidia/gpus, /dev/nvidiaN).
    other_vfio: non-Google devices bound to VFIO (/dev/vfio/N that are not TPUs).
    gvnic: add Google's virtual NIC, a Google PCI device that is not a TPU.
    Every machine also has an Intel host bridge, so no PCI bus is ever just TPUs.
    """
    if dev not in ("accel", "vfio", None):
        raise ValueError(f"dev must be 'accel', 'vfio' or None, not {dev!r}")
    root = tmp_path / name
    pci = root / "sys" / "bus" / "pci" / "devices"
    (root / "dev").mkdir(parents=True)
    _pci_device(pci / "0000:00:00.0", INTEL, "0x1237")
    if gvnic:
        _pci_device(pci / "0000:00:03.0", GOOGLE, GVNIC)
    vfio_groups = 0
    for chip in range(tpu_chips):
        _pci_device(pci / f"0000:00:{4 + chip:02x}.0", GOOGLE, tpu_device)
        if dev == "accel":
            (root / "dev" / f"accel{chip}").touch()
        elif dev == "vfio":
            _vfio_group(root, vfio_groups, pci / f"0000:00:{4 + chip:02x}.0")
            vfio_groups += 1
    for other in range(other_vfio):
        _pci_device(pci / f"0000:01:{other:02x}.0", NVIDIA, "0x20b0")
        _vfio_group(root, vfio_groups, pci / f"0000:01:{other:02x}.0")
        vfio_groups += 1
    for gpu in range(gpus):
        address = f"0000:{0x10 + gpu:02x}:00.0"
        _pci_device(pci / address, NVIDIA, "0x1eb8")  # Tesla T4
        info = root / "proc" / "driver" / "nvidia" / "gpus" / address
        info.mkdir(parents=True)
        (info / "information").write_text("Model: \t\t Tesla T4\n")
        (root / "dev" / f"nvidia{gpu}").touch()
    if gpus:
        (root / "dev" / "nvidiactl").touch()
    return root


def _pci_device(path: Path, vendor: str, device: str) -> None:
    path.mkdir(parents=True)
    (path / "vendor").write_text(vendor + "\n")  # sysfs ends each value with a newline
    (path / "device").write_text(device + "\n")


def _vfio_group(root: Path, group: int, device: Path) -> None:
    vfio = root / "dev" / "vfio"
    vfio.mkdir(exist_ok=True)
    (vfio / "vfio").touch()  # the VFIO container device, present whenever VFIO is
    (vfio / str(group)).touch()
    # sysfs links each PCI function to its IOMMU group, whose number names the /dev/vfio node.
    groups = root / "sys" / "kernel" / "iommu_groups"
    (groups / str(group)).mkdir(parents=True, exist_ok=True)
    (device / "iommu_group").symlink_to(groups / str(group))


def torch_release() -> tuple[int, int]:
    """The installed torch's (major, minor): the install lines xlaunch gives depend on it."""
    import importlib.metadata

    major, minor = importlib.metadata.version("torch").split(".")[:2]
    return int(major), int(minor)


def xla_pin() -> str:
    """The torch_xla release an install line pins for the installed torch: its own where one
    exists (2.9 is torch_xla's newest), else 2.9.0 with its torch."""
    major, minor = torch_release()
    return f"{major}.{minor}.0" if (major, minor) <= (2, 9) else "2.9.0"


def torch_tpu_line() -> str:
    """How xlaunch says to install TorchTPU beside the installed torch (it needs 2.11-2.15)."""
    return "pip install torch-tpu" if (2, 11) <= torch_release() <= (2, 15) else \
        'pip install "torch>=2.11,<2.16" torch-tpu'
