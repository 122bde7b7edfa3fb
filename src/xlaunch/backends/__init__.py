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

import os
import threading
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
    """The one dispatch on the plan's spec: its type names the backend.

    One launch at a time per process: a launch sets process-wide state while it starts its
    workers (the environment they inherit, the temporary directory the engine writes to,
    multiprocessing's record of children), so a second launch from another thread is refused at
    once rather than left to tangle with the first. A launch from inside a launch's own thread
    (a one-process launch's function launching again) is allowed.
    """
    if not _LAUNCHING.acquire(blocking=False):
        raise RuntimeError(
            "another launch is already running in this process (started from another thread): "
            "xlaunch runs one launch at a time per process, because a launch sets process-wide "
            "state (environment variables, the temporary directory) while its workers start. "
            "Wait for it to finish (join its thread), or start the second launch in a separate "
            "process.")
    try:
        spec = plan.spec
        if isinstance(spec, XlaSpec):
            return XLA(plan, spec, function, args)
        if isinstance(spec, TorchTpuSpec):  # before ElasticSpec: it is one, with TorchTPU's extras
            return TORCH_TPU(plan, spec, function, args)
        if isinstance(spec, ElasticSpec):
            return ELASTIC(plan, spec, function, args)
        return INLINE(plan, spec, function, args)
    finally:
        _LAUNCHING.release()


_LAUNCHING = threading.RLock()


def _fresh_lock() -> None:
    """A worker forked while the caller's launch held the lock starts with a free one."""
    global _LAUNCHING
    _LAUNCHING = threading.RLock()


os.register_at_fork(after_in_child=_fresh_lock)
