"""Names the caller and its workers share: variables, exit codes, and the values a plan may hold.

Below every other module of xlaunch, so that the state, the worker, the backends and the result
can agree on a name without importing one another.
"""

from __future__ import annotations

from typing import Literal

# Variables the launcher sets in each worker, read there by `ProcessState` and the worker.
MIXED_PRECISION_VAR = "XLAUNCH_MIXED_PRECISION"
# "xla:<pid>" inside XLA replicas (the pid of the replica's process: a process it starts is not
# a replica, and a value preset in the caller is nobody's): tells ProcessState its world.
WORLD_VAR = "XLAUNCH_WORLD"
RESTART_VAR = "XLAUNCH_RESTART_COUNT"  # which attempt this is, on every path
# The launch's accelerator ("cpu", "cuda", "tpu") on the paths whose world does not say it (all
# but XLA's): ProcessState's device follows it, so a CPU launch on a GPU machine is on the CPU.
DEVICE_VAR = "XLAUNCH_DEVICE"
STORE_DIR_VAR = "XLAUNCH_STORE_DIR"  # one machine: where a script's own process group meets
WORKER_VAR = "XLAUNCH_WORKER"  # "<pid>" in every worker's own process: a launch inside it is refused
# What serves instead of a launcher started inside a worker (refused by the plan in the caller,
# by an audit hook in the worker).
IN_A_WORKER = (
    "Inside a launch, the launched function already runs in every process: with Lightning use "
    "strategy=\"ddp\" (it finds the launch's processes through torchrun's variables), not "
    "\"ddp_notebook\" or \"ddp_spawn\"; with accelerate, call the training code directly and "
    "let Accelerator() or PartialState() find the world; with torch_xla, call the function "
    "directly instead of xmp.spawn")
# Every variable xlaunch sets for its workers: each worker gets them from its launch alone.
WORKER_VARS = (MIXED_PRECISION_VAR, WORLD_VAR, RESTART_VAR, DEVICE_VAR, STORE_DIR_VAR, WORKER_VAR)

# The waits nothing can notify, two steps for the caller and its workers alike:
# - a fact awaited (a process's status where there is no pidfd, an engine's processes, a stack
#   being dumped);
POLL_S = 0.01
# - a thread's look at what it watches besides its own work (the clock and the path's checks in
#   the caller, a stop asked while the nodes meet, the end of a replica's output pump).
CHECK_S = 0.05

# No exit status is xlaunch's own: a worker says what happened to it in its launch folder, so a
# user's os._exit(N) is never read as anything but the user's.

# What a plan may say; mypy checks every table keyed by them.
PathName = Literal["xla", "torch_tpu", "elastic", "inline"]
Accelerator = Literal["tpu", "cuda", "cpu"]
DistBackend = Literal["nccl", "gloo", "tpu_dist"]
StartMethod = Literal["fork", "spawn", "forkserver"]
MixedPrecision = Literal["no", "fp16", "bf16"]
TpuRuntime = Literal["torch_xla", "torch_tpu"]
