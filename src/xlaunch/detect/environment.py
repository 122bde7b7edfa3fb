"""What machine is this? Answered from environment variables and files only.

Detection must be safe to run in a notebook cell before any launch: importing ``torch_xla`` may
block on the TPU metadata server and initialises nothing we can undo, and asking ``torch.cuda``
creates a context that makes a later ``fork`` unusable. So everything here reads ``environ`` and
files under ``root``, which also lets tests describe a fake machine as a directory tree.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Mapping
from dataclasses import KW_ONLY, asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from xlaunch.detect.chips import CHIPS, TPU_PCI_VENDOR, torch_tpu_chip
from xlaunch.detect.holders import DeviceHolder, tpu_holders
from xlaunch.detect.runtime import installed_runtime, installed_versions, runtime_override
from xlaunch.names import Accelerator, TpuRuntime

Platform = Literal["colab", "kaggle", "cloud-tpu-vm", "local"]

ACCELERATOR_OVERRIDE = "XLAUNCH_ACCELERATOR"
ACCELERATOR_CHOICES = ("tpu", "cuda", "cpu", "xla")


@dataclass(frozen=True)
class Environment:
    """The machine as a launch sees it. Plain data: printing it is a bug report."""

    platform: Platform
    accelerator: Accelerator
    device_count: int  # TPU cores, GPUs, or CPU devices of the XLA path (1 on a plain CPU box)
    _: KW_ONLY
    tpu_generation: str | None = None
    tpu_chips: int = 0
    cores_per_chip: int = 0
    interactive: bool = False
    legacy_tpu_node: bool = False
    # The PJRT device the XLA path runs on ("TPU" on a TPU; PJRT_DEVICE's value when
    # XLAUNCH_ACCELERATOR=xla forces the XLA path elsewhere); None means the XLA path is not used.
    xla_device: str | None = None
    tpu_holders: tuple[DeviceHolder, ...] = ()  # processes holding a TPU device file open
    # The installed runtime that works with the installed torch on this TPU (XLAUNCH_TPU_RUNTIME
    # overrides); None: none installed fits (the XLA path is planned, `xlaunch env` says what
    # to install).
    tpu_runtime: TpuRuntime | None = None
    # A multi-host slice (GCE's TPU_WORKER_HOSTNAMES, TPU_WORKER_ID): every host, and this one.
    tpu_hosts: tuple[str, ...] = ()
    tpu_host_index: int | None = None

    def __post_init__(self) -> None:
        # From JSON (``as_dict``), holders arrive as plain dicts: plain data both ways.
        holders = tuple(h if isinstance(h, DeviceHolder) else DeviceHolder(**h)
                        for h in self.tpu_holders)
        object.__setattr__(self, "tpu_holders", holders)
        object.__setattr__(self, "tpu_hosts", tuple(self.tpu_hosts))

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["tpu_holders"] = [asdict(holder) for holder in self.tpu_holders]  # JSON's lists
        data["tpu_hosts"] = list(self.tpu_hosts)
        return data


def detect(
    environ: Mapping[str, str] | None = None, root: str | os.PathLike[str] = "/"
) -> Environment:
    """Describe this machine from ``environ`` (default ``os.environ``) and files under ``root``."""
    env = os.environ if environ is None else environ
    base = Path(root)
    override = env.get(ACCELERATOR_OVERRIDE, "").strip().lower()
    if override and override not in ACCELERATOR_CHOICES:
        raise ValueError(
            f"{ACCELERATOR_OVERRIDE}={env[ACCELERATOR_OVERRIDE]!r} is not one of "
            f"{', '.join(ACCELERATOR_CHOICES)}"
        )
    chips = _tpu_chips(base)
    # The platform describes the machine, not the override: a TPU VM asked to run on its CPU is
    # still a TPU VM.
    platform = _platform(env, has_chips=bool(chips))
    interactive = _interactive(env, platform, check_process=environ is None)

    forced_xla = override == "xla"
    if forced_xla:
        device = _pjrt_device(env, chips)
        if device != "TPU":
            return _forced_xla(env, device, platform, interactive)
        # XLA on a TPU is the TPU path; the chips decide the layout, not PJRT_DEVICE alone.
        override = "tpu"

    legacy_node = not chips and _names_tpu_node(env)
    if override in ("", "tpu") and (chips or legacy_node):
        if legacy_node:
            # Colab's old TPU Node: a remote v2-8 reached over gRPC, no chips on this host.
            return Environment(platform, "tpu", 8, tpu_generation="v2/v3", tpu_chips=4,
                               cores_per_chip=2, interactive=interactive, legacy_tpu_node=True,
                               xla_device="TPU", tpu_runtime=_runtime(env, None))
        runtime = "torch_xla" if forced_xla else _runtime(env, chips[0])
        holders = tpu_holders(base)
        pod = _pod(env)
        if runtime == "torch_tpu":
            return _torch_tpu_environment(base, chips, platform, interactive, holders, pod)
        generation, cores = _one_generation(chips)
        return Environment(platform, "tpu", len(chips) * cores, tpu_generation=generation,
                           tpu_chips=len(chips), cores_per_chip=cores, interactive=interactive,
                           xla_device="TPU", tpu_holders=holders, tpu_runtime=runtime, **pod)
    if override == "tpu":
        # Asked for a TPU on a host without chips: report what was asked, with no devices, so the
        # planner can refuse with the reason instead of silently falling back.
        return Environment(platform, "tpu", 0, interactive=interactive, xla_device="TPU")

    gpus = _cuda_device_count(env, base)
    if override in ("", "cuda") and gpus:
        return Environment(platform, "cuda", gpus, interactive=interactive)
    if override == "cuda":
        return Environment(platform, "cuda", 0, interactive=interactive)
    return Environment(platform, "cpu", 1, interactive=interactive)


def _platform(env: Mapping[str, str], has_chips: bool) -> Platform:
    # Kaggle first: its image also sets COLAB_* variables.
    if any(key.startswith("KAGGLE_") for key in env):
        return "kaggle"
    if any(key.startswith("COLAB_") for key in env):
        return "colab"
    if has_chips or env.get("TPU_ACCELERATOR_TYPE") or env.get("TPU_WORKER_ID") is not None:
        return "cloud-tpu-vm"
    return "local"


def _interactive(env: Mapping[str, str], platform: Platform, check_process: bool) -> bool:
    if platform == "kaggle":
        return env.get("KAGGLE_KERNEL_RUN_TYPE", "Interactive") == "Interactive"
    if platform == "colab" or "JPY_PARENT_PID" in env:
        return True
    if check_process:
        # A kernel started without Jupyter's variables (VS Code, papermill) still imports this.
        return "ipykernel" in sys.modules
    return False


def _tpu_chips(base: Path) -> list[str]:
    """PCI device ids of the TPU chips this host can open, one entry per chip."""
    chips = []
    for entry in _pci_entries(base):
        if _read(entry / "vendor") != TPU_PCI_VENDOR:
            continue
        device_id = _read(entry / "device")
        if device_id in CHIPS:
            chips.append(device_id)
    if not chips:
        return []
    dev = base / "dev"
    has_device_files = any(dev.glob("accel*")) or any(
        p.name.isdigit() for p in (dev / "vfio").glob("*")
    )
    return chips if has_device_files else []


def _runtime(env: Mapping[str, str], chip_id: str | None) -> TpuRuntime | None:
    return runtime_override(env) or installed_runtime(chip_id, installed_versions())


def _torch_tpu_environment(base: Path, chips: list[str], platform: Platform, interactive: bool,
                           holders: tuple[DeviceHolder, ...],
                           pod: dict[str, Any]) -> Environment:
    """A TPU as TorchTPU counts it: one device per TPU PCI function exposed through VFIO (its
    IOMMU group has a /dev/vfio node), two per chip on v7. No VFIO (/dev/accel*): no devices."""
    known = torch_tpu_chip(chips[0])
    if known is None:  # only an override gets here: TorchTPU knows no such chip (v2/v3)
        generation, cores = _one_generation(chips)
        return Environment(platform, "tpu", 0, tpu_generation=generation, tpu_chips=len(chips),
                           cores_per_chip=cores, interactive=interactive, tpu_holders=holders,
                           tpu_runtime="torch_tpu", **pod)
    devices = _vfio_functions(base)
    per_chip = known.devices_per_chip
    return Environment(platform, "tpu", devices, tpu_generation=known.generation,
                       tpu_chips=devices // per_chip, cores_per_chip=per_chip,
                       interactive=interactive, tpu_holders=holders, tpu_runtime="torch_tpu",
                       **pod)


def _vfio_functions(base: Path) -> int:
    """TPU PCI functions whose IOMMU group is open through /dev/vfio (what torch_tpu counts)."""
    count = 0
    for entry in _pci_entries(base):
        if _read(entry / "vendor") != TPU_PCI_VENDOR or not torch_tpu_chip(_read(entry / "device")):
            continue
        try:
            group = os.readlink(entry / "iommu_group")
        except OSError:
            continue
        if (base / "dev" / "vfio" / os.path.basename(group)).exists():
            count += 1
    return count


def _pod(env: Mapping[str, str]) -> dict[str, Any]:
    """GCE's description of a multi-host slice: every host's name, and this host's index."""
    hosts = tuple(name for name in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if name)
    worker = env.get("TPU_WORKER_ID", "").strip()
    if len(hosts) < 2:
        return {}
    return {"tpu_hosts": hosts, "tpu_host_index": int(worker) if worker.isdigit() else None}


