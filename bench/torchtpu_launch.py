"""TorchTPU's path against TorchTPU's own recipe, and a spawned notebook function against
``torch.multiprocessing.spawn``, side by side in one run (launchers take turns each repetition).

    # in the torch_tpu venv (torch 2.13.0 CPU + torch-tpu 0.2.0), no TPU needed
    TPU_SKIP_MDS_QUERY=1 python bench/torchtpu_launch.py --repeats 3

Figures (medians, seconds, ours / theirs):

- ``torch_tpu``: xlaunch's TorchTPU path (a fake v4 host, 2 devices, ``TORCH_TPU_TOPOLOGY`` given
  as on a host) against the recipe TorchTPU documents: ``set_tpu_launch_env(nproc_per_node=2)``
  then ``torch.multiprocessing.spawn``. Both form a ``tpu_dist`` group (gloo substituted, as in
  the tests: tests/torch_tpu/on_cpu) and meet at a barrier; both pay TorchTPU's import per worker.
- ``spawn``: ``notebook_launcher(fn, num_processes=2, start_method="spawn")`` of a function made in
  place (as in a cell: it travels by cloudpickle) on the CPU path against ``mp.spawn`` of a
  module-level function that forms a gloo group.
- ``import``: ``python -c "import torch"`` with TorchTPU's autoload on and off: what each spawned
  worker pays for torch-tpu being installed.

Nothing asserts a timing.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ON_CPU = ROOT / "tests" / "torch_tpu" / "on_cpu"
sys.path[:0] = [str(ROOT / "src"), str(ROOT), str(ON_CPU)]
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ON_CPU),
                                            os.environ.get("PYTHONPATH", "")])
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")


def recipe_worker(index: int, world: int, port: int, backend: str) -> None:
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=index,
                            world_size=world)
    dist.barrier()
    dist.destroy_process_group()


def xlaunch_worker() -> int:
    import xlaunch

    state = xlaunch.ProcessState()
    state.wait_for_everyone()
    return state.process_index


def run_recipe(backend: str, with_tpu_env: bool) -> None:
    import torch.multiprocessing as mp

    from xlaunch.backends.ports import free_port

    saved = dict(os.environ)
    try:
        if with_tpu_env:
            from torch.tpu import distributed  # type: ignore[attr-defined]

            distributed.set_tpu_launch_env(nproc_per_node=2)
        mp.spawn(recipe_worker, args=(2, free_port(), backend), nprocs=2)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def torch_tpu_launch(root: Path) -> None:
    from xlaunch.api import run_plan
    from xlaunch.detect import detect
    from xlaunch.plan import LaunchOptions, make_plan

    plan = make_plan(detect({}, root=root), LaunchOptions(report=False))
    assert plan.path == "torch_tpu", plan.summary()
    assert run_plan(plan, xlaunch_worker, ()) == 0


def spawn_launch() -> None:
    import xlaunch

    offset = 0

    def cell_function() -> int:  # made in place: travels by value
        return xlaunch_worker() + offset

    os.environ["XLAUNCH_ACCELERATOR"] = "cpu"
    try:
        assert xlaunch.notebook_launcher(cell_function, num_processes=2, start_method="spawn",
                                         report=False) == 0
    finally:
        del os.environ["XLAUNCH_ACCELERATOR"]


def timed(function, *args) -> float:
    started = time.perf_counter()
    function(*args)
    return time.perf_counter() - started


def import_torch(autoload: bool) -> float:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": "1" if autoload else "0"}
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], env=env, check=True,
                   capture_output=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    options = parser.parse_args()
    import torch

    from tests.fakes import fake_machine

    os.environ["TORCH_TPU_TOPOLOGY"] = "1,2,1"
    root = fake_machine(Path(tempfile.mkdtemp()), tpu_chips=2, tpu_device="0x005e", dev="vfio")
    pairs = {
        "torch_tpu": (lambda: torch_tpu_launch(root), lambda: run_recipe("tpu_dist", True)),
        "spawn": (spawn_launch, lambda: run_recipe("gloo", False)),
        "import": (lambda: import_torch(True), lambda: import_torch(False)),
    }
    samples: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in pairs}
    load_before = os.getloadavg()
    for repeat in range(options.repeats):
        for name, (ours, theirs) in pairs.items():
            order = [(0, ours), (1, theirs)] if repeat % 2 == 0 else [(1, theirs), (0, ours)]
            for side, function in order:
                seconds = function() if name == "import" else timed(function)
                samples[name][side].append(seconds)
    load_after = os.getloadavg()
    labels = {"torch_tpu": ("xlaunch TorchTPU path", "set_tpu_launch_env + mp.spawn"),
              "spawn": ("xlaunch spawn, cell function", "mp.spawn, module function"),
              "import": ("import torch, TorchTPU autoload", "import torch, autoload off")}
    print(f"\n{datetime.date.today()}, {os.cpu_count()} cores, load {load_before[0]:.1f} -> "
          f"{load_after[0]:.1f}, {options.repeats} repetitions, torch {torch.__version__}")
    print("| Figure | ours (median s) | theirs (median s) | ratio |\n|---|---|---|---|")
    for name, (ours, theirs) in samples.items():
        a, b = statistics.median(ours), statistics.median(theirs)
        print(f"| {labels[name][0]} vs {labels[name][1]} | {a:.2f} | {b:.2f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
