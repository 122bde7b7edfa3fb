"""TPU layouts on fake machines: processes, threads, each worker's variables, and refusals.

Runs without torch_xla: the layout is decided from `detect()` alone, before anything starts.
The legacy TPU Node path is here too, because it must refuse (or configure the remote TPU)
before the XLA backend imports anything.
"""

from __future__ import annotations

import http.server
import importlib.util
import socket
import threading
from pathlib import Path
from typing import Any

import pytest

from tests.fakes import COLAB, KAGGLE, fake_machine
from xlaunch.backends import xla as xla_backend
from xlaunch.backends.xla import tpu_node
from xlaunch.detect.environment import detect
from xlaunch.plan import XlaSpec, make_plan
from xlaunch.plan.options import LaunchOptions
from xlaunch.plan.tpu_layout import KAGGLE_PRESETS, ONE_CHIP, TpuLayout, tpu_layout

V3_8 = dict(tpu_chips=4, tpu_device="0x0027", dev="accel")  # Kaggle's TPU: 4 chips x 2 cores
V5E_8 = dict(tpu_chips=8, tpu_device="0x0063", dev="vfio")
V5E_1 = dict(tpu_chips=1, tpu_device="0x0063", dev="vfio")  # Colab's TPU today
KAGGLE_TPU = {**KAGGLE, "TPU_PROCESS_ADDRESSES": "local", "CLOUD_TPU_TASK_ID": "0"}


@pytest.mark.parametrize("environ", [{}, KAGGLE_TPU], ids=["plain", "kaggle-presets"])
@pytest.mark.parametrize("machine, num_processes, expected", [
    # every core: one process per chip, one thread per core; Kaggle's single-process presets go
    (V3_8, None, TpuLayout(4, 2, unset_env=KAGGLE_PRESETS)),
    (V3_8, 8, TpuLayout(4, 2, unset_env=KAGGLE_PRESETS)),
    (V5E_8, None, TpuLayout(8, 1, unset_env=KAGGLE_PRESETS)),
    (V5E_8, 8, TpuLayout(8, 1, unset_env=KAGGLE_PRESETS)),
    # one process: nothing to unset, a single process is what the presets describe
    (V5E_1, None, TpuLayout(1, 1)),
    (V5E_1, 1, TpuLayout(1, 1)),
    # one replica of several: xmp.spawn(nprocs=1), which pins chip 0 itself
    (V3_8, 1, TpuLayout(1, 1, nprocs=1)),
    (V5E_8, 1, TpuLayout(1, 1, nprocs=1)),
])
def test_layouts(tmp_path: Path, environ: dict[str, str], machine: dict[str, Any],
                 num_processes: int | None, expected: TpuLayout) -> None:
    env = detect(environ, root=fake_machine(tmp_path, **machine))
    assert tpu_layout(env, num_processes) == expected
    plan = make_plan(env, LaunchOptions(num_processes=num_processes))
    spec = plan.spec
    assert isinstance(spec, XlaSpec)
    assert (plan.path, plan.dist_backend, spec.start_method) == ("xla", "xla", "fork")
    assert (plan.num_processes, spec.threads_per_process) == (expected.processes,
                                                              expected.threads_per_process)
    assert plan.world_size == expected.replicas
    assert (dict(spec.worker_env), spec.unset_env, spec.nprocs) == (
        dict(expected.env), expected.unset_env, expected.nprocs)


def test_one_chip_with_both_cores_on_v3(tmp_path: Path) -> None:
    """2 on a v3-8: one process on chip 0 (TPU_PROCESS_BOUNDS=1,1,1), a thread per core."""
    env = detect(KAGGLE_TPU, root=fake_machine(tmp_path, **V3_8))
    layout = tpu_layout(env, 2)
    assert (layout.processes, layout.threads_per_process, layout.replicas) == (1, 2, 2)
    assert dict(layout.env) == ONE_CHIP == {
        "TPU_VISIBLE_CHIPS": "0", "TPU_PROCESS_BOUNDS": "1,1,1",
        "TPU_CHIPS_PER_PROCESS_BOUNDS": "1,1,1"}
    assert layout.unset_env == () and layout.nprocs is None
    assert "chip 0" in layout.notes[0]
    assert make_plan(env, LaunchOptions(num_processes=2)).world_size == 2


@pytest.mark.parametrize("machine, num_processes, valid, invalid", [
    (V3_8, 3, ["None or 8 (every core)", "1 (one core)", "2 (one chip, all its cores)"], []),
    (V3_8, 4, ["None or 8", "2 (one chip"], []),
    (V3_8, 16, ["None or 8"], []),
    (V5E_8, 2, ["None or 8 (every core)", "1 (one core)"], ["(one chip"]),
    (V5E_8, 4, ["None or 8", "1 (one core)"], ["(one chip"]),
    (V5E_1, 2, ["None or 1 (every core)"], []),
])
def test_refusals_name_the_values_that_work(tmp_path: Path, machine: dict[str, Any],
                                            num_processes: int, valid: list[str],
                                            invalid: list[str]) -> None:
    env = detect({}, root=fake_machine(tmp_path, **machine))
    with pytest.raises(ValueError) as refused:
        make_plan(env, LaunchOptions(num_processes=num_processes))
    message = str(refused.value)
    assert f"num_processes={num_processes}" in message
    assert f"{env.tpu_chips} chip(s) x {env.cores_per_chip} core(s)" in message
    for text in valid:
        assert text in message
    for text in invalid:
        assert text not in message


