"""`detect()` over a table of fake machines, and what it must never do (import, initialise)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fakes import COLAB, KAGGLE, fake_machine
from xlaunch.detect.environment import Environment, detect


def expect(
    platform: str,
    accelerator: str,
    device_count: int,
    tpu_generation: str | None,
    tpu_chips: int,
    cores_per_chip: int,
    interactive: bool,
    legacy_tpu_node: bool,
    xla_device: str | None,
    tpu_holders: tuple = (),  # a fake machine's device files are held by nobody
    tpu_runtime: str | None = None,  # neither torch_xla nor torch-tpu installed (test_detect)
    tpu_hosts: tuple = (),
    tpu_host_index: int | None = None,
) -> Environment:
    """An Environment with every field spelled out, so no case leans on a default."""
    return Environment(platform, accelerator, device_count, tpu_generation=tpu_generation,
                       tpu_chips=tpu_chips, cores_per_chip=cores_per_chip, interactive=interactive,
                       legacy_tpu_node=legacy_tpu_node, xla_device=xla_device,
                       tpu_holders=tpu_holders, tpu_runtime=tpu_runtime, tpu_hosts=tpu_hosts,
                       tpu_host_index=tpu_host_index)


def test_expect_spells_out_every_field() -> None:
    # A field added to Environment must be added to every expectation below.
    assert list(inspect.signature(expect).parameters) == [
        f.name for f in dataclasses.fields(Environment)
    ]


V4_VM = dict(tpu_chips=4, tpu_device="0x005e", dev="accel")
V3_8 = dict(tpu_chips=4, tpu_device="0x0027", dev="accel")
T4X2 = dict(gpus=2)

MACHINES = [
    pytest.param(
        dict(tpu_chips=1, tpu_device="0x0063", dev="vfio"), COLAB,
        expect("colab", "tpu", 1, "v5e", 1, 1, True, False, "TPU"), id="colab-v5e-1"),
    pytest.param(
        dict(tpu_chips=1, tpu_device="0x006f", dev="vfio"), COLAB,
        expect("colab", "tpu", 1, "v6e", 1, 1, True, False, "TPU"), id="colab-v6e-1"),
    pytest.param(
        {}, COLAB,
        expect("colab", "cpu", 1, None, 0, 0, True, False, None), id="colab-no-accelerator"),
    pytest.param(
        V3_8, {**KAGGLE, "TPU_PROCESS_ADDRESSES": "local"},
        expect("kaggle", "tpu", 8, "v2/v3", 4, 2, True, False, "TPU"), id="kaggle-v3-8"),
    pytest.param(
        dict(tpu_chips=8, tpu_device="0x0063", dev="vfio"), KAGGLE,
        expect("kaggle", "tpu", 8, "v5e", 8, 1, True, False, "TPU"), id="kaggle-v5e-8"),
    pytest.param(
        T4X2, KAGGLE,
        expect("kaggle", "cuda", 2, None, 0, 0, True, False, None), id="kaggle-2xT4"),
    pytest.param(
        T4X2, {**KAGGLE, "KAGGLE_KERNEL_RUN_TYPE": "Batch"},
        expect("kaggle", "cuda", 2, None, 0, 0, False, False, None), id="kaggle-batch-run"),
    pytest.param(
        {}, {"KAGGLE_URL_BASE": "https://www.kaggle.com"},
        expect("kaggle", "cpu", 1, None, 0, 0, True, False, None), id="kaggle-no-run-type"),
    pytest.param(
        {**V4_VM, "gvnic": True}, {},
        expect("cloud-tpu-vm", "tpu", 4, "v4", 4, 1, False, False, "TPU"), id="tpu-vm-v4"),
    pytest.param(
        dict(tpu_chips=4, tpu_device="0x0076", dev="vfio"), {"TPU_WORKER_ID": "0"},
        expect("cloud-tpu-vm", "tpu", 4, "7x", 4, 1, False, False, "TPU"), id="tpu-vm-7x"),
    pytest.param(
        {}, {"TPU_ACCELERATOR_TYPE": "v4-8"},
        expect("cloud-tpu-vm", "cpu", 1, None, 0, 0, False, False, None),
        id="tpu-vm-variables-without-chips"),
    pytest.param(
        dict(other_vfio=2, gvnic=True), {},
        expect("local", "cpu", 1, None, 0, 0, False, False, None), id="vfio-of-another-vendor"),
    pytest.param(
        dict(tpu_chips=4, tpu_device="0x005e", dev=None), {},
        expect("local", "cpu", 1, None, 0, 0, False, False, None),
        id="tpu-on-bus-but-not-in-container"),
    pytest.param(
        {}, {}, expect("local", "cpu", 1, None, 0, 0, False, False, None), id="plain-cpu"),
    pytest.param(
        {}, {"JPY_PARENT_PID": "1234"},
        expect("local", "cpu", 1, None, 0, 0, True, False, None), id="local-jupyter"),
    pytest.param(
        T4X2, {}, expect("local", "cuda", 2, None, 0, 0, False, False, None), id="gpu-box"),
    # Legacy Colab TPU Node: a remote v2-8, no chips on the host.
    pytest.param(
        {}, {**COLAB, "COLAB_TPU_ADDR": "10.0.0.2:8470"},
        expect("colab", "tpu", 8, "v2/v3", 4, 2, True, True, "TPU"), id="legacy-tpu-node"),
    pytest.param(
        dict(tpu_chips=1, tpu_device="0x0063", dev="vfio"),
        {**COLAB, "COLAB_TPU_ADDR": "10.0.0.2:8470"},
        expect("colab", "tpu", 1, "v5e", 1, 1, True, False, "TPU"),
        id="local-chips-win-over-stale-tpu-node-address"),
    # Test ids torch_xla accepts: a TPU of unknown generation, one core per chip.
    pytest.param(
        dict(tpu_chips=2, tpu_device="0x0056", dev="accel"), {},
        expect("cloud-tpu-vm", "tpu", 2, None, 2, 1, False, False, "TPU"), id="test-id-0x0056"),
    pytest.param(
        dict(tpu_chips=4, tpu_device="0x0062", dev="vfio"), {},
        expect("cloud-tpu-vm", "tpu", 4, None, 4, 1, False, False, "TPU"), id="test-id-0x0062"),
    pytest.param(
        dict(tpu_chips=2, tpu_device="0x0042", dev="vfio"), {},
        expect("local", "cpu", 1, None, 0, 0, False, False, None), id="google-non-tpu-device-id"),
]

OVERRIDES = [
    pytest.param(
        V4_VM, {"XLAUNCH_ACCELERATOR": "cpu"},
        expect("cloud-tpu-vm", "cpu", 1, None, 0, 0, False, False, None), id="cpu-on-tpu-vm"),
    pytest.param(
        V3_8, {**KAGGLE, "XLAUNCH_ACCELERATOR": " CPU "},
        expect("kaggle", "cpu", 1, None, 0, 0, True, False, None), id="cpu-any-case"),
    pytest.param(
        {}, {**COLAB, "COLAB_TPU_ADDR": "10.0.0.2:8470", "XLAUNCH_ACCELERATOR": "cpu"},
        expect("colab", "cpu", 1, None, 0, 0, True, False, None), id="cpu-on-legacy-tpu-node"),
    pytest.param(
        {}, {"XLAUNCH_ACCELERATOR": "xla", "PJRT_DEVICE": "CPU"},
        expect("local", "cpu", 1, None, 0, 0, False, False, "CPU"), id="xla-on-cpu"),
    pytest.param(
        {}, {"XLAUNCH_ACCELERATOR": "xla", "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"},
        expect("local", "cpu", 4, None, 0, 0, False, False, "CPU"), id="xla-on-4-cpu-devices"),
    pytest.param(
        {}, {"XLAUNCH_ACCELERATOR": "xla"},
        expect("local", "cpu", 1, None, 0, 0, False, False, "CPU"), id="xla-defaults-to-cpu"),
    pytest.param(
        V4_VM, {"XLAUNCH_ACCELERATOR": "xla", "PJRT_DEVICE": "CPU"},
        expect("cloud-tpu-vm", "cpu", 1, None, 0, 0, False, False, "CPU"),
        id="xla-on-cpu-of-a-tpu-vm"),
    # XLA on a TPU is the TPU path: the chips give the layout (it used to plan 0 processes).
    pytest.param(
        V4_VM, {"XLAUNCH_ACCELERATOR": "xla", "PJRT_DEVICE": "TPU"},
        # XLAUNCH_ACCELERATOR=xla names the runtime too: torch_xla, whatever is installed.
        expect("cloud-tpu-vm", "tpu", 4, "v4", 4, 1, False, False, "TPU", tpu_runtime="torch_xla"),
        id="xla-on-tpu"),
    pytest.param(
        V4_VM, {"XLAUNCH_ACCELERATOR": "xla"},
        expect("cloud-tpu-vm", "tpu", 4, "v4", 4, 1, False, False, "TPU", tpu_runtime="torch_xla"),
        id="xla-defaults-to-tpu-like-torch-xla"),
    pytest.param(
        {}, {"XLAUNCH_ACCELERATOR": "xla", "PJRT_DEVICE": "TPU"},
        expect("local", "tpu", 0, None, 0, 0, False, False, "TPU"), id="xla-on-missing-tpu"),
    pytest.param(
        T4X2, {"XLAUNCH_ACCELERATOR": "xla", "PJRT_DEVICE": "CUDA", "GPU_NUM_DEVICES": "2"},
        expect("local", "cuda", 2, None, 0, 0, False, False, "CUDA"), id="xla-on-cuda"),
    pytest.param(
        {}, {"XLAUNCH_ACCELERATOR": "tpu"},
        expect("local", "tpu", 0, None, 0, 0, False, False, "TPU"), id="tpu-without-chips"),
    pytest.param(
        T4X2, {"XLAUNCH_ACCELERATOR": "tpu"},
        expect("local", "tpu", 0, None, 0, 0, False, False, "TPU"), id="tpu-on-gpu-box"),
    pytest.param(
        V3_8, {**KAGGLE, "XLAUNCH_ACCELERATOR": "tpu"},
        expect("kaggle", "tpu", 8, "v2/v3", 4, 2, True, False, "TPU"), id="tpu-on-tpu"),
    pytest.param(
        {}, {"XLAUNCH_ACCELERATOR": "cuda"},
        expect("local", "cuda", 0, None, 0, 0, False, False, None), id="cuda-without-gpus"),
    pytest.param(
        {**V4_VM, "gpus": 2}, {"XLAUNCH_ACCELERATOR": "cuda"},
        expect("cloud-tpu-vm", "cuda", 2, None, 0, 0, False, False, None),
        id="cuda-over-tpu"),
    pytest.param(
        T4X2, {"XLAUNCH_ACCELERATOR": ""},
        expect("local", "cuda", 2, None, 0, 0, False, False, None), id="empty-means-detect"),
]


@pytest.mark.parametrize(("machine", "environ", "expected"), MACHINES + OVERRIDES)
@pytest.mark.usefixtures("no_tpu_runtime_installed")
def test_detect(tmp_path: Path, machine: dict, environ: dict, expected: Environment) -> None:
    assert detect(environ, root=fake_machine(tmp_path, **machine)) == expected


@pytest.mark.parametrize("value", ["gpu", "TPUs", "auto", "1"])
def test_invalid_override_is_refused(tmp_path: Path, value: str) -> None:
    with pytest.raises(ValueError) as error:
        detect({"XLAUNCH_ACCELERATOR": value}, root=fake_machine(tmp_path))
    message = str(error.value)
    assert repr(value) in message and "XLAUNCH_ACCELERATOR" in message
    assert all(choice in message for choice in ("tpu", "cuda", "cpu", "xla"))


@pytest.mark.parametrize(
    ("visible", "count"),
    [
        ("0,1,2,3", 4),
        ("2", 1),
        (" 1, 3 ", 2),
        ("", 0),  # the usual way to hide every GPU
        ("-1", 0),
        ("0,-1,1", 1),  # CUDA stops at the first entry it cannot use
        ("1,7,2", 1),  # index past the last GPU
        ("0,0", 0),  # a repeated index hides every GPU
        ("1gpu,2", 2),  # parsed like strtoul
        ("GPU-0a1b,GPU-2c3d", 2),
        ("0,1,2,3,4,5", 4),
    ],
)
def test_cuda_visible_devices(tmp_path: Path, visible: str, count: int) -> None:
    env = detect({"CUDA_VISIBLE_DEVICES": visible}, root=fake_machine(tmp_path, gpus=4))
    if count:
        assert env == expect("local", "cuda", count, None, 0, 0, False, False, None)
    else:
        assert env == expect("local", "cpu", 1, None, 0, 0, False, False, None)


def test_gpus_counted_from_dev_nodes_without_proc(tmp_path: Path) -> None:
    root = fake_machine(tmp_path, gpus=2)
    for info in (root / "proc" / "driver" / "nvidia" / "gpus").iterdir():
        (info / "information").unlink()
        info.rmdir()
    (root / "proc" / "driver" / "nvidia" / "gpus").rmdir()
    assert detect({}, root=root) == expect("local", "cuda", 2, None, 0, 0, False, False, None)


def test_reads_the_given_environ_not_os_environ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    monkeypatch.setenv("XLAUNCH_ACCELERATOR", "not-a-choice")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    env = detect({}, root=fake_machine(tmp_path, gpus=1))
    assert env == expect("local", "cuda", 1, None, 0, 0, False, False, None)


def test_environment_is_plain_data(tmp_path: Path) -> None:
    env = detect(KAGGLE, root=fake_machine(tmp_path, **V3_8))
    data = env.as_dict()
    assert json.loads(json.dumps(data)) == data
    assert Environment(**data) == env
    with pytest.raises(dataclasses.FrozenInstanceError):
        env.device_count = 1  # type: ignore[misc]


def _run_python(code: str, cwd: Path) -> dict:
    """Run ``code`` in a fresh interpreter; it prints one JSON line, which is returned."""
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


# Records every attempt to import the named packages, whether or not they are installed, and
# fails any network connection: detection must do neither.
WATCH = """
    import json, socket, sys

    class Watch:
        names = ("torch", "torch_xla")
        attempts = []

        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.names:
                Watch.attempts.append(name)
            return None

    def no_network(*args, **kwargs):
        raise AssertionError("detection touched the network")

    socket.socket.connect = no_network
    socket.create_connection = no_network
