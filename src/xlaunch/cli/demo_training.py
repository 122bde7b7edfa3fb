"""The demo's training: the same small model on every rank, gradients averaged across ranks.

The launched function is `train`, a module-level function, so ``--start-method spawn`` can pickle
it; torch and torch_xla are imported inside functions, so that ``xlaunch env`` (whose parser
imports the demo) stays cheap and the GPU/CPU path never imports torch_xla.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any


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


def train(config: DemoConfig) -> dict[str, Any]:
    """The launched function: the same training on each rank, gradients averaged across ranks."""
    from xlaunch.state import ProcessState

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
    from xlaunch.state import ProcessState

    features, targets = make_data(config)
    with ProcessState().split_between_processes({"x": features, "y": targets}) as shard:
        return shard["x"], shard["y"]


def _train_torch(config: DemoConfig) -> dict[str, Any]:
    """GPU or CPU: DistributedDataParallel over the group the launcher made (none for 1 process)."""
    import torch
    import torch.distributed as dist

    from xlaunch.state import ProcessState

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

    from xlaunch.state import ProcessState

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
        torch_xla.sync()

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
