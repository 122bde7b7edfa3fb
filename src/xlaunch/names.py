"""Names the caller and its workers share: variables, exit codes, and the values a plan may hold.

Below every other module of xlaunch, so that the state, the worker, the backends and the result
can agree on a name without importing one another.
"""

from __future__ import annotations

from typing import Literal

# Variables the launcher sets in each worker, read there by `ProcessState` and the worker.
MIXED_PRECISION_VAR = "XLAUNCH_MIXED_PRECISION"
WORLD_VAR = "XLAUNCH_WORLD"  # "xla" inside XLA replicas: tells ProcessState which world it is in
RESTART_VAR = "XLAUNCH_RESTART_COUNT"  # which attempt this is, on every path
STORE_DIR_VAR = "XLAUNCH_STORE_DIR"  # one machine: where a script's own process group meets

CANCELLED_EXIT = 75  # a worker that found its launch already stopped exits at once with this

# What a plan may say; mypy checks every table keyed by them.
PathName = Literal["xla", "torch_tpu", "elastic", "inline"]
Accelerator = Literal["tpu", "cuda", "cpu"]
DistBackend = Literal["nccl", "gloo", "tpu_dist"]
StartMethod = Literal["fork", "spawn", "forkserver"]
MixedPrecision = Literal["no", "fp16", "bf16"]
TpuRuntime = Literal["torch_xla", "torch_tpu"]
