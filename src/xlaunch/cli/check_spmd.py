"""What ``xlaunch check --spmd`` runs in its one SPMD process: every device driven, a tensor
sharded over the mesh, a matmul checked against the CPU, and steady training steps.

torch and torch_xla are imported inside functions, so the command-line parser stays cheap. A step
that goes wrong raises `CheckFailed` naming the step, as `check_steps` does for the other paths.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from xlaunch.cli.check_steps import WARMUP_STEPS, CheckFailed, _step

SPMD_STEPS = ("devices", "sharding", "matmul", "training")


@dataclass(frozen=True)
class SpmdConfig:
    devices: int  # what the plan says the process must drive
    train_steps: int = 6
    features: int = 8


def run_spmd_checks(config: SpmdConfig) -> dict[str, Any]:
    import torch
    import torch_xla.distributed.spmd as xs

    from xlaunch import _compat
    from xlaunch.state import ProcessState

    state = ProcessState()
    timings: dict[str, float] = {}
    details: dict[str, str] = {}
    started = time.time()
    with _step("devices", timings):
        if not state.is_spmd or state.num_devices != config.devices:
            raise CheckFailed(f"this process drives {state.num_devices} device(s) (SPMD "
                              f"{'on' if state.is_spmd else 'off'}); the launch planned "
                              f"{config.devices}")
        details["devices"] = f"1 process drives {config.devices} devices (SPMD)"
    mesh = state.mesh()
    batch = config.devices * 4
    x_cpu = torch.randn(batch, config.features, generator=torch.Generator().manual_seed(0))
    with _step("sharding", timings):
        x = x_cpu.to(state.device)
        xs.mark_sharding(x, mesh, ("data", None))
        spec = _compat.xla_sharding_spec(x)
        if f"devices=[{config.devices},1]" not in spec:
            raise CheckFailed(f"the batch was sharded as {spec!r}, not over the {config.devices} "
                              "devices of the mesh's first axis")
        details["sharding"] = f"a batch of {batch} rows sharded {spec}"
    with _step("matmul", timings):
        w_cpu = torch.randn(config.features, 3, generator=torch.Generator().manual_seed(1))
        product = (x @ w_cpu.to(state.device)).cpu()
        if not torch.allclose(product, x_cpu @ w_cpu, atol=1e-4):
            raise CheckFailed("the sharded matmul differs from the CPU's by "
                              f"{float((product - x_cpu @ w_cpu).abs().max()):.3g}")
        details["matmul"] = "the sharded matmul equals the CPU's (1e-4)"
    with _step("training", timings):
        details["training"], training = _train(config, state, x, mesh)
    return {"rank": 0, "world_size": state.num_processes, "started_at": started,
            "timings": timings, "details": details, "training": training,
            "returned_at": time.time()}


def _train(config: SpmdConfig, state: Any, x: Any, mesh: Any) -> tuple[str, dict[str, Any]]:
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met

    torch.manual_seed(0)
    model = torch.nn.Linear(config.features, 1).to(state.device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    y = x.sum(1, keepdim=True)
    counts = [int(met.counter_value("UncachedCompile") or 0)]
    for _ in range(config.train_steps):
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        torch_xla.sync()
        counts.append(int(met.counter_value("UncachedCompile") or 0))
    warmup, steady = counts[WARMUP_STEPS] - counts[0], counts[-1] - counts[WARMUP_STEPS]
    if warmup < 1 or steady:
        raise CheckFailed(f"{warmup} XLA graph(s) compiled in warm-up and {steady} after it, at "
                          "an unchanged shape (some in warm-up and none after were expected)")
    training = {"compiler": "XLA", "warmup_compiles": warmup, "steady_compiles": steady,
                "steps": config.train_steps}
    return (f"{config.train_steps} steps on the sharded batch: {warmup} XLA graph(s) compiled in "
            f"warm-up, none in the {config.train_steps - WARMUP_STEPS} steady steps"), training
