"""A launcher started inside a worker is refused at once, naming what serves instead.

The launch already runs one process per device, and its workers are that world (torchrun's
variables say so to Lightning, accelerate and transformers). A launcher called inside one would
start more processes that try to join a world that is full: Lightning's ``ddp_notebook`` forked
two more from each worker and waited until the timeout. So in a worker:

- xlaunch's own ``notebook_launcher`` is refused by its plan (``Machine.pid`` and the worker's
  variable);
- a fork made by torch's ``start_processes`` (what Lightning's ``ddp_notebook``/``ddp_spawn``
  and accelerate's ``notebook_launcher`` start their processes with) or by torch_xla's
  ``xmp.spawn`` pool is refused by an audit hook (PEP 578, ``os.fork``) before it happens. Other
  forks (a DataLoader's workers, a ``subprocess``) go on as ever.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from xlaunch.names import IN_A_WORKER, WORKER_VAR

# Where a fork comes from when a launcher makes it: torch.multiprocessing's start_processes and
# torch_xla's pool (its xmp.spawn inside a script run is run in place: worker/script.py).
LAUNCHER_FRAMES = {"torch/multiprocessing/spawn.py": "torch.multiprocessing.start_processes",
                   "torch_xla/_internal/pjrt.py": "torch_xla's xmp.spawn"}
_hooked_in = 0  # the pid whose audit hook is installed (a hook cannot be removed)


def in_worker() -> bool:
    return os.environ.get(WORKER_VAR) == str(os.getpid())


def refuse_launchers() -> None:
    """In a worker: refuse the forks that launchers make; once per process."""
    global _hooked_in
    if _hooked_in == os.getpid():
        return
    _hooked_in = os.getpid()
    sys.addaudithook(_audit)


def _audit(event: str, args: Any) -> None:
    if event != "os.fork" or not in_worker():
        return
    frame = sys._getframe(1)
    while frame is not None:
        name = frame.f_code.co_filename.replace(os.sep, "/")
        for file, launcher in LAUNCHER_FRAMES.items():
            if name.endswith(file):
                raise RuntimeError(f"a launcher ({launcher}) tried to start processes inside a "
                                   f"worker of an xlaunch launch. {IN_A_WORKER}.")
        frame = frame.f_back  # type: ignore[assignment]
