"""Which TPU runtime fits this TPU and this torch, and the install line when none is installed.

Two runtimes drive TPUs from PyTorch, and one environment can hold a working one of them, never
both: torch_xla is released in lockstep with torch (torch_xla 2.9 needs torch 2.9.0 exactly, and
2.9 is its newest release), while TorchTPU (``torch-tpu`` 0.2.0) needs torch 2.11-2.15 and does not
know v2/v3 chips (PCI id 0x0027). Everything here is read from package metadata: importing
torch_xla may query the TPU metadata server, importing torch_tpu maps libtpu (about 4 s), and a
version is all a decision needs.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

from xlaunch.detect.chips import torch_tpu_chip
from xlaunch.names import TpuRuntime

NEWEST_TORCH_XLA = (2, 9)  # the newest torch_xla release; each needs the torch of its number
TORCH_TPU_TORCH = ((2, 11), (2, 15))  # torch-tpu 0.2.0: torch >=2.11,<=2.15 (glue for each)
RUNTIME_OVERRIDE = "XLAUNCH_TPU_RUNTIME"
RUNTIMES: tuple[TpuRuntime, ...] = ("torch_xla", "torch_tpu")


def installed_versions() -> dict[str, str | None]:
    """torch, torch_xla, torch-tpu and libtpu as installed (None when absent).

    Read once per process: the metadata lookups walk sys.path, and a runtime installed into a
    running kernel needs the kernel restarted before torch can use it anyway.
    """
    return dict(_installed())


@functools.lru_cache(maxsize=1)
def _installed() -> tuple[tuple[str, str | None], ...]:
    return tuple((name, installed_version(name)) for name in ("torch", "torch_xla", "torch-tpu", "libtpu"))


def release(version: str | None) -> tuple[int, int] | None:
    """``"2.13.0+cpu"`` -> (2, 13)."""
    if not version:
        return None
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return None


def torch_tpu_fits(torch: tuple[int, int] | None) -> bool:
    low, high = TORCH_TPU_TORCH
    return torch is not None and low <= torch <= high


def installed_runtime(chip_id: str | None, versions: Mapping[str, str | None]) -> TpuRuntime | None:
    """The installed runtime that works with the installed torch on a chip with this PCI id."""
    torch = release(versions.get("torch"))
    if versions.get("torch-tpu") and torch_tpu_chip(chip_id) and torch_tpu_fits(torch):
        return "torch_tpu"
    if versions.get("torch_xla") and torch is not None and release(versions["torch_xla"]) == torch:
        return "torch_xla"
    return None


def runtime_override(environ: Mapping[str, str]) -> TpuRuntime | None:
    value = environ.get(RUNTIME_OVERRIDE, "").strip().lower()
    if not value:
        return None
    for runtime in RUNTIMES:
        if value == runtime:
            return runtime
    raise ValueError(f"{RUNTIME_OVERRIDE}={environ[RUNTIME_OVERRIDE]!r} is not one of "
                     f"{', '.join(RUNTIMES)}")


def fitting_runtime(generation: str | None, torch: tuple[int, int] | None) -> TpuRuntime:
    """The runtime to install on this TPU for this torch: torch_tpu wherever it can run."""
    if generation == "v2/v3":
        return "torch_xla"
    if torch is not None and torch <= NEWEST_TORCH_XLA:
        return "torch_xla"  # keep the user's torch: its own torch_xla exists
    return "torch_tpu"


def install_line(generation: str | None = None, runtime: TpuRuntime | None = None,
                 torch_version: str | None = None) -> str:
    """The one ``pip install`` line that fits this TPU (``generation``) and the installed torch.

    ``runtime`` asks for that runtime's line (the XLA path on a CPU or GPU device needs
    torch_xla whatever the generation).
    """
    torch_version = torch_version or installed_version("torch")
    torch = release(torch_version)
    runtime = runtime or fitting_runtime(generation, torch)
    shown = (torch_version or "").split("+")[0]
    if runtime == "torch_tpu":
        if torch_tpu_fits(torch):
            return "pip install torch-tpu"
        low, high = TORCH_TPU_TORCH
        return (f'pip install "torch>={low[0]}.{low[1]},<{high[0]}.{high[1] + 1}" torch-tpu  '
                f"(torch-tpu needs torch {low[0]}.{low[1]}-{high[0]}.{high[1]}"
                + (f"; this is {shown})" if shown else ")"))
    newest = ".".join(map(str, NEWEST_TORCH_XLA)) + ".0"
    pair = f'pip install torch=={newest} "torch_xla[tpu]=={newest}"'
    if torch is None:
        return pair
    if torch > NEWEST_TORCH_XLA:
        why = "v2/v3 TPUs run only torch_xla" if generation == "v2/v3" else ""
        return f"{pair}  (torch {shown} is newer than any torch_xla release{'; ' + why if why else ''})"
    return f'pip install "torch_xla[tpu]=={shown}"  (torch_xla must match torch {shown} exactly)'


def installed_version(distribution: str) -> str | None:
    """The installed version of ``distribution`` (either spelling of its name), or None.

    importlib.metadata is imported here, not with the module: it costs about 25 ms (it loads the
    email package), which ``import xlaunch`` would otherwise pay on every machine.
    """
    from importlib import metadata

    for name in (distribution, distribution.replace("-", "_")):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None
