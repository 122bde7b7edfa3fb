"""``xmp.spawn(start_method="fork")`` from the launch thread: the replicas are the caller's children.

torch_xla's ``run_multiprocess`` never starts the runtime in the process that calls it, so the
caller can host the pool. It reads the device (``PJRT_DEVICE``) and the chip layout in that
process, though, and the caller's environment is the caller's: this way is taken only when it
already holds what the replicas need there (`can_run_here`); otherwise a launch leader sets it in
itself (`leader`). Every process the pool forks sets its own environment as it begins
(`replica.begin_process`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading

from xlaunch.backends.environment import Variables
from xlaunch.backends.processes import ProcessSet
from xlaunch.backends.xla import replica
from xlaunch.backends.xla.tail import Tail
from xlaunch.plan.specs import XlaSpec
from xlaunch.worker.rank import flush_output

IMPORT_LIMIT_S = 120.0
# The thread importing torch_xla: a launch stopped during the import leaves it finishing, and
# the next launch waits for it instead of finding a module half imported.
_LOADER: threading.Thread | None = None


def can_run_here(spec: XlaSpec, path_env: Variables) -> bool:
    """Whether the caller's environment already holds torch_xla's layer of the replicas'
    (`environment.xla_layer`): then nothing needs setting where ``xmp.spawn`` is called."""
    return (spec.nprocs is None and spec.start_method == "fork"
            and all(os.environ.get(name) == value for name, value in path_env.items()))


def run(job: replica.ReplicaJob, owner: ProcessSet, tail: Tail) -> None:
    """The pool, forked from the launch thread; each of its processes reports itself as it begins."""
    write_end = tail.open_pipe()
    setup = dataclasses.replace(job.setup, tree=owner.ticket(forked=True))
    try:
        spawn_pool(dataclasses.replace(job, setup=setup, stderr_fd=write_end))
    finally:
        os.close(write_end)


def spawn_pool(job: replica.ReplicaJob, start_method: str = "fork") -> None:
    """``xmp.spawn`` of every replica; a replica's failure is in its own record, not raised here."""
    import torch_xla.distributed.xla_multiprocessing as xmp

    forked = start_method == "fork"
    replica.FORKED_JOB = job if forked else None
    replica.ARMED = replica.Arming(threading.get_ident(), job) if forked else None
    try:
        flush_output()  # buffered text would be written twice
        xmp.spawn(replica.replica, args=() if forked else (job,), nprocs=None,
                  start_method=start_method)
    except SystemExit:
        pass  # a replica's failure, already in its own record
    except Exception as error:
        if type(error).__name__ != "BrokenProcessPool":  # the replicas' records say more
            raise
    finally:
        replica.ARMED = None
        # The replicas were forked with it; here it would keep the function, its arguments (a
        # 200 MB dataset stayed in the notebook's memory) until the next launch.
        replica.FORKED_JOB = None


def import_torch_xla() -> None:
    """The first launch imports torch_xla here, once; later launches find it imported.

    On a TPU VM the import asks the GCE metadata server about the TPU, without a timeout of its
    own; the import runs in a thread of its own so that a server that never answers costs a
    bounded wait and a clear error, not a hung notebook.
    """
    global _LOADER
    if _LOADER is not None and _LOADER.is_alive():  # an earlier launch's, stopped meanwhile
        _LOADER.join(IMPORT_LIMIT_S)
    if "torch_xla.debug.metrics" in sys.modules and (_LOADER is None or not _LOADER.is_alive()):
        return
    failed: list[BaseException] = []

    def load() -> None:
        try:
            # What every replica imports too: forked replicas then find it imported.
            import torch_xla
            import torch_xla.debug.metrics
            import torch_xla.distributed.xla_multiprocessing
            import torch_xla.runtime  # noqa: F401
        except BaseException as error:  # raised in the launch thread below
            failed.append(error)

    loader = _LOADER = threading.Thread(target=load, name="xlaunch-import-torch_xla", daemon=True)
    loader.start()
    loader.join(IMPORT_LIMIT_S)
    if loader.is_alive():
        raise RuntimeError(
            f"import torch_xla did not finish in {IMPORT_LIMIT_S:.0f} s. On a TPU VM it asks the "
            "metadata server (metadata.google.internal) which TPU this is, and that server did "
            "not answer. Check the VM's network, or set TPU_SKIP_MDS_QUERY=1 together with "
            "TPU_ACCELERATOR_TYPE (for example v5litepod-8) before launching.")
    if failed:
        raise failed[0]
