"""TorchTPU plans on fake machines: spawn only, tpu_dist, the counts of TorchTPU's tables, pods.

Nothing starts; the environment TorchTPU's own ``set_tpu_launch_env`` computes at launch is
checked in the torch_tpu tier (tests/torch_tpu), where the package is installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fakes import fake_machine, torch_tpu_line
from xlaunch.cli.env import env_report, format_report
from xlaunch.detect.environment import Environment, detect
from xlaunch.detect.machine import Machine
from xlaunch.plan import ElasticSpec, TorchTpuSpec, make_plan
from xlaunch.plan.options import LaunchOptions

ROOMY = Machine(cores=2, memory_available=24 * 2**30)
ON_TORCH_TPU = {"XLAUNCH_TPU_RUNTIME": "torch_tpu"}


def tpu(tmp_path: Path, chips: int = 8, device: str = "0x0063", **environ: str) -> Environment:
    root = fake_machine(tmp_path, tpu_chips=chips, tpu_device=device, dev="vfio",
                        name=f"{device}-{chips}-{len(list(tmp_path.iterdir()))}")
    return detect({**ON_TORCH_TPU, **environ}, root=root)


def plan(env: Environment, **options):
    return make_plan(env, LaunchOptions(**options), ROOMY)


def test_a_v5e_8_plans_eight_spawned_tpu_dist_processes(tmp_path: Path) -> None:
    launch = plan(tpu(tmp_path))
    spec = launch.spec
    assert isinstance(spec, TorchTpuSpec) and isinstance(spec, ElasticSpec)  # on the engine
    assert (launch.path, launch.num_processes, launch.world_size, launch.accelerator) == (
        "torch_tpu", 8, 8, "tpu")
    assert (spec.dist_backend, spec.start_method, spec.topology, spec.loopback_only) == (
        "tpu_dist", "spawn", "2,4,1", True)
    assert launch.dist_backend == "tpu_dist"
    assert launch.summary() == "8 TPU devices through TorchTPU (tpu_dist, spawn)"
    # Four processes take TorchTPU's 2x2 sub-slice.
    assert plan(tpu(tmp_path), num_processes=4).spec.topology == "2,2,1"


@pytest.mark.parametrize(("device", "chips", "asked", "works"), [
    ("0x0063", 8, 2, "1, 4 or 8"),  # v5e: "No TPU topology found for count: 2" inside TorchTPU
    ("0x006f", 4, 8, "1 or 4"),  # more than the host has
    ("0x005e", 8, 3, "1, 2, 4 or 8"),  # v4
    ("0x0076", 8, 1, "2, 4 or 8"),  # v7: two devices per chip, no one-device layout
])
def test_counts_outside_torch_tpus_tables_are_refused_with_those_that_work(
        tmp_path: Path, device: str, chips: int, asked: int, works: str) -> None:
    with pytest.raises(ValueError, match=rf"num_processes={asked} does not fit TorchTPU.*use {works}\."):
        plan(tpu(tmp_path, chips, device), num_processes=asked)


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_only_spawn(tmp_path: Path, method: str) -> None:
    with pytest.raises(ValueError, match=rf"start_method='{method}' cannot be used with TorchTPU"):
        plan(tpu(tmp_path), start_method=method)
    assert plan(tpu(tmp_path), start_method="spawn").spec.start_method == "spawn"


def test_fp16_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mixed_precision='fp16' is not supported on TPU"):
        plan(tpu(tmp_path), mixed_precision="fp16")
    assert plan(tpu(tmp_path), mixed_precision="BF16").mixed_precision == "bf16"


def test_a_v3_forced_onto_torch_tpu_is_refused(tmp_path: Path) -> None:
    root = fake_machine(tmp_path, tpu_chips=4, tpu_device="0x0027", dev="accel")
    with pytest.raises(ValueError, match=r"TorchTPU does not run on this TPU \(v2/v3\)"):
        plan(detect(ON_TORCH_TPU, root=root))


def test_no_vfio_devices_is_refused(tmp_path: Path) -> None:
    root = fake_machine(tmp_path, tpu_chips=4, tpu_device="0x005e", dev="accel")
    with pytest.raises(ValueError, match="TorchTPU finds no TPU devices on this v4 host"):
        plan(detect(ON_TORCH_TPU, root=root))


def test_torch_xla_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"compile_cache=.*not used by the torch_tpu launch path"):
        plan(tpu(tmp_path), compile_cache="/tmp/cache")
    with pytest.raises(ValueError, match=r"master_addr=.*not used by the torch_tpu launch path"):
        plan(tpu(tmp_path), master_addr="10.0.0.2")
    assert plan(tpu(tmp_path), max_restarts=2).spec.max_restarts == 2  # the engine restarts


def test_a_pod_slice_takes_hosts_and_rank_from_gce(tmp_path: Path) -> None:
    pod = dict(TPU_WORKER_HOSTNAMES="t1v-w-0,t1v-w-1,t1v-w-2,t1v-w-3", TPU_WORKER_ID="2")
    launch = plan(tpu(tmp_path, 4, "0x006f", **pod))
    spec = launch.spec
    assert (launch.num_nodes, launch.num_processes, launch.world_size) == (4, 4, 16)
    assert (spec.node_rank, spec.master_addr, spec.loopback_only, spec.rdzv_backend) == (
        2, "t1v-w-0", False, "static")
    assert launch.notes == ("TPU slice: host 2 of 4, meeting at t1v-w-0",)
    assert not spec.port_fallback  # every host was told the same port
    assert "on host 2 of 4" in launch.summary()
    # Options that say the same are accepted; ones that disagree are refused by name.
    assert plan(tpu(tmp_path, 4, "0x006f", **pod), num_nodes=4, node_rank=2).num_nodes == 4
    with pytest.raises(ValueError, match=r"node_rank=1 disagrees with this TPU slice"):
        plan(tpu(tmp_path, 4, "0x006f", **pod), num_nodes=4, node_rank=1)
    with pytest.raises(ValueError, match="does not say which one this is"):
        plan(tpu(tmp_path, 4, "0x006f", TPU_WORKER_HOSTNAMES=pod["TPU_WORKER_HOSTNAMES"]))


def test_env_shows_the_torch_tpu_plan(tmp_path: Path) -> None:
    root = fake_machine(tmp_path, tpu_chips=4, tpu_device="0x006f", dev="vfio")
    report = env_report(ON_TORCH_TPU, root=root)
    assert report["plan"]["path"] == "torch_tpu" and report["plan"]["spec"]["topology"] == "2,2,1"
    assert report["missing"][0].startswith("torch-tpu is not installed, and the TorchTPU path "
                                           f"needs it: {torch_tpu_line()}")
    text = format_report(report)
    assert "torch_tpu (TorchTPU: torch.multiprocessing" in text
    assert "tpu_runtime             torch_tpu (not installed)" in text
    assert "TPU topology            2,2,1" in text