def _pci_entries(base: Path) -> list[Path]:
    try:
        return sorted((base / "sys" / "bus" / "pci" / "devices").iterdir())
    except OSError:
        return []


def _one_generation(chips: list[str]) -> tuple[str | None, int]:
    """The generation and cores per chip torch_xla spawns on (the first chip's id)."""
    chip = CHIPS[chips[0]].torch_xla
    return chip.generation, chip.cores


def _names_tpu_node(env: Mapping[str, str]) -> bool:
    return bool(env.get("COLAB_TPU_ADDR") or env.get("TPU_NAME"))


def _pjrt_device(env: Mapping[str, str], chips: list[str]) -> str:
    """The device torch_xla will use: ``PJRT_DEVICE``, else the default torch_xla picks itself
    (TPU when chips are attached, CUDA when ``GPU_NUM_DEVICES`` is set, else CPU)."""
    device = env.get("PJRT_DEVICE", "").strip().upper()
    if device:
        return device
    if chips:
        return "TPU"
    return "CUDA" if _positive_int(env.get("GPU_NUM_DEVICES"), 0) else "CPU"


def _forced_xla(env: Mapping[str, str], device: str, platform: Platform,
                interactive: bool) -> Environment:
    accelerator: Accelerator = "cuda" if device in ("CUDA", "GPU") else "cpu"
    if device == "CPU":
        count = _positive_int(env.get("CPU_NUM_DEVICES"), 1)
    elif accelerator == "cuda":
        count = _positive_int(env.get("GPU_NUM_DEVICES"), 1)
    else:
        count = 1
    return Environment(platform, accelerator, count, interactive=interactive, xla_device=device)


