"""ProcessState under torch_xla on the CPU (PJRT_DEVICE=CPU): a real spawn, in a fresh interpreter.

One subprocess does it all, because importing torch_xla takes seconds: it first asks a
ProcessState everything without a launch and checks that the XLA runtime stayed uninitialised
(otherwise the spawn that follows would refuse to run), then spawns one replica with ``fork``.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.xla,
    pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None,
                       reason="needs torch_xla (the xla test tier)"),
]

SCRIPT = r'''
import json, os, sys
import torch
import torch_xla
import torch_xla.distributed.xla_multiprocessing as xmp
from xlaunch.state import ProcessState

out = sys.argv[1]

def record(name, value):
    with open(os.path.join(out, name + ".json"), "w") as file:
        json.dump(value, file)

state = ProcessState()
os.environ["XLAUNCH_MIXED_PRECISION"] = "bf16"
with state.autocast():
    cpu_dtype = str((torch.ones(2, 2) @ torch.ones(2, 2)).dtype)
del os.environ["XLAUNCH_MIXED_PRECISION"]
state.wait_for_everyone()
with state.main_process_first():
    pass
record("no_launch", dict(
    rank=state.process_index, world=state.num_processes, local=state.local_process_index,
    backend=state.backend, device=str(state.device), cpu_autocast=cpu_dtype,
    on_main=state.on_main_process(lambda: "ran")(),
    runtime_initialized=torch_xla._XLAC._xla_runtime_is_initialized()))


def replica(index):
    state = ProcessState()
    own_spawn_backend = state.backend  # a user's own xmp.spawn, before xlaunch marks the world
    os.environ["XLAUNCH_WORLD"] = "xla"  # what the xlaunch XLA backend sets in its workers
    state.wait_for_everyone()
    with state.main_process_first():
        pass
    os.environ["XLAUNCH_MIXED_PRECISION"] = "bf16"
    with state.autocast():
        product = torch.ones(4, 4, device=state.device) @ torch.ones(4, 4, device=state.device)
    os.environ["XLAUNCH_MIXED_PRECISION"] = "fp16"
    try:
        state.autocast()
        fp16 = "accepted"
    except ValueError as error:
        fp16 = str(error)
    with state.split_between_processes([1, 2, 3]) as share:
        pass
    record("replica", dict(
        index=index, own_spawn_backend=own_spawn_backend, backend=state.backend,
        device_type=state.device.type, rank=state.process_index, world=state.num_processes,
        local=state.local_process_index, is_main=state.is_main_process,
        is_last=state.is_last_process, product_dtype=str(product.dtype),
        product_sum=float(product.float().sum().cpu()), fp16=fp16, share=share,
        on_main=state.on_main_process(lambda: "ran")()))


xmp.spawn(replica, start_method="fork")
record("parent_after_spawn", dict(world_var=os.environ.get("XLAUNCH_WORLD")))
'''


@pytest.fixture(scope="module")
def xla_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    folder = tmp_path_factory.mktemp("xla-state")
    script = folder / "script.py"
    script.write_text(SCRIPT)
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "XLAUNCH_WORLD",
                          "XLAUNCH_MIXED_PRECISION")}
    env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    done = subprocess.run([sys.executable, str(script), str(folder)], env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return {path.stem: json.loads(path.read_text()) for path in Path(folder).glob("*.json")}


def test_a_state_outside_a_launch_leaves_the_xla_runtime_alone(xla_run: dict[str, Any]) -> None:
    assert xla_run["no_launch"] == dict(
        rank=0, world=1, local=0, backend=None, device="cpu", cpu_autocast="torch.bfloat16",
        on_main="ran", runtime_initialized=False)


def test_inside_an_xla_replica(xla_run: dict[str, Any]) -> None:
    replica = xla_run["replica"]
    assert replica.pop("fp16").startswith("mixed_precision 'fp16' is not supported on XLA")
    assert replica == dict(
        index=0, own_spawn_backend="xla", backend="xla", device_type="xla", rank=0, world=1,
        local=0, is_main=True, is_last=True, product_dtype="torch.bfloat16", product_sum=64.0,
        share=[1, 2, 3], on_main="ran")
    assert xla_run["parent_after_spawn"] == dict(world_var=None)
