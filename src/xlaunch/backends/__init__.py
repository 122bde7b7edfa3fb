"""Each path's backend: carry out a `LaunchPlan` and return what happened as an `Outcome`.

A backend never raises for a worker's failure and never re-detects the machine: it starts what the
plan says, stops it at the plan's timeout or the caller's interrupt, and hands back the facts each
process left, for `xlaunch.result.judge`. One module or package per path:

- `xla`: TPU cores (and XLA's CPU/GPU devices) through torch_xla's ``xmp.spawn``;
- `torch_tpu`: TPU devices through TorchTPU, on torch elastic's agent (`elastic` with extras);
- `elastic`: GPUs and CPU processes through torch elastic's agent;
- `inline`: one process, the caller's own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from xlaunch.backends import elastic, inline, torch_tpu, xla
from xlaunch.plan.specs import ElasticSpec, InlineSpec, LaunchPlan, PathSpec, TorchTpuSpec, XlaSpec
from xlaunch.result.outcome import Outcome

SpecT = TypeVar("SpecT", bound=PathSpec, contravariant=True)


class Backend(Protocol[SpecT]):
    """What every path implements: one call that runs the plan's workers to their end."""

    def __call__(self, plan: LaunchPlan, spec: SpecT, function: Callable[..., Any],
                 args: tuple[Any, ...], /) -> Outcome: ...


XLA: Backend[XlaSpec] = xla.launch
TORCH_TPU: Backend[TorchTpuSpec] = torch_tpu.launch
ELASTIC: Backend[ElasticSpec] = elastic.launch
INLINE: Backend[InlineSpec] = inline.launch


def carry_out(plan: LaunchPlan, function: Callable[..., Any], args: tuple[Any, ...]) -> Outcome:
    """The one dispatch on the plan's spec: its type names the backend."""
    spec = plan.spec
    if isinstance(spec, XlaSpec):
        return XLA(plan, spec, function, args)
    if isinstance(spec, TorchTpuSpec):  # before ElasticSpec: it is one, with TorchTPU's extras
        return TORCH_TPU(plan, spec, function, args)
    if isinstance(spec, ElasticSpec):
        return ELASTIC(plan, spec, function, args)
    return INLINE(plan, spec, function, args)
