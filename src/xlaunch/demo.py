"""``xlaunch demo``: a small real data-parallel training, to see that a launch works end to end.

It is the README's first command, so it must prove something rather than print a greeting: a
2-layer MLP learns a fixed random linear map from seeded synthetic data, each rank training on its
own shard while gradients are averaged across ranks (DDP on GPU/CPU, an XLA all-reduce on TPU). If
the averaging works, every rank ends with bit-for-bit the same parameters; the last step gathers
them from every rank and compares, and the command fails when any rank differs. Model and data
are made in place: nothing is downloaded, so it runs on a machine without network access.

The launched function is `train`, a module-level function, so ``--start-method spawn`` can pickle
it; torch and torch_xla are imported inside functions, so that ``xlaunch env`` (whose parser
imports this module) stays cheap and the GPU/CPU path never imports torch_xla.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .run import add_common_arguments, launch_and_report, options_from, usage_error

if TYPE_CHECKING:
    from .environment import Environment
    from .plan import LaunchPlan

DEMO_TIMEOUT_S = 600.0  # tiny model: a demo still running after this is stuck, not slow


@dataclass(frozen=True)
class DemoConfig:
    """The training run, identical on every rank (it travels to the workers as the argument)."""

    epochs: int = 3
    steps_per_epoch: int | None = None  # None: one pass over this rank's shard
    batch_size: int = 32
    samples: int = 2048  # the whole data set, split between the ranks
    features: int = 16
    hidden: int = 64
    outputs: int = 4
    learning_rate: float = 0.05
    seed: int = 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-processes", "--num_processes", dest="num_processes", type=int,
                        default=None, metavar="N",
                        help="processes to train in (default: every TPU core or GPU; 2 on a CPU-only "
                             "machine, so the demo is distributed there too)")
    parser.add_argument("--epochs", type=int, default=DemoConfig.epochs, metavar="N",
                        help=f"passes over the data (default {DemoConfig.epochs})")
    parser.add_argument("--steps", type=int, default=None, metavar="N",
                        help="optimizer steps per epoch (default: one pass over each rank's shard)")
    add_common_arguments(parser)
    parser.set_defaults(timeout=DEMO_TIMEOUT_S)


def main(args: argparse.Namespace) -> int:
    """Show the machine and the plan, train across its processes, report PASS or fail."""
    from .environment import detect
    from .launcher import run_plan
    from .plan import make_plan

    if args.epochs < 1 or (args.steps is not None and args.steps < 1):
        return usage_error("--epochs and --steps must be at least 1")
    config = DemoConfig(epochs=args.epochs, steps_per_epoch=args.steps)
    try:
        env = detect()
        count = default_num_processes(env) if args.num_processes is None else args.num_processes
        plan = make_plan(env, options_from(args, num_processes=count))
    except (ValueError, TypeError) as error:
        return usage_error(str(error))
    print(summary(env, plan, config))
    sys.stdout.flush()  # before the workers' lines, which go straight to the same stream
    started = time.perf_counter()
    status = launch_and_report(lambda: run_plan(plan, train, (config,)))
    if status == 0:
        print(f"demo finished in {time.perf_counter() - started:.1f} s")
    return status


def default_num_processes(env: Environment) -> int | None:
    """The launcher's choice, except on a CPU-only machine: one process would prove nothing."""
    return 2 if env.xla_device is None and env.accelerator == "cpu" else None


