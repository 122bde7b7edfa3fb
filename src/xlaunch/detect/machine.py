"""How many processes this machine can hold, and what this process already did that a launch
must know: read once, before planning, so that the plan decides from facts it is given."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from xlaunch import _compat

PROCESSES_PER_CORE = 8  # CPU processes beyond this share a core so thinly that nothing trains
MEMORY_PER_PROCESS = 256 * 2**20  # a CPU worker with torch imported and a process group formed


@dataclass(frozen=True)
class Machine:
    cores: int
    memory_available: int | None  # bytes a new process could still take; None when unknown
    memory_total: int | None = None  # the machine's memory, or its container's limit
    # This process already runs autograd's device threads (a torch.compile'd backward starts
    # them on torch's CUDA builds): a child forked from it fails at its first backward
    # ("Unable to handle autograd's threading in combination with fork-based multiprocessing").
    autograd_threads: bool = False
    # This process already initialised CUDA: a forked child cannot use the GPUs (a spawned can).
    cuda_initialised: bool = False
    # This process already started the XLA runtime: torch_xla cannot start replicas after that.
    xla_runtime_initialised: bool = False
    pid: int = 0  # this process (0: unknown), to tell its own holds and its own launch apart

    @classmethod
    def here(cls, root: str = "/") -> Machine:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:
            cores = os.cpu_count() or 1
        return cls(cores, *_memory(Path(root)), autograd_threads=_autograd_threads(Path(root)),
                   cuda_initialised=_cuda_initialised(),
                   xla_runtime_initialised=_compat.xla_runtime_is_initialized(), pid=os.getpid())

    def check_cpu_processes(self, count: int) -> None:
        """Refuse, with the numbers, a count of CPU processes this machine cannot hold."""
        most = PROCESSES_PER_CORE * self.cores
        if count > most:
            raise ValueError(
                f"num_processes={count} CPU processes on {self.cores} core(s) is more than this "
                f"machine can run usefully (at most {most}, {PROCESSES_PER_CORE} per core)")
        if self.memory_available is not None and count * MEMORY_PER_PROCESS > self.memory_available:
            fits = max(1, self.memory_available // MEMORY_PER_PROCESS)
            raise ValueError(
                f"num_processes={count} CPU processes need about {count * MEMORY_PER_PROCESS >> 20}"
                f" MiB ({MEMORY_PER_PROCESS >> 20} MiB each) and this machine has "
                f"{self.memory_available >> 20} MiB available; use at most {fits}")


def _autograd_threads(root: Path) -> bool:
    """Whether a thread of this process is one of autograd's device threads (``pt_autograd_N``,
    the name torch gives them), read from /proc: torch is neither imported nor asked."""
    for comm in (root / "proc" / "self" / "task").glob("*/comm"):
        try:
            if comm.read_text().startswith("pt_autograd_"):
                return True
        except OSError:
            continue
    return False


def _cuda_initialised() -> bool:
    """Whether torch, if this process imported it, initialised CUDA; never imports torch."""
    cuda = getattr(sys.modules.get("torch"), "cuda", None)
    return bool(cuda is not None and cuda.is_initialized())


def _memory(root: Path) -> tuple[int | None, int | None]:
    """(available, total): MemAvailable and MemTotal, or the container's limit when smaller."""
    info = {}
    try:
        for line in (root / "proc" / "meminfo").read_text().splitlines():
            name, _, value = line.partition(":")
            if name in ("MemAvailable", "MemTotal"):
                info[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    available, total = info.get("MemAvailable"), info.get("MemTotal")
    cgroup = root / "sys" / "fs" / "cgroup"
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        used = int((cgroup / "memory.current").read_text())
        if limit != "max":
            room = int(limit) - used
            available = room if available is None else min(available, room)
            total = int(limit) if total is None else min(total, int(limit))
    except (OSError, ValueError):
        pass
    return available, total


@dataclass(frozen=True)
class Gpus:
    """The NVIDIA GPUs the driver lists, read from its files: no CUDA context, no library loaded."""

    names: tuple[str, ...] = ()  # one per GPU, as the driver names it ("NVIDIA H200")
    driver: str | None = None  # the kernel module's version ("550.54.15")

    @classmethod
    def here(cls, root: str | os.PathLike[str] = "/") -> Gpus:
        base = Path(root) / "proc" / "driver" / "nvidia"
        names = []
        try:
            folders = sorted((base / "gpus").iterdir())
        except OSError:
            folders = []
        for folder in folders:
            model = "unknown model"
            try:
                for line in (folder / "information").read_text().splitlines():
                    key, _, value = line.partition(":")
                    if key.strip() == "Model":
                        model = value.strip() or model
                        break
            except OSError:
                pass
            names.append(model)
        return cls(tuple(names), _driver_version(base / "version"))

    def summary(self) -> str | None:
        """``"8 x NVIDIA H200"``, or each model with its count where they differ; None: no GPU."""
        if not self.names:
            return None
        counts: dict[str, int] = {}
        for name in self.names:
            counts[name] = counts.get(name, 0) + 1
        return ", ".join(f"{count} x {name}" for name, count in counts.items())


def _driver_version(path: Path) -> str | None:
    """``NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 ...`` -> 550.54.15."""
    try:
        first = path.read_text().splitlines()[0]
    except (OSError, IndexError):
        return None
    for word in first.split("Kernel Module", 1)[-1].split():
        if word[:1].isdigit():
            return word
    return None