def _cuda_device_count(env: Mapping[str, str], base: Path) -> int:
    """GPUs visible to this process, counted from the driver's files (no CUDA context)."""
    gpus_dir = base / "proc" / "driver" / "nvidia" / "gpus"
    try:
        physical = sum(1 for _ in gpus_dir.iterdir())
    except OSError:
        nodes = (base / "dev").glob("nvidia*")
        physical = sum(1 for p in nodes if re.fullmatch(r"nvidia\d+", p.name))
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is None or physical == 0:
        return physical
    return min(_visible_count(visible, physical), physical)


def _visible_count(visible: str, physical: int) -> int:
    """How many GPUs CUDA enumerates under ``CUDA_VISIBLE_DEVICES``, parsed as torch.cuda does.

    The list ends at the first entry CUDA cannot use (so ``0,-1,1`` is one GPU, and an index past
    the last GPU hides the rest), and a repeated entry hides every GPU. UUIDs cannot be checked
    without the driver, so each one counts.
    """
    seen: list[object] = []
    for raw in visible.split(","):
        item = raw.strip()
        key: object
        if item.startswith(("GPU-", "MIG-")):
            key = item
        else:
            number = re.match(r"[+-]?\d+", item)  # strtoul: "1gpu" is 1
            if number is None or not 0 <= int(number.group()) < physical:
                break
            key = int(number.group())
        if key in seen:
            return 0
        seen.append(key)
    return len(seen)


def _positive_int(value: str | None, default: int) -> int:
    try:
        number = int(value) if value is not None else default
    except ValueError:
        return default
    return number if number > 0 else default


def _read(path: Path) -> str:
    try:
        return path.read_text().strip().lower()
    except OSError:
        return ""