"""


def test_import_and_detect_load_neither_torch_nor_torch_xla(tmp_path: Path) -> None:
    root = fake_machine(tmp_path, tpu_chips=4, tpu_device="0x0027", dev="accel")
    result = _run_python(WATCH + f"""
    sys.meta_path.insert(0, Watch())
    import xlaunch
    after_import = list(Watch.attempts)
    xlaunch.detect()
    tpu = xlaunch.detect({{"XLAUNCH_ACCELERATOR": "xla"}}, root={str(root)!r})
    print(json.dumps({{
        "after_import": after_import,
        "attempts": Watch.attempts,
        "loaded": [m for m in sys.modules if m.split(".")[0] in Watch.names],
        "tpu_chips": tpu.tpu_chips,
    }}))
    """, tmp_path)
    assert result == {"after_import": [], "attempts": [], "loaded": [], "tpu_chips": 4}


def test_detect_leaves_cuda_uninitialised_where_torch_is_imported(tmp_path: Path) -> None:
    # Detection runs in the notebook before a fork: any torch.cuda query there would either
    # initialise CUDA (fork then breaks) or, on a CPU build, hide behind a False. Record the calls.
    root = fake_machine(tmp_path, gpus=2)
    result = _run_python(WATCH + f"""
    import torch, torch.cuda
    Watch.names = ("torch_xla",)
    sys.meta_path.insert(0, Watch())
    calls = []

    def recorder(name):
        original = getattr(torch.cuda, name)
        def record(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)
        return record

    for name in ("init", "_lazy_init", "is_available", "device_count", "current_device",
                 "get_device_properties", "get_device_name", "mem_get_info"):
        setattr(torch.cuda, name, recorder(name))
    import xlaunch
    xlaunch.detect()
    gpus = xlaunch.detect({{}}, root={str(root)!r})
    print(json.dumps({{
        "cuda_calls": calls,
        "initialized": torch.cuda.is_initialized(),
        "torch_xla": [m for m in sys.modules if m.split(".")[0] == "torch_xla"] + Watch.attempts,
        "gpus": gpus.device_count,
    }}))
    """, tmp_path)
    assert result == {"cuda_calls": [], "initialized": False, "torch_xla": [], "gpus": 2}


def test_detect_reads_only_under_root(tmp_path: Path) -> None:
    root = fake_machine(tmp_path, tpu_chips=2, tpu_device="0x0063", dev="vfio", gpus=1)
    result = _run_python(f"""
    import json, sys
    from xlaunch.detect.environment import detect
    root = {str(root)!r}
    detect({{}}, root=root)  # warm up: lazy imports and the package versions (read once)
    paths = []

    def hook(event, args):
        if event in ("open", "os.listdir", "os.scandir", "glob.glob", "os.stat"):
            paths.append(str(args[0]))

    sys.addaudithook(hook)
    env = detect({{"XLAUNCH_ACCELERATOR": "tpu"}}, root=root)
    env = detect({{}}, root=root)
    print(json.dumps({{"paths": paths, "tpu_chips": env.tpu_chips}}))
    """, tmp_path)
    assert result["tpu_chips"] == 2
    assert result["paths"], "the audit hook saw no file access: the check is not working"
    outside = [p for p in result["paths"] if not p.startswith(str(root))]
    assert outside == []
