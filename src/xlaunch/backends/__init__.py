"""Each path's backend: carry out a `LaunchPlan` and return what happened as an `Outcome`.

A backend never raises for a worker's failure and never re-detects the machine: it starts what the
plan says, stops it at the plan's timeout or the caller's interrupt, and hands back the facts each
process left, for `xlaunch.result.judge`. One module or package per path:

- `xla`: TPU cores (and XLA's CPU/GPU devices) through torch_xla's ``xmp.spawn``;
- `torch_tpu`: TPU devices through TorchTPU (`elastic`, with TorchTPU's variables and worker);
- `elastic`: GPUs and CPU processes: torch's process layer on one machine, torch elastic's
  rendezvous across several;
- `inline`: one process, the caller's own.

Every process a launch starts has one owner, `processes.ProcessSet`: it starts them, stops them
and records which signals reached each. Every path that starts processes runs its attempts as one
`supervise.Attempt` (the gate, the deadline, the stop, the facts; the restarts), supplying only a
`Starter` of its own; `environment` builds every variable a worker gets.
"""

from __future__ import annotations

import concurrent.futures.thread  # noqa: F401  (see _ready_for_shutdown below)
import os
import threading
import weakref
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

    One launch at a time per process: torch_xla's forked pool takes its job from a module-level
    slot and its processes are set up by an at-fork hook, and a one-process launch runs in the
    caller with the launch's variables, so a second launch from another thread is refused at once
    rather than left to tangle with the first. A launch from inside a launch's own thread (a
    one-process launch's function launching again) is allowed.
    """
    if not _LAUNCHING.acquire(blocking=False):
        raise RuntimeError(
            "another launch is already running in this process (started from another thread): "
            "xlaunch runs one launch at a time per process. "
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


# What a launch's first use of torch registers as it goes, registered now, while it still can be.
# torch's import (in the caller on the fork path, in every forked worker) imports
# concurrent.futures.thread, which adds a threading exit hook at its import, and makes
# weakref.finalize objects, the first of which adds weakref's exit hook. Once the interpreter is
# shutting down (a launch from an atexit handler) the first is refused ("can't register atexit after
# shutdown", inherited by forked workers too) and the second never runs (torch's finalizers then
# fail at teardown). Both done at xlaunch's import, a first launch from an atexit handler works.
class _ReadyForShutdown:
    pass


_READY_FOR_SHUTDOWN = _ReadyForShutdown()
weakref.finalize(_READY_FOR_SHUTDOWN, lambda: None).atexit = False  # lives with the module
