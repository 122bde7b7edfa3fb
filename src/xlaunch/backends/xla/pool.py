"""``xmp.spawn(start_method="fork")`` from the launch thread: the replicas are the caller's children.

torch_xla's ``run_multiprocess`` never starts the runtime in the process that calls it, so the
caller can own the pool and no process stands between it and the replicas (a leader in between
cost about 40 ms a launch on the CPU device). What the replicas need before torch_xla starts in
them - ``PJRT_DEVICE``, the chip layout, Kaggle's presets removed - is set in the caller's
environment while the pool starts, and put back after.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading

from xlaunch import _compat
from xlaunch.backends.envvars import overlay
from xlaunch.backends.exits import ChildExit
from xlaunch.backends.supervise import stop_processes
from xlaunch.backends.xla import replica
from xlaunch.backends.xla.attempt import AttemptRun
from xlaunch.backends.xla.metrics import DEBUG_VAR
from xlaunch.plan.specs import LaunchPlan, XlaSpec
from xlaunch.worker.rank import flush_output

IMPORT_LIMIT_S = 120.0
WARM_POOL = "TORCH_WARM_POOL"
REAP_S = 2.0


class PoolRun(AttemptRun):
    def __init__(self, plan: LaunchPlan, spec: XlaSpec, job: replica.Job) -> None:
        super().__init__(plan, spec, job)
        self._pool: list[_compat.Child] = []  # xmp.spawn's processes, recorded as they start

    def _run(self) -> None:
        import_torch_xla()
        if not self._begin():
            return
        read_end, write_end = os.pipe()
        self.tail.start(read_end)
        assert self.tree is not None
        setup = dataclasses.replace(self.job.setup, tree=self.tree.ticket(forked=True))
        job = dataclasses.replace(self.job, setup=setup, stderr_fd=write_end)
        try:
            with _compat.recording_children() as pool, overlay(self._variables()):
                self._pool = pool
                _spawn(job)
        except SystemExit:
            pass  # a replica's failure, already in its own record
        except Exception as error:
            if type(error).__name__ != "BrokenProcessPool":  # the exit statuses say more
                raise
        finally:
            os.close(write_end)
            self._end_pool()

    def _variables(self) -> dict[str, str | None]:
        """What torch_xla reads in each replica before the function runs; None removes."""
        spec = self.spec
        values: dict[str, str | None] = {name: None for name in spec.unset_env}
        values.update(spec.worker_env)
        if spec.pjrt_device is not None and "PJRT_DEVICE" not in os.environ:
            values["PJRT_DEVICE"] = spec.pjrt_device
        if os.environ.get(DEBUG_VAR) == "1":  # the analysis goes to files the report reads
            values.update(PT_XLA_DEBUG_LEVEL="1", PT_XLA_DEBUG_FILE=str(self.attempt / "xla-debug"))
        return values

    def _end_pool(self) -> None:
        """Kill what is left of the pool (noted as the launcher's doing) and reap it."""
        _compat.kill_and_reap(self._pool, REAP_S)

    def _stop_all(self) -> None:
        self.stopped_all = True
        self.launch_dir.cancel()  # a replica not started yet will not start
        stop_processes(self._pool, self.tree, self.plan.stop_grace)

    def children(self) -> list[ChildExit]:
        return [ChildExit(c.pid, c.exitcode, frozenset(c.signals_sent))
                for c in self._pool]


def _spawn(job: replica.Job) -> None:
    import torch_xla.distributed.xla_multiprocessing as xmp

    replica.FORKED_JOB = job
    replica.ARMED.set()
    try:
        flush_output()  # buffered text would be written twice
        xmp.spawn(replica.replica, nprocs=None, start_method="fork")
    finally:
        replica.ARMED.clear()
        # The replicas were forked with it; here it would keep the function, its arguments (a
        # 200 MB dataset stayed in the notebook's memory) until the next launch.
        replica.FORKED_JOB = None


def import_torch_xla() -> None:
    """The first launch imports torch_xla here, once; later launches find it imported.

    On a TPU VM the import asks the GCE metadata server about the TPU, without a timeout of its
    own; the import runs in a thread of its own so that a server that never answers costs a
    bounded wait and a clear error, not a hung notebook.
    """
    if "torch_xla.debug.metrics" in sys.modules:
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

    loader = threading.Thread(target=load, name="xlaunch-import-torch_xla")
    # torch 2.8's CUDA build starts inductor's compile workers when torch_xla imports it:
    # processes the notebook would keep for nothing. Unless asked for, not at this import.
    with overlay({WARM_POOL: os.environ.get(WARM_POOL, "0")}):
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