def summary(env: Environment, plan: LaunchPlan, config: DemoConfig) -> str:
    """A few lines of what `xlaunch env` shows at length: what runs where."""
    from importlib import metadata

    from .plan import describe_path

    machine = f"{env.platform}, {env.accelerator}"
    if env.tpu_generation:
        machine += f" {env.tpu_generation} ({env.tpu_chips} chips x {env.cores_per_chip} cores)"
    else:
        machine += f" ({env.device_count} device{'s' if env.device_count != 1 else ''})"
    per_process = getattr(plan.spec, "threads_per_process", 1)
    threads = f" x {per_process} threads" if per_process > 1 else ""
    versions = []
    for name in ("torch", "torch_xla"):
        try:
            versions.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    shard = -(-config.samples // plan.world_size)
    steps = config.steps_per_epoch or max(1, shard // config.batch_size)
    rows = {
        "machine": machine,
        "launch": f"{describe_path(plan)}, {plan.num_processes} process(es){threads}, world "
                  f"size {plan.world_size}, {plan.dist_backend or 'no process group'}, start "
                  f"method {getattr(plan.spec, 'start_method', '-')}",
        "training": f"MLP {config.features}-{config.hidden}-{config.outputs} on {config.samples} "
                    f"synthetic samples, {config.epochs} epoch(s) x {steps} steps, batch "
                    f"{config.batch_size} per rank, mixed precision {plan.mixed_precision}",
        "versions": ", ".join(versions) or "-",
    }
    return "\n".join(["xlaunch demo"] + [f"  {key:<10}{value}" for key, value in rows.items()])


def train(config: DemoConfig) -> dict[str, Any]:
    """The launched function: the same training on each rank, gradients averaged across ranks."""
    from .state import ProcessState

    if ProcessState().backend == "xla":
        return _train_xla(config)
    return _train_torch(config)


def make_data(config: DemoConfig) -> tuple[Any, Any]:
    """The whole data set, the same on every rank: y = x W + b plus a little noise."""
    import torch

    generator = torch.Generator().manual_seed(config.seed)
    features = torch.randn(config.samples, config.features, generator=generator)
    weight = torch.randn(config.features, config.outputs, generator=generator)
    bias = torch.randn(config.outputs, generator=generator)
    noise = 0.01 * torch.randn(config.samples, config.outputs, generator=generator)
    return features, features @ weight + bias + noise


def make_model(config: DemoConfig) -> Any:
    import torch

    torch.manual_seed(config.seed)  # the same start on every rank (DDP would broadcast it anyway)
    return torch.nn.Sequential(
        torch.nn.Linear(config.features, config.hidden), torch.nn.ReLU(),
        torch.nn.Linear(config.hidden, config.outputs),
    )


def batches(config: DemoConfig, shard_x: Any, shard_y: Any, epoch: int, rank: int) -> Iterator[Any]:
    """This epoch's batches from this rank's shard, reshuffled each epoch, cycling if needed."""
    import torch

    count = len(shard_x)
    per_pass = max(1, count // config.batch_size)
    steps = config.steps_per_epoch or per_pass
    order = torch.randperm(count, generator=torch.Generator().manual_seed(1000 * epoch + rank))
    for step in range(steps):
        start = (step % per_pass) * config.batch_size
        index = order[start:start + config.batch_size]
        yield shard_x[index], shard_y[index]


def _shard(config: DemoConfig) -> tuple[Any, Any]:
    from .state import ProcessState

    features, targets = make_data(config)
    with ProcessState().split_between_processes({"x": features, "y": targets}) as shard:
        return shard["x"], shard["y"]


def _train_torch(config: DemoConfig) -> dict[str, Any]:
    """GPU or CPU: DistributedDataParallel over the group the launcher made (none for 1 process)."""
    import torch
    import torch.distributed as dist

    from .state import ProcessState

    state = ProcessState()
    rank, world, device = state.process_index, state.num_processes, state.device
    distributed = state.backend is not None
    shard_x, shard_y = _shard(config)
    shard_x, shard_y = shard_x.to(device), shard_y.to(device)
    print(f"rank {rank}/{world}: training on {len(shard_x)} of {config.samples} samples on {device}")
    model = make_model(config).to(device)
    params = model
    if distributed:
        device_ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type, enabled=state.mixed_precision == "fp16")

    def mean_over_ranks(value: Any) -> float:
        if distributed:
            dist.all_reduce(value)
        return float(value.item()) / world

    def step(loss: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP all-reduces (averages) the gradients here
        scaler.step(optimizer)
        scaler.update()

    losses = _train_epochs(config, state, model, shard_x, shard_y, step, mean_over_ranks)

    flat = _flat_parameters(params)
    gathered = [torch.empty_like(flat) for _ in range(world)]
    if distributed:
        dist.all_gather(gathered, flat)
    else:
        gathered = [flat]
    return _report(torch.stack(gathered).cpu(), losses, rank, state)


def _train_xla(config: DemoConfig) -> dict[str, Any]:
    """TPU (or any XLA device): gradients averaged by ``xm.optimizer_step``'s all-reduce."""
    import torch
    import torch_xla
    import torch_xla.core.xla_model as xm

    from .state import ProcessState

    sync: Callable[[], Any] = getattr(torch_xla, "sync", xm.mark_step)  # mark_step before 2.6
    state = ProcessState()
    rank, world, device = state.process_index, state.num_processes, state.device
    shard_x, shard_y = _shard(config)
    shard_x, shard_y = shard_x.to(device), shard_y.to(device)
    print(f"rank {rank}/{world}: training on {len(shard_x)} of {config.samples} samples on {device}")
    model = make_model(config).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.learning_rate, momentum=0.9)

    def mean_over_ranks(value: Any) -> float:
        return float(xm.all_reduce(xm.REDUCE_SUM, value).item()) / world

    def step(loss: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        xm.optimizer_step(optimizer)  # all-reduces (averages) gradients across replicas
        sync()

    losses = _train_epochs(config, state, model, shard_x, shard_y, step, mean_over_ranks)

    gathered = xm.all_gather(_flat_parameters(model).unsqueeze(0), dim=0)
    return _report(gathered.cpu(), losses, rank, state)


def _train_epochs(config: DemoConfig, state: Any, model: Any, shard_x: Any, shard_y: Any,
                  step: Callable[[Any], None], mean_over_ranks: Callable[[Any], float]) -> list[float]:
    """The loop both paths share; ``step`` turns one loss into an update on every rank."""
    import torch

    losses = []
    for epoch in range(config.epochs):
        total, steps = torch.zeros((), device=shard_x.device), 0
        for x, y in _progress(batches(config, shard_x, shard_y, epoch, state.process_index),
                              config, epoch, state):
            with state.autocast():
                prediction = model(x)
            loss = torch.nn.functional.mse_loss(prediction.float(), y)
            step(loss)
            total += loss.detach()
            steps += 1
        losses.append(mean_over_ranks(total / steps))
        state.print(f"epoch {epoch + 1}/{config.epochs}: mean loss over {state.num_processes} "
                    f"rank(s) {losses[-1]:.5f}")
    return losses


def _flat_parameters(model: Any) -> Any:
    import torch

    return torch.cat([parameter.detach().reshape(-1) for parameter in model.parameters()])


def ranks_agree(gathered: Any) -> tuple[bool, float]:
    """Whether every row (one rank's parameters) equals rank 0's exactly, and the largest gap.

    Exact equality, not a tolerance: all ranks apply the same averaged gradients to the same
    start, so any difference at all means the averaging did not happen.
    """
    difference = (gathered - gathered[0]).abs().max().item() if len(gathered) > 1 else 0.0
    return difference == 0.0, float(difference)


def _report(gathered: Any, losses: list[float], rank: int, state: Any) -> dict[str, Any]:
    agreed, difference = ranks_agree(gathered)
    checksum = float(gathered[rank].double().sum().item())
    print(f"rank {rank}: done, parameter checksum {checksum:.6f}")
    world, values = gathered.shape
    if not agreed:
        state.print(f"FAIL: the {world} ranks hold different parameters (largest difference "
                    f"{difference:.3g})")
        raise RuntimeError(f"rank {rank}'s parameters differ from another rank's by up to "
                           f"{difference:.3g}: gradients were not averaged across ranks")
    state.print(f"PASS: all {world} rank(s) hold identical parameters ({values} values, checksum "
                f"{checksum:.6f}); loss {losses[0]:.5f} -> {losses[-1]:.5f}")
    return {"world_size": world, "losses": losses, "checksum": checksum}


def _progress(steps: Iterator[Any], config: DemoConfig, epoch: int, state: Any) -> Iterator[Any]:
    """A progress bar on the main process: tqdm where it is installed, a text bar otherwise."""
    items = list(steps)
    label = f"epoch {epoch + 1}/{config.epochs}"
    if not state.is_main_process:
        yield from items
        return
    try:
        from tqdm import tqdm  # the text bar: worker output reaches a notebook as text
    except ImportError:
        yield from _text_bar(items, label)
        return
    yield from tqdm(items, desc=label, unit="step", file=sys.stderr, leave=True)


def _text_bar(items: list[Any], label: str, width: int = 30) -> Iterator[Any]:
    total = len(items)
    for done, item in enumerate(items, start=1):
        yield item
        filled = width * done // total
        end = "\n" if done == total else ""
        print(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end=end,
              file=sys.stderr, flush=True)
