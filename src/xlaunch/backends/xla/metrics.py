"""What a replica did on the XLA device, read from ``torch_xla.debug.metrics`` as its function ends.

Names follow torch_xla 2.8/2.9: counters ``UncachedCompile`` (graphs compiled), ``MarkStep``
(graph cuts: ``torch_xla.sync()``, ``xm.mark_step()``), ``aten::<op>`` (ops run on the CPU for
want of a lowering); metrics ``CompileTime``, ``ExecuteTime``, ``ExecuteReplicatedTime``,
``TransferToDeviceTime``, ``TransferFromDeviceTime`` as (samples, total ns, recent samples), each
recent sample a (timestamp in seconds, value) pair.
"""

from __future__ import annotations

import os
import re
from collections import Counter
from typing import Any

from xlaunch.backends.environment import DEBUG_FILE_VAR

# Counted with the fallbacks, but it is reading a value to the host (.item(), .tolist()): it
# shows in the transfers from the device, and has no lowering to want.
VALUE_READS = ("aten::_local_scalar_dense",)
_FRAME = re.compile(r"^\s+\S.* \((?P<where>.+:\d+)\)\s*$")
_OWN_FRAMES = ("/torch_xla/", "/torch/", "/xlaunch/", "<frozen ")


def collect() -> dict[str, Any]:
    import torch_xla.core.xla_model as xm
    import torch_xla.debug.metrics as met

    # Executions run asynchronously after a sync: let the last ones finish, so they are counted.
    xm.wait_device_ops()

    def samples(name: str) -> int:
        data = met.metric_data(name)
        return int(data[0]) if data else 0

    compile_time = met.metric_data("CompileTime")
    executed = [met.metric_data(name) for name in ("ExecuteTime", "ExecuteReplicatedTime")]
    return dict(
        late_compiles=late_compiles(compile_time, executed),
        compiles=int(met.counter_value("UncachedCompile") or 0),
        compile_seconds=(compile_time[1] / 1e9) if compile_time else 0.0,
        executions=samples("ExecuteTime") + samples("ExecuteReplicatedTime"),
        transfers_to_device=samples("TransferToDeviceTime"),
        transfers_from_device=samples("TransferFromDeviceTime"),
        cpu_fallbacks={name: int(met.counter_value(name) or 0) for name in met.counter_names()
                       if name.startswith("aten::") and name not in VALUE_READS},
        steps=int(met.counter_value("MarkStep") or 0),
        compile_sources=compile_sources(os.environ.get(DEBUG_FILE_VAR)),
        **spmd_figures(),
    )


def spmd_figures() -> dict[str, Any]:
    """Under SPMD: the devices driven, the global mesh, and each device's memory where the runtime
    gives it (``xm.get_memory_info``; the SPMD virtual device of torch_xla 2.8/2.9 gives none)."""
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        return {}
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    mesh = xs.get_global_mesh()
    memory = []
    for device in xm.get_xla_supported_devices():
        try:
            info = xm.get_memory_info(device)
            memory.append((str(device), int(info["bytes_used"]), int(info["bytes_limit"])))
        except Exception:  # not given for this device: the report leaves it out
            continue
    return dict(devices=int(xr.global_runtime_device_count()),
                mesh=None if mesh is None else f"{tuple(mesh.mesh_shape)} {tuple(mesh.axis_names)}",
                device_memory=tuple(memory))


def late_compiles(compile_time: Any, executed: list[Any]) -> int | None:
    """Graphs compiled in the later half of the run (by executions), from the metrics' samples.

    Each metric keeps its recent samples as (timestamp in seconds, value). A loop that warms up
    compiles early and then only executes; one that recompiles keeps compiling to the end. None
    when the samples are missing (a release that keeps none) or too few executions to judge.
    """
    try:
        compiled = [float(sample[0]) for sample in (compile_time[2] if compile_time else ())]
        runs = sorted(float(sample[0]) for data in executed if data for sample in data[2])
    except (TypeError, IndexError, ValueError):
        return None
    if len(runs) < 4:
        return None
    middle = runs[len(runs) // 2]
    return sum(1 for stamp in compiled if stamp > middle)


def compile_sources(path: str | None) -> tuple[tuple[str, int], ...]:
    """From torch_xla's compilation analysis: the user's line behind each compilation, counted."""
    if not path:
        return ()
    try:
        text = open(path, encoding="utf-8", errors="replace").read()
    except OSError:
        return ()
    counts: Counter[str] = Counter()
    for block in text.split("Python Frame Triggered Execution:")[1:]:
        for line in block.splitlines()[1:]:
            line = line.removeprefix("Compilation Analysis:")
            frame = _FRAME.match(line)
            if frame is None:
                break
            if not any(own in frame["where"] for own in _OWN_FRAMES):
                counts[frame["where"]] += 1
                break
    return tuple(counts.most_common())
