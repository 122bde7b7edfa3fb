"""What a worker's environment holds, and which layer wins (backends/environment.py): the
caller's < the launch's < the path's own < the rank's < the process's."""

from __future__ import annotations

import os

import pytest

from tests.fakes import fake_machine
from xlaunch.backends.environment import (
    World,
    launch_environment,
    overlay,
    rank_layer,
    worker_environment,
    xla_layer,
)
from xlaunch.detect import Machine, detect
from xlaunch.names import DEVICE_VAR, RESTART_VAR, STORE_DIR_VAR, WORKER_VAR, WORLD_VAR
from xlaunch.plan import LaunchOptions, make_plan


def cpu_plan(**options):
    """Two CPU processes on a 4-core machine, planned from what it is given alone."""
    return make_plan(detect({"XLAUNCH_ACCELERATOR": "cpu"}), LaunchOptions(num_processes=2,
                     **options), Machine(cores=4, memory_available=None), {})


def the_worker(caller: dict[str, str], *layers: dict[str, str | None]) -> dict[str, str]:
    """The environment a worker ends with: the caller's, then each layer applied in order."""
    result = dict(caller)
    for layer in layers:
        for name, value in layer.items():
            if value is None:
                result.pop(name, None)
            else:
                result[name] = value
    return result


def test_the_layers_win_in_their_order_torch_tpus_master_variables_included():
    plan = cpu_plan(mixed_precision="bf16")
    caller = {"ACCELERATE_MIXED_PRECISION": "fp16", "RANK": "7", WORLD_VAR: "xla",
              "GLOO_SOCKET_IFNAME": "eth1", "HOME": "/home/user"}
    # What TorchTPU's set_tpu_launch_env gives (the path's own layer), MASTER_* among it.
    torch_tpu = {"MASTER_ADDR": "localhost", "MASTER_PORT": "1111", "NODE_RANK": "0",
                 "TORCH_TPU_TOPOLOGY": "2,2,1"}
    launch = launch_environment(plan, caller, torch_tpu)
    world = World(rank_offset=2, world_size=4, local_world_size=2, node_rank=1, num_nodes=2,
                  master_addr="10.0.0.1", master_port=29510, store_prefix="/xlaunch/job")
    rank = rank_layer(world, 1, attempt=1, run_id="job", max_restarts=2, store_dir=None)
    env = the_worker(caller, worker_environment(launch, rank, attempt=1, pid=4321))
    assert env["HOME"] == "/home/user"  # the caller's, untouched
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"  # the launch's over the caller's
    assert env["GLOO_SOCKET_IFNAME"] == "eth1"  # a default of the launch's: the caller's wins
    assert env["TORCH_TPU_TOPOLOGY"] == "2,2,1"  # the path's own
    # The rank's over TorchTPU's: the store the group forms through.
    assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.1", "29510")
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("3", "1", "4")
    assert (env["GROUP_RANK"], env["TORCHELASTIC_RESTART_COUNT"]) == ("1", "1")
    assert (env[RESTART_VAR], env[WORKER_VAR], env[DEVICE_VAR]) == ("1", "4321", "cpu")
    assert WORLD_VAR not in env  # xlaunch's own names come from the launch alone
    assert STORE_DIR_VAR not in env  # several machines: the group meets at MASTER_ADDR


def test_one_machines_group_meets_in_the_attempts_folder_and_on_loopback():
    plan = cpu_plan()
    launch = launch_environment(plan, {})
    rank = rank_layer(World(0, 2, 2, master_port=29500), 0, attempt=0, run_id="none",
                      max_restarts=0, store_dir="/tmp/xlaunch-1-ab/attempt-0")
    env = the_worker({}, worker_environment(launch, rank, attempt=0, pid=1))
    assert env[STORE_DIR_VAR] == "/tmp/xlaunch-1-ab/attempt-0"
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "lo"
    assert env["OMP_NUM_THREADS"] == "2"  # 4 cores, 2 processes
    assert env["ACCELERATE_USE_CPU"] == "True"