def test_tpu_asked_for_without_chips(tmp_path: Path) -> None:
    env = detect({"XLAUNCH_ACCELERATOR": "tpu"}, root=fake_machine(tmp_path))
    with pytest.raises(ValueError, match="no TPU chips"):
        tpu_layout(env, None)


@pytest.mark.parametrize("num_processes, expected", [
    (None, TpuLayout(1, 4)),  # PJRT's CPU client: one process, a thread per device
    (4, TpuLayout(1, 4)),
    (1, TpuLayout(1, 1, nprocs=1)),
])
def test_xla_on_cpu_devices(tmp_path: Path, num_processes: int | None,
                            expected: TpuLayout) -> None:
    environ = {"XLAUNCH_ACCELERATOR": "xla", "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}
    env = detect(environ, root=fake_machine(tmp_path))
    assert tpu_layout(env, num_processes) == expected
    with pytest.raises(ValueError, match=r"num_processes=2 .*CPU, 4 device.*None or 4"):
        tpu_layout(env, 2)


def test_xla_on_gpus_is_a_process_per_gpu(tmp_path: Path) -> None:
    environ = {"XLAUNCH_ACCELERATOR": "xla", "PJRT_DEVICE": "CUDA", "GPU_NUM_DEVICES": "2"}
    env = detect(environ, root=fake_machine(tmp_path, gpus=2))
    assert tpu_layout(env, None) == TpuLayout(2, 1)


# --- legacy TPU Node ---------------------------------------------------------------------------

TPU_NODE = {**COLAB, "COLAB_TPU_ADDR": "10.0.0.2:8470", "TPU_NAME": "grpc://10.0.0.2:8470"}


def test_tpu_node_plan(tmp_path: Path) -> None:
    env = detect(TPU_NODE, root=fake_machine(tmp_path))
    assert env.legacy_tpu_node
    plan = make_plan(env)
    assert plan.spec.legacy_tpu_node and (plan.num_processes, plan.world_size) == (8, 8)
    assert make_plan(env, LaunchOptions(num_processes=1)).spec.nprocs == 1


def test_tpu_node_launch_refused_before_anything_starts(tmp_path: Path) -> None:
    plan = make_plan(detect(TPU_NODE, root=fake_machine(tmp_path)))
    started = []
    with pytest.raises(RuntimeError) as refused:
        xla_backend.launch(plan, plan.spec, started.append, (1,))
    assert started == []
    message = str(refused.value)
    assert "legacy TPU Node" in message and "torch_xla 2.0 or older" in message
    assert "2025" in message and "TPU VM" in message


@pytest.mark.parametrize("version", ["2.9.0", "2.1.0+libtpu", None])
def test_tpu_node_needs_torch_xla_2_0_or_older(version: str | None) -> None:
    with pytest.raises(RuntimeError, match="torch_xla 2.0 or older"):
        tpu_node.prepare_tpu_node(TPU_NODE, xla_version=version or "")


@pytest.mark.skipif(importlib.util.find_spec("cloud_tpu_client") is not None,
                    reason="cloud-tpu-client is installed here")
def test_tpu_node_needs_cloud_tpu_client() -> None:
    with pytest.raises(RuntimeError, match="cloud-tpu-client"):
        tpu_node.prepare_tpu_node(TPU_NODE, xla_version="1.13.0")


class _VersionSwitcher(http.server.BaseHTTPRequestHandler):
    """Stands in for the TPU Node's runtime-version endpoint (port 8475 of the TPU)."""

    requests: list[tuple[str, str]] = []

    def do_POST(self) -> None:  # http.server's naming
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        type(self).requests.append(("POST", self.path))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_tpu_node_runtime_version_configured_with_cloud_tpu_client() -> None:
    """Against a loopback stub: the client posts the version to <TPU address>:8475."""
    pytest.importorskip("cloud_tpu_client")
    try:
        server = http.server.HTTPServer(("127.0.0.1", 8475), _VersionSwitcher)
    except OSError:
        pytest.skip("port 8475 on 127.0.0.1 is taken")
    grpc = socket.socket()  # the TPU's gRPC port, which the launch waits for
    grpc.bind(("127.0.0.1", 0))
    grpc.listen()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        address = f"127.0.0.1:{grpc.getsockname()[1]}"
        env = tpu_node.prepare_tpu_node({"COLAB_TPU_ADDR": address}, xla_version="1.13.0")
    finally:
        server.shutdown()
        server.server_close()
        grpc.close()
        thread.join(timeout=10)
    assert env == {"XRT_TPU_CONFIG": f"tpu_worker;0;{address}"}
    assert _VersionSwitcher.requests == [
        ("POST", "/requestversion/pytorch-1.13?restartType=ifNeeded")]
