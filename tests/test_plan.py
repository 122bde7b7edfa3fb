"""The planner: every option takes effect on the path a launch takes, or is refused by name.

Plans are made for fake machines; nothing starts. Options left at their default are always
accepted; an option given a value the chosen path would not use is a ValueError naming the
option and the path, and a value of the wrong type is a TypeError naming the parameter.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import fake_machine
from xlaunch import notebook_launcher
from xlaunch.detect.environment import Environment, detect
from xlaunch.detect.machine import Machine
from xlaunch.plan import ElasticSpec, InlineSpec, XlaSpec, make_plan
from xlaunch.plan.options import LaunchOptions

CPU = Environment("local", "cpu", 1)
ROOMY = Machine(cores=2, memory_available=24 * 2**30)


def plan(env: Environment, **options):
    return make_plan(env, LaunchOptions(**options), ROOMY)


@pytest.fixture
def tpu(tmp_path: Path) -> Environment:
    return detect({}, root=fake_machine(tmp_path, tpu_chips=8, tpu_device="0x0063", dev="vfio"))


def test_each_path_gets_its_own_spec(tpu: Environment) -> None:
    assert isinstance(plan(CPU).spec, InlineSpec)
    assert isinstance(plan(CPU, num_processes=2).spec, ElasticSpec)
    assert isinstance(plan(tpu).spec, XlaSpec) and plan(tpu).world_size == 8


@pytest.mark.parametrize("option, value", [
    ("max_restarts", 1), ("start_method", "spawn"), ("use_port", "1234"),
    ("monitor_interval", 0.5), ("monitor_interval", 0.1), ("log_line_prefix_template", "${rank}"),
    ("rdzv_backend", "c10d"), ("rdzv_endpoint", "h:1"), ("rdzv_conf", {"timeout": 5}),
    ("master_addr", "10.0.0.2"), ("rdzv_id", "job"), ("compile_cache", "/tmp/cache"),
])
def test_one_process_in_the_caller_refuses_what_it_cannot_use(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"{option}=.*not used by the inline launch path"):
        plan(CPU, **{option: value})


@pytest.mark.parametrize("option, value", [
    ("use_port", "1234"), ("master_addr", "10.0.0.2"), ("rdzv_backend", "c10d"),
    ("rdzv_endpoint", "h:1"), ("rdzv_conf", {"timeout": 5}), ("rdzv_id", "job"),
    ("monitor_interval", 0.5),
])
def test_the_tpu_path_refuses_engine_options(tpu: Environment, option: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"{option}=.*not used by the xla launch path"):
        plan(tpu, **{option: value})


def test_the_tpu_path_honours_its_own_options(tpu: Environment) -> None:
    spec = plan(tpu, start_method="spawn", log_line_prefix_template="<${rank}> ",
                max_restarts=2, compile_cache="/data/cache").spec
    assert isinstance(spec, XlaSpec)
    assert (spec.start_method, spec.line_prefix) == ("spawn", "<${rank}> ")
    assert (spec.max_restarts, spec.compile_cache) == (2, "/data/cache")


def test_the_compile_cache_is_on_by_default_on_tpu_only(tpu: Environment, tmp_path: Path) -> None:
    def cache(env: Environment, environ: dict[str, str], **options: Any) -> Any:
        return make_plan(env, LaunchOptions(**options), ROOMY, environ).spec.compile_cache

    home = {"HOME": str(tmp_path)}
    assert cache(tpu, home) == str(tmp_path / ".cache/xlaunch/xla-compile")
    elsewhere = {**home, "XLAUNCH_COMPILE_CACHE": "/elsewhere"}
    assert cache(tpu, elsewhere) == "/elsewhere"
    assert cache(tpu, elsewhere, compile_cache=False) is None
    xla_cpu = Environment("local", "cpu", 1, xla_device="CPU")
    assert cache(xla_cpu, elsewhere) is None  # the CPU device cannot read it back
    assert cache(xla_cpu, elsewhere, compile_cache=True) == "/elsewhere"
    # No HOME given: the replica's own home, expanded where it sets the cache up.
    assert cache(tpu, {}) == "~/.cache/xlaunch/xla-compile"
    assert plan(xla_cpu, compile_cache=tmp_path).spec.compile_cache == str(tmp_path)


@pytest.mark.parametrize("option, value", [
    ("master_addr", "10.0.0.2"), ("rdzv_conf", {"timeout": 5}), ("compile_cache", "/tmp/c"),
])
def test_one_machine_on_the_engine_refuses_what_only_several_machines_use(
        option: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"{option}=.*not used by the elastic launch path"):
        plan(CPU, num_processes=2, **{option: value})


def test_one_machine_on_the_engine_takes_every_option_it_uses() -> None:
    spec = plan(CPU, num_processes=2, rdzv_backend="c10d",
                rdzv_id="job", max_restarts=2, monitor_interval=0.1, start_method="spawn",
                log_line_prefix_template="${rank}: ", compile_cache=False).spec
    assert isinstance(spec, ElasticSpec)
    assert (spec.rdzv_backend, spec.rdzv_id, spec.max_restarts) == ("c10d", "job", 2)
    assert (spec.monitor_interval, spec.start_method, spec.loopback_only) == (0.1, "spawn", True)
    several = plan(CPU, num_processes=2, num_nodes=2, master_addr="10.0.0.2").spec
    assert several.master_addr == "10.0.0.2" and not several.loopback_only


def test_several_nodes_at_a_loopback_address_say_they_can_only_meet_on_this_machine() -> None:
    for address in ("127.0.0.1", "localhost", "::1", "127.0.1.1"):
        notes = plan(CPU, num_processes=2, num_nodes=2, master_addr=address).notes
        assert any(f"master_addr={address} is this machine's loopback" in note and
                   "node 0's address" in note for note in notes), (address, notes)
    assert not plan(CPU, num_processes=2, num_nodes=2).spec.loopback_only  # the default too
    assert any("loopback" in note for note in plan(CPU, num_processes=2, num_nodes=2).notes)
    for quiet in (dict(master_addr="10.0.0.2"), dict(master_addr="node0.cluster"),
                  dict(rdzv_backend="c10d", rdzv_endpoint="10.0.0.2:29400")):
        assert not plan(CPU, num_processes=2, num_nodes=2, **quiet).notes, quiet
    assert not plan(CPU, num_processes=2).notes  # one node is on loopback by design


def test_decisions_live_in_the_plan() -> None:
    spec = plan(CPU, num_processes=2).spec
    assert spec.cpu_threads == 1 and spec.socket_ifname == "lo"  # 2 cores / 2 processes
    assert spec.monitor_interval == 0.1 and spec.port > 0


def test_only_a_port_left_at_its_default_may_fall_back() -> None:
    # The plan knows whether the caller passed use_port, not only what it reads: the default's
    # number named explicitly (as a str or an int) is the caller's port, like any other.
    assert plan(CPU, num_processes=2).spec.port_fallback
    for named in ("29500", 29500, "29511"):
        spec = plan(CPU, num_processes=2, use_port=named).spec
        assert not spec.port_fallback and spec.port == int(named), named
    assert not plan(CPU, num_processes=2, num_nodes=2).spec.port_fallback  # other nodes know it


def test_help_still_shows_the_default_port_as_29500() -> None:
    import pydoc

    parameter = inspect.signature(notebook_launcher).parameters["use_port"]
    assert parameter.default == "29500" and repr(parameter.default) == "'29500'"
    assert "use_port: 'str' = '29500'" in pydoc.render_doc(notebook_launcher, renderer=pydoc.plaintext)


@pytest.mark.parametrize("option, value", [
    ("timeout", "x"), ("num_processes", "2"), ("num_processes", 2.0), ("num_processes", True),
    ("mixed_precision", None), ("max_restarts", "1"), ("rdzv_conf", [("a", 1)]),
    ("report", "yes"), ("monitor_interval", "0.1"), ("use_port", 29500.0),
])
def test_a_wrong_type_is_a_type_error_naming_the_parameter(option: str, value: object) -> None:
    with pytest.raises(TypeError, match=rf"^{option} must be"):
        LaunchOptions(**{option: value})


def test_the_public_call_refuses_a_wrong_type_before_anything_starts() -> None:
    with pytest.raises(TypeError, match="timeout must be a number of seconds or None, not str"):
        notebook_launcher(print, timeout="x")


def test_more_cpu_processes_than_the_machine_can_hold_are_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"num_processes=1000 .* 2 core\(s\) .*at most 16"):
        make_plan(CPU, LaunchOptions(num_processes=1000), ROOMY)
    small = Machine(cores=64, memory_available=1 * 2**30)
    with pytest.raises(ValueError, match=r"need about 5120 MiB .* 1024 MiB available; use at most 4"):
        make_plan(CPU, LaunchOptions(num_processes=20), small)
    assert make_plan(CPU, LaunchOptions(num_processes=4), small).num_processes == 4


def test_the_machine_is_read_from_its_files(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "meminfo").write_text("MemTotal: 100 kB\nMemAvailable:  2048 kB\n")
    assert Machine.here(str(tmp_path)).memory_available == 2048 * 1024
    cgroup = tmp_path / "sys" / "fs" / "cgroup"
    cgroup.mkdir(parents=True)
    (cgroup / "memory.max").write_text("1048576\n")
    (cgroup / "memory.current").write_text("524288\n")
    assert Machine.here(str(tmp_path)).memory_available == 524288


# --- SPMD ---------------------------------------------------------------------------------------

XLA_CPU = Environment("local", "cpu", 4, xla_device="CPU")


def test_spmd_is_one_process_driving_every_device(tpu: Environment) -> None:
    launch = plan(XLA_CPU, spmd=True)
    assert isinstance(launch.spec, XlaSpec) and launch.spec.spmd_devices == 4
    assert (launch.num_processes, launch.world_size, launch.spec.nprocs) == (1, 1, 1)
    assert launch.summary() == "1 process driving 4 XLA CPU devices (SPMD)"
    assert plan(tpu, spmd=True).summary() == "1 process driving 8 TPU devices (SPMD)"
    assert plan(XLA_CPU, spmd=True, num_processes=1).spec.spmd_devices == 4


def test_spmd_on_a_pod_slice_is_one_process_on_each_host(tmp_path: Path) -> None:
    # A v5p slice of two hosts (GCE names both): the same launch runs on every host, one SPMD
    # process each, as torch_xla documents multi-host SPMD; torch_xla forms the world.
    pod = {"TPU_WORKER_HOSTNAMES": "t1v-0,t1v-1", "TPU_WORKER_ID": "0",
           "XLAUNCH_TPU_RUNTIME": "torch_xla"}
    env = detect(pod, root=fake_machine(tmp_path, tpu_chips=4, tpu_device="0x0062", dev="vfio"))
    launch = plan(env, spmd=True)
    assert isinstance(launch.spec, XlaSpec) and launch.spec.spmd_devices == env.device_count
    assert (launch.num_nodes, launch.num_processes, launch.spec.nprocs) == (2, 1, 1)
    assert launch.summary() == "1 process driving 4 TPU devices (SPMD) on each of 2 hosts"
    assert launch.notes == ("a pod slice of 2 hosts: run the same launch on every host (one SPMD "
                            "process each; torch_xla forms the world)",)
    # A single host has no such note.
    single = detect({**pod, "TPU_WORKER_HOSTNAMES": "t1v-0"},
                    root=fake_machine(tmp_path, tpu_chips=4, tpu_device="0x0062", dev="vfio",
                                      name="single"))
    assert plan(single, spmd=True).notes == ()


def test_spmd_refuses_a_count_of_processes() -> None:
    with pytest.raises(ValueError, match=r"num_processes=4 with spmd=True: SPMD is one process "
                                         r"per host"):
        plan(XLA_CPU, spmd=True, num_processes=4)


def test_spmd_beyond_torch_xla_names_the_path_and_what_serves_there(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"CPU path.*XLAUNCH_ACCELERATOR=xla and PJRT_DEVICE=CPU"):
        plan(CPU, spmd=True, num_processes=2)
    gpus = Environment("local", "cuda", 2)
    with pytest.raises(ValueError, match=r"GPU path.*FSDP / DTensor"):
        plan(gpus, spmd=True)
    torch_tpu = Environment("cloud-tpu-vm", "tpu", 8, "v5e", 8, 1, tpu_runtime="torch_tpu",
                            xla_device="TPU")
    with pytest.raises(ValueError, match=r"TorchTPU: shard a large model there with FSDP2 / "
                                         r"DTensor over tpu_dist"):
        plan(torch_tpu, spmd=True)


# --- a process that already ran autograd's device threads ---------------------------------------

AFTER_AUTOGRAD = Machine(cores=2, memory_available=24 * 2**30, autograd_threads=True)


def test_after_a_compiled_backward_the_workers_are_spawned_not_forked() -> None:
    launch = make_plan(CPU, LaunchOptions(num_processes=2), machine=AFTER_AUTOGRAD)
    assert launch.spec.start_method == "spawn"
    assert any("spawned, not forked" in note and "first backward" in note for note in launch.notes)
    assert make_plan(CPU, LaunchOptions(num_processes=2), machine=ROOMY).spec.start_method == "fork"


def test_fork_asked_for_after_a_compiled_backward_is_refused_saying_what_to_do(tpu) -> None:
    with pytest.raises(RuntimeError, match=r"start_method='fork': this process already ran "
                                           r"autograd.*Leave start_method at its default"):
        make_plan(CPU, LaunchOptions(num_processes=2, start_method="fork"), machine=AFTER_AUTOGRAD)
    xla = make_plan(tpu, LaunchOptions(), machine=AFTER_AUTOGRAD)
    assert xla.spec.start_method == "spawn"
    with pytest.raises(RuntimeError, match=r"one replica forks its worker"):
        make_plan(tpu, LaunchOptions(num_processes=1), machine=AFTER_AUTOGRAD)
    with pytest.raises(RuntimeError, match=r"spmd=True forks its worker"):
        make_plan(tpu, LaunchOptions(spmd=True), machine=AFTER_AUTOGRAD)


# --- what this process already did: facts gathered before planning, passed in -------------------

AFTER_CUDA = Machine(cores=2, memory_available=24 * 2**30, cuda_initialised=True)
GPUS = Environment("local", "cuda", 2)


def test_cuda_initialised_spawns_the_default_and_refuses_fork_and_forkserver_only() -> None:
    launch = make_plan(GPUS, LaunchOptions(), machine=AFTER_CUDA)
    assert launch.spec.start_method == "spawn"
    assert any("spawned, not forked: CUDA is already initialised" in note for note in launch.notes)
    for method in ("fork", "forkserver"):
        with pytest.raises(RuntimeError, match=rf"start_method='{method}': CUDA is already "
                                               r"initialised.*Leave start_method at its default"):
            make_plan(GPUS, LaunchOptions(start_method=method), machine=AFTER_CUDA)
    assert make_plan(GPUS, LaunchOptions(start_method="spawn"),
                     machine=AFTER_CUDA).spec.start_method == "spawn"
    # Only the GPU path's workers need the GPUs: CPU processes and one GPU process in place fork
    # (or run) as ever.
    cpu = make_plan(GPUS, LaunchOptions(num_processes=2, cpu_only=True), machine=AFTER_CUDA)
    assert cpu.spec.start_method == "fork"
    assert isinstance(make_plan(GPUS, LaunchOptions(num_processes=1), machine=AFTER_CUDA).spec,
                      InlineSpec)


def test_an_initialised_xla_runtime_refuses_the_xla_path(tpu) -> None:
    used = Machine(cores=2, memory_available=24 * 2**30, xla_runtime_initialised=True)
    with pytest.raises(RuntimeError, match=r"XLA runtime is already initialised"):
        make_plan(tpu, LaunchOptions(), machine=used)
    assert make_plan(CPU, LaunchOptions(num_processes=2), machine=used).path == "elastic"


def test_a_launch_inside_a_worker_is_refused_by_the_plan() -> None:
    worker = Machine(cores=2, memory_available=24 * 2**30, pid=4321)
    with pytest.raises(RuntimeError, match=r"called inside a launched function"):
        make_plan(CPU, LaunchOptions(), worker, {"XLAUNCH_WORKER": "4321"})
    # A value inherited from a worker by a process it started names another pid.
    assert make_plan(CPU, LaunchOptions(), worker, {"XLAUNCH_WORKER": "1"}).path == "inline"


def test_the_plan_reads_the_variables_it_is_given_not_the_process_s(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    launch = make_plan(CPU, LaunchOptions(num_processes=2), ROOMY, {})
    assert launch.spec.cpu_threads == 1 and not launch.notes
    given = make_plan(CPU, LaunchOptions(num_processes=2), ROOMY,
                      {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0"})
    assert given.spec.cpu_threads == 0
    assert any("GLOO_SOCKET_IFNAME=eth0" in note for note in given.notes)


def test_gpu_and_cpu_workers_tell_accelerate_and_transformers_not_to_take_xla(tpu) -> None:
    """Where torch_xla is installed (Colab's TPU runtime), accelerate and transformers take XLA
    for the device unless USE_TORCH_XLA says no (tests/test_accelerate_options.py runs it on the
    notebook Pythons' venvs, which hold torch_xla)."""
    assert plan(CPU, num_processes=2).worker_variables()["USE_TORCH_XLA"] == "0"
    assert plan(Environment("local", "cuda", 2)).worker_variables()["USE_TORCH_XLA"] == "0"
    assert "USE_TORCH_XLA" not in plan(tpu).worker_variables()  # XLA replicas use it
    assert "USE_TORCH_XLA" not in plan(CPU).worker_variables()  # the caller's own process


def test_the_core_tier_launches_on_the_cpu_whatever_the_machine_has() -> None:
    """tests/conftest.py: a core test's "2 processes" are CPU processes, GPUs present or not."""
    assert os.environ.get("XLAUNCH_ACCELERATOR") == "cpu"
    assert detect().accelerator == "cpu"


@pytest.mark.any_accelerator
def test_a_core_test_can_launch_on_whatever_the_machine_has() -> None:
    assert os.environ.get("XLAUNCH_ACCELERATOR") == AS_STARTED  # the run's own, untouched


AS_STARTED = os.environ.get("XLAUNCH_ACCELERATOR")  # read at import, before any fixture
