"""How many processes and threads a TPU host runs, and the variables each worker needs.

torch_xla runs one process per chip; v2/v3 chips hold two cores, run as two threads of that
process. `xmp.spawn` accepts only ``nprocs`` None (every chip) or 1, so any other count must be
expressed through the chip-layout variables, or refused with the values that work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .environment import Environment

# Set by Kaggle's TPU image; torch_xla keeps them and a multi-process spawn then fails with
# "Expected N worker addresses, got 1".
KAGGLE_PRESETS = ("TPU_PROCESS_ADDRESSES", "CLOUD_TPU_TASK_ID")


@dataclass(frozen=True)
class TpuLayout:
    processes: int
    threads_per_process: int
    env: Mapping[str, str] = field(default_factory=dict)
    unset_env: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


def tpu_layout(env: Environment, num_processes: int | None) -> TpuLayout:
    """The layout for ``num_processes`` replicas, or `ValueError` naming the values that work."""
    if env.accelerator == "tpu" and env.device_count == 0:
        raise ValueError(
            "a TPU launch was asked for (XLAUNCH_ACCELERATOR=tpu) but this host has no TPU chips"
        )
    if env.xla_device != "TPU" or env.legacy_tpu_node:
        # XLA on CPU/GPU devices (tests, XLAUNCH_ACCELERATOR=xla): one process per device.
        count = env.device_count if num_processes in (None, env.device_count) else num_processes
        if count not in (1, env.device_count):
            raise ValueError(
                f"num_processes={num_processes} does not fit this XLA device "
                f"({env.xla_device}, {env.device_count} device(s)); use 1 or {env.device_count}"
            )
        return TpuLayout(count, 1)

    chips, cores = env.tpu_chips, env.cores_per_chip
    every_core = chips * cores
    if num_processes in (None, every_core):
        return TpuLayout(chips, cores, unset_env=KAGGLE_PRESETS if chips > 1 else ())
    if num_processes == 1:
        return TpuLayout(1, 1)
    raise ValueError(
        f"num_processes={num_processes} does not fit this TPU ({env.tpu_generation or 'unknown'}, "
        f"{chips} chip(s) x {cores} core(s)); use None (every core, {every_core}) or 1"
    )