def test_an_xla_replicas_environment(tmp_path):
    env = detect({"XLAUNCH_ACCELERATOR": "xla", "PJRT_DEVICE": "CPU"},
                 root=fake_machine(tmp_path))
    plan = make_plan(env, LaunchOptions())
    caller = {"PJRT_DEVICE": "CPU", "XLAUNCH_XLA_DEBUG": "1", "TPU_PROCESS_ADDRESSES": "local"}
    spec = plan.spec.__class__(**{**plan.spec.__dict__, "unset_env": ("TPU_PROCESS_ADDRESSES",)})
    path = xla_layer(spec, caller, "/tmp/xlaunch-1-ab")
    replica = the_worker(caller, worker_environment(launch_environment(plan, caller, path),
                                                    attempt=0, pid=99, xla=True))
    assert replica[WORLD_VAR] == "xla:99"  # only this process is a replica, not its children
    assert "TPU_PROCESS_ADDRESSES" not in replica  # Kaggle's preset, removed
    assert DEVICE_VAR not in replica  # an XLA replica's world names its device
    assert replica["PT_XLA_DEBUG_FILE"] == "/tmp/xlaunch-1-ab/xla-debug.99"  # a file per process


def test_a_pjrt_device_the_caller_set_wins(tmp_path):
    env = detect({"XLAUNCH_ACCELERATOR": "xla", "PJRT_DEVICE": "CPU"},
                 root=fake_machine(tmp_path))
    spec = make_plan(env, LaunchOptions()).spec
    assert xla_layer(spec, {"PJRT_DEVICE": "CUDA"}, "/f")["PJRT_DEVICE"] == "CUDA"


def test_a_one_process_launch_overlays_the_caller_and_puts_everything_back(monkeypatch):
    monkeypatch.setenv(WORKER_VAR, "preset")
    monkeypatch.delenv("XLAUNCH_TEST_SET_INSIDE", raising=False)
    before = dict(os.environ)
    with overlay(worker_environment(launch_environment(cpu_plan(), os.environ), attempt=0,
                                    pid=None)):
        assert WORKER_VAR not in os.environ and os.environ[RESTART_VAR] == "0"
        os.environ["XLAUNCH_TEST_SET_INSIDE"] = "1"
    assert dict(os.environ) == before


@pytest.mark.parametrize("raised", [True, False])
def test_overlay_restores_on_an_exception_too(monkeypatch, raised):
    monkeypatch.setenv("XLAUNCH_TEST_OVERLAID", "before")
    before = dict(os.environ)
    with pytest.raises(RuntimeError) if raised else overlay({}):
        with overlay({"XLAUNCH_TEST_OVERLAID": None}):
            assert "XLAUNCH_TEST_OVERLAID" not in os.environ
            if raised:
                raise RuntimeError
    assert dict(os.environ) == before


def test_gpu_and_cpu_workers_tell_accelerate_and_transformers_not_to_take_xla(tmp_path):
    """Where torch_xla is installed (Colab's TPU runtime), accelerate and transformers take XLA
    for the device unless USE_TORCH_XLA says no (tests/test_accelerate_options.py runs it on the
    notebook Pythons' venvs, which hold torch_xla)."""
    machine = Machine(cores=4, memory_available=None)
    gpus = make_plan(detect({"XLAUNCH_ACCELERATOR": "cuda", "CUDA_VISIBLE_DEVICES": "0,1"},
                            root=fake_machine(tmp_path / "gpus", gpus=2)), LaunchOptions(), machine, {})
    xla = make_plan(detect({"XLAUNCH_ACCELERATOR": "xla", "PJRT_DEVICE": "CPU"},
                           root=fake_machine(tmp_path / "xla")), LaunchOptions(), machine, {})
    one = make_plan(detect({"XLAUNCH_ACCELERATOR": "cpu"}), LaunchOptions(), machine, {})
    assert launch_environment(cpu_plan(), {})["USE_TORCH_XLA"] == "0"
    assert launch_environment(gpus, {})["USE_TORCH_XLA"] == "0"
    assert "USE_TORCH_XLA" not in launch_environment(xla, {})  # XLA replicas use it
    assert "USE_TORCH_XLA" not in launch_environment(one, {})  # the caller's own process
