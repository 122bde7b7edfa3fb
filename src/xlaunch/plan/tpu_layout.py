"""How many processes and threads an XLA launch runs on this host, and what each worker needs.

torch_xla (``torch_xla/_internal/pjrt.py``, ``tpu.py``) runs one process per TPU chip, and one
thread per device inside each process: v2/v3 chips hold two cores, so a v3-8 is 4 processes x 2
threads. ``xmp.spawn`` takes only ``nprocs`` None (that whole layout) or 1 (one replica on one
device). Every other count must come from the chip-layout variables torch_xla reads before it
spawns, and only the layouts its own source sets up are honoured here:

- every core: nothing to set (torch_xla derives the layout from the chips);
- one replica: ``nprocs=1``, torch_xla then pins the process to chip 0 itself;
- one chip with all its cores (v2/v3: 2 replicas): ``TPU_PROCESS_BOUNDS=1,1,1`` limits the spawn to
  one process (``num_local_processes`` is the smaller of the chips and the process bounds), on chip
  ``TPU_VISIBLE_CHIPS=0``, which then runs one thread per core - the layout of torch_xla's own
  ``test_xla_devices_single_process_one_chip``.

Fewer processes on several chips would need a sub-mesh of the host's chips (``TPU_PROCESS_BOUNDS``
such as ``2,1,1``); which chip ids form a valid sub-mesh is decided inside libtpu and differs by
generation, so those counts are refused with the values that work rather than guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from xlaunch.detect.environment import Environment

# Set by Kaggle's TPU image for a single process; torch_xla keeps preset values, and a
# multi-process spawn then fails with "Expected N worker addresses, got 1".
KAGGLE_PRESETS = ("TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID")
ONE_CHIP = {"TPU_VISIBLE_CHIPS": "0", "TPU_PROCESS_BOUNDS": "1,1,1",
            "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1"}


@dataclass(frozen=True)
class TpuLayout:
    processes: int
    threads_per_process: int
    env: Mapping[str, str] = field(default_factory=dict)
    unset_env: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    nprocs: int | None = None  # xmp.spawn's nprocs: None spawns this layout, 1 runs one replica

    @property
    def replicas(self) -> int:
        return self.processes * self.threads_per_process


def tpu_layout(env: Environment, num_processes: int | None) -> TpuLayout:
    """The layout for ``num_processes`` replicas, or `ValueError` naming the values that work."""
    if env.accelerator == "tpu" and env.device_count == 0:
        raise ValueError(
            "a TPU launch was asked for (XLAUNCH_ACCELERATOR=tpu) but this host has no TPU chips"
        )
    if env.xla_device != "TPU":
        return _device_layout(env, num_processes)
    return _chip_layout(env, num_processes)


def _chip_layout(env: Environment, num_processes: int | None) -> TpuLayout:
    chips, cores = env.tpu_chips, env.cores_per_chip
    every_core = chips * cores
    if num_processes in (None, every_core):
        return TpuLayout(chips, cores, unset_env=KAGGLE_PRESETS if chips > 1 else ())
    if num_processes == 1:
        return TpuLayout(1, 1, nprocs=1)
    if num_processes == cores:
        return TpuLayout(1, cores, env=dict(ONE_CHIP),
                         notes=(f"using chip 0 only: {cores} cores of {every_core}",))
    valid = [f"None or {every_core} (every core)", "1 (one core)"]
    if cores > 1:
        valid.append(f"{cores} (one chip, all its cores)")
    raise ValueError(
        f"num_processes={num_processes} does not fit this TPU ({env.tpu_generation or 'unknown'}, "
        f"{chips} chip(s) x {cores} core(s)); use {_choices(valid)}. torch_xla runs one process "
        "per chip, and other counts would need a sub-mesh of chips it does not set up."
    )


def _device_layout(env: Environment, num_processes: int | None) -> TpuLayout:
    """XLA on CPU or GPU devices (tests, ``XLAUNCH_ACCELERATOR=xla``).

    PJRT's CPU client is one process holding every CPU device (a thread each); a GPU client is
    one process per GPU.
    """
    count = env.device_count
    full = TpuLayout(1, count) if env.xla_device == "CPU" else TpuLayout(count, 1)
    if num_processes in (None, count):
        return full
    if num_processes == 1:
        return TpuLayout(1, 1, nprocs=1)
    raise ValueError(
        f"num_processes={num_processes} does not fit this XLA device ({env.xla_device}, "
        f"{count} device(s)); use {_every_or_one(count, 'device')}"
    )


def _every_or_one(count: int, unit: str) -> str:
    if count == 1:
        return f"None or 1 (the one {unit})"
    return _choices([f"None or {count} (every {unit})", f"1 (one {unit})"])


def _choices(values: list[str]) -> str:
    return values[0] if len(values) == 1 else ", ".join(values[:-1]) + " or " + values[-1]
