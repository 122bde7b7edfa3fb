"""`xlaunch env` as users run it: a real process, through ``python -m`` and the console script."""

from __future__ import annotations

import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.fakes import KAGGLE, fake_machine, xla_pin
from xlaunch.cli.env import VARIABLES, env_report, format_report
from xlaunch.detect.environment import detect
from xlaunch.detect.machine import PROCESSES_PER_CORE, Machine
from xlaunch.plan import make_plan

SCRIPT = Path(sys.executable).parent / "xlaunch"
# Variables that would steer detection away from what this machine is.
STEERING = ("XLAUNCH_ACCELERATOR", "PJRT_DEVICE", "CPU_NUM_DEVICES", "GPU_NUM_DEVICES")


@pytest.fixture(params=["python -m xlaunch", "console script"])
def xlaunch(request: pytest.FixtureRequest) -> list[str]:
    """The command line that starts xlaunch, both ways a user can."""
    if request.param == "console script":
        if not SCRIPT.exists():
            pytest.skip(f"xlaunch is not installed next to {sys.executable}")
        return [str(SCRIPT)]
    return [sys.executable, "-m", "xlaunch"]


def environ(**overrides: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in STEERING}
    env.update(overrides)
    return env


def run(command: list[str], *args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([*command, *args], env=env, capture_output=True, text=True, timeout=120)


def table(text: str) -> dict[str, dict[str, str]]:
    """The text output as {section: {key: value}}; notes are joined under "note"."""
    sections: dict[str, dict[str, str]] = {}
    rows: dict[str, str] = {}
    for line in text.splitlines():
        if not line.startswith("  "):
            rows = sections.setdefault(line.split(" (")[0], {})
            continue
        key, _, value = line.strip().partition("  ")
        if key == "note" and "note" in rows:
            value = rows["note"] + "\n" + value.strip()
        rows[key] = value.strip()
    return sections


def expected_report(env: dict[str, str]) -> dict:
    """What the command should print, from the same inputs, computed here."""
    detected = detect(env)
    try:
        plan = make_plan(detected, None, Machine.here(), env).as_dict()
        plan, refusal = json.loads(json.dumps(plan)), None
    except ValueError as error:
        plan, refusal = None, str(error)
    return {"environment": detected.as_dict(), "plan": plan, "refusal": refusal}


def test_json_is_detect_and_make_plan(xlaunch: list[str]) -> None:
    env = environ()
    result = run(xlaunch, "env", "--json", env=env)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {"environment", "machine", "plan", "refusal", "missing", "versions",
                           "variables"}
    assert report["missing"] == []
    here = Machine.here()
    machine = report["machine"]
    assert (machine["cpu_cores"], machine["memory_total"]) == (here.cores, here.memory_total)
    assert isinstance(machine["memory_available"], int) and machine["memory_available"] > 0
    assert report["versions"]["numpy"] == metadata.version("numpy")
    import torch  # here, in the test's process: the command itself imports no torch

    assert report["versions"]["cuda"] == torch.version.cuda
    assert {k: report[k] for k in ("environment", "plan", "refusal")} == expected_report(env)
    assert report["versions"]["python"] == platform.python_version()
    assert report["versions"]["torch"] == metadata.version("torch")
    assert report["versions"]["xlaunch"] == metadata.version("xlaunch")
    assert set(report["versions"]) >= {"torch_xla", "libtpu", "os"}
    assert report["variables"] == {k: env[k] for k in VARIABLES if k in env}


def test_table_shows_environment_plan_and_versions(xlaunch: list[str]) -> None:
    env = environ(XLAUNCH_ACCELERATOR="cpu")
    result = run(xlaunch, "env", env=env)
    assert result.returncode == 0, result.stderr
    shown = table(result.stdout)
    assert list(shown) == ["environment", "machine", "launch", "versions", "variables"]
    here = Machine.here()
    assert shown["machine"]["cpu cores"] == str(here.cores)
    assert re.fullmatch(rf"\d+ MiB available, {here.memory_total >> 20} MiB in all",
                        shown["machine"]["memory"]), shown["machine"]
    assert shown["versions"]["numpy"] == metadata.version("numpy")
    expected = expected_report(env)
    for field, value in expected["environment"].items():
        if field == "tpu_holders":
            assert shown["environment"][field] == "none" and value == []
            continue
        assert shown["environment"][field] == (
            "-" if value is None else str(value).lower() if isinstance(value, bool) else str(value)
        )
    plan = expected["plan"]
    launch = shown["launch"]
    assert launch["path"].split()[0] == plan["path"] == "inline"
    assert launch["processes"] == str(plan["num_processes"]) == "1"
    assert launch["world size"] == "1" and plan["spec"] == {}
    assert launch["note"] == "\n".join(plan["notes"]) and "no TPU or GPU" in launch["note"]
    assert shown["versions"]["python"] == platform.python_version()
    assert shown["versions"]["torch"] == metadata.version("torch")
    assert shown["variables"]["XLAUNCH_ACCELERATOR"] == "cpu"


def test_xla_on_cpu(xlaunch: list[str]) -> None:
    env = environ(XLAUNCH_ACCELERATOR="xla", PJRT_DEVICE="CPU")
    report = json.loads(run(xlaunch, "env", "--json", env=env).stdout)
    assert report["environment"]["xla_device"] == "CPU"
    assert report["environment"]["accelerator"] == "cpu"
    plan = report["plan"]
    assert (plan["path"], plan["num_processes"], plan["spec"]["threads_per_process"],
            plan["world_size"], plan["dist_backend"]) == ("xla", 1, 1, 1, "xla")
    assert plan["spec"]["pjrt_device"] == "CPU"
    assert report["refusal"] is None

    result = run(xlaunch, "env", env=env)
    assert result.returncode == 0, result.stderr
    shown = table(result.stdout)
    assert shown["environment"]["xla_device"] == "CPU"
    assert shown["launch"]["path"] == "xla (torch_xla xmp.spawn)"
    assert shown["launch"]["distributed backend"] == "xla"
    assert shown["variables"] == {"XLAUNCH_ACCELERATOR": "xla", "PJRT_DEVICE": "CPU"} | {
        k: env[k] for k in VARIABLES if k in env and k not in STEERING
    }


def test_tpu_refusal_is_shown_not_raised_and_exits_2(xlaunch: list[str]) -> None:
    if detect({}).tpu_chips:
        pytest.skip("this machine has TPU chips: XLAUNCH_ACCELERATOR=tpu is not refused here")
    env = environ(XLAUNCH_ACCELERATOR="tpu")
    result = run(xlaunch, "env", "--json", env=env)
    assert result.returncode == 2, result.stderr
    report = json.loads(result.stdout)
    assert report["environment"]["accelerator"] == "tpu"
    assert report["environment"]["device_count"] == 0
    assert report["plan"] is None
    assert "no TPU chips" in report["refusal"]

    result = run(xlaunch, "env", env=env)
    assert result.returncode == 2, result.stderr
    shown = table(result.stdout)
    assert shown["launch"] == {"refused": report["refusal"]}
    assert shown["environment"]["accelerator"] == "tpu"
    assert "Traceback" not in result.stdout + result.stderr


def test_invalid_override_is_an_error_with_versions(xlaunch: list[str]) -> None:
    env = environ(XLAUNCH_ACCELERATOR="gpu")
    result = run(xlaunch, "env", "--json", env=env)
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["environment"] is None and report["plan"] is None
    assert "'gpu'" in report["refusal"]
    assert report["versions"]["python"] == platform.python_version()

    result = run(xlaunch, "env", env=env)
    assert result.returncode == 1
    shown = table(result.stdout)
    assert "'gpu'" in shown["environment"]["error"]
    assert "Traceback" not in result.stderr


def test_no_command_prints_usage(xlaunch: list[str]) -> None:
    result = run(xlaunch, env=environ())
    assert result.returncode == 2
    assert "usage: xlaunch" in result.stderr
    result = run(xlaunch, "--help", env=environ())
    assert result.returncode == 0 and re.search(r"^\s+env\s", result.stdout, re.MULTILINE)


def test_env_imports_neither_torch_nor_torch_xla(tmp_path: Path) -> None:
    code = """
import json, sys

class Watch:
    attempts = []

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "torch_xla"):
            Watch.attempts.append(name)

sys.meta_path.insert(0, Watch())
from xlaunch.cli import main
code = main(["env"]) + main(["env", "--json"])
print(json.dumps({"attempts": Watch.attempts, "code": code}), file=sys.stderr)
"""
    result = subprocess.run([sys.executable, "-c", code], env=environ(), cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stderr.strip().splitlines()[-1]) == {"attempts": [], "code": 0}


def test_table_for_a_kaggle_tpu(tmp_path: Path) -> None:
    # The CLI reads this machine; the report it prints is checked on a fake Kaggle v3-8 here.
    root = fake_machine(tmp_path, tpu_chips=4, tpu_device="0x0027", dev="accel")
    report = env_report({**KAGGLE, "TPU_PROCESS_ADDRESSES": "local"}, root=root)
    assert report["refusal"] is None
    shown = table(format_report(report))
    assert shown["environment"]["platform"] == "kaggle"
    assert shown["environment"]["tpu_generation"] == "v2/v3"
    launch = shown["launch"]
    assert (launch["path"], launch["processes"], launch["threads per process"],
            launch["world size"]) == ("xla (torch_xla xmp.spawn)", "4", "2", "8")
    assert launch["worker environment"].split() == ["-TPU_PROCESS_ADDRESSES", "-CLOUD_TPU_TASK_ID"]
    assert shown["variables"] == {"TPU_PROCESS_ADDRESSES": "local",
                                  "KAGGLE_KERNEL_RUN_TYPE": "Interactive"}


@pytest.mark.skipif(importlib.util.find_spec("torch_xla") is not None,
                    reason="torch_xla is installed here")
def test_a_missing_torch_xla_is_named_with_the_line_that_installs_it(
        xlaunch: list[str], tmp_path: Path) -> None:
    env = environ(XLAUNCH_ACCELERATOR="xla", PJRT_DEVICE="CPU")
    report = json.loads(run(xlaunch, "env", "--json", env=env).stdout)
    assert report["missing"] and f'torch_xla[tpu]=={xla_pin()}"' in report["missing"][0]
    assert "missing" in run(xlaunch, "env", env=env).stdout
    script = tmp_path / "train.py"
    script.write_text("open('ran', 'w').close()\n")
    result = run(xlaunch, "run", str(script), env=env)
    assert result.returncode == 1 and "No module named 'torch_xla'" in result.stderr
    assert f'torch_xla[tpu]=={xla_pin()}"' in result.stderr and not (tmp_path / "ran").exists()


def test_env_shows_the_launch_the_options_ask_for(xlaunch: list[str]) -> None:
    env = environ(XLAUNCH_ACCELERATOR="cpu")
    result = run(xlaunch, "env", "--json", "--num-processes", "2", "--mixed-precision", "BF16",
                 "--start-method", "spawn", env=env)
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)["plan"]
    assert (plan["path"], plan["num_processes"], plan["mixed_precision"]) == ("elastic", 2, "bf16")
    assert plan["spec"]["start_method"] == "spawn"
    refused = run(xlaunch, "env", "--num-processes", "0", env=env)
    assert "num_processes must be a whole number of at least 1" in refused.stdout
    assert refused.returncode == 2
    clash = run(xlaunch, "env", "--num-processes", "2", "--num_processes", "4", env=env)
    assert clash.returncode == 2 and "not both" in clash.stderr


def test_a_launch_that_would_be_refused_exits_2_with_the_table_and_the_figures_it_quotes(
        xlaunch: list[str]) -> None:
    # More CPU processes than this machine's cores can run: the refusal quotes the core count,
    # and the machine section shows the same figure; the whole table is printed all the same.
    cores = Machine.here().cores
    too_many = str(PROCESSES_PER_CORE * cores + 1)
    result = run(xlaunch, "env", "--num-processes", too_many, env=environ(XLAUNCH_ACCELERATOR="cpu"))
    assert result.returncode == 2, result.stdout + result.stderr
    shown = table(result.stdout)
    assert list(shown) == ["environment", "machine", "launch", "versions", "variables"]
    refusal = shown["launch"]["refused"]
    assert f"num_processes={too_many} CPU processes on {cores} core(s)" in refusal, refusal
    assert shown["machine"]["cpu cores"] == str(cores)
    assert "Traceback" not in result.stderr
    runnable = run(xlaunch, "env", "--num-processes", "2", env=environ(XLAUNCH_ACCELERATOR="cpu"))
    assert runnable.returncode == 0, runnable.stdout + runnable.stderr


def test_the_port_row_says_whether_a_taken_port_would_be_replaced(xlaunch: list[str]) -> None:
    env = environ(XLAUNCH_ACCELERATOR="cpu")
    left = json.loads(run(xlaunch, "env", "--json", "--num-processes", "2", env=env).stdout)
    named = json.loads(run(xlaunch, "env", "--json", "--num-processes", "2", "--master-port",
                           "29500", env=env).stdout)
    assert left["plan"]["spec"]["port_fallback"] is True
    assert named["plan"]["spec"]["port_fallback"] is False and named["plan"]["spec"]["port"] == 29500


def test_gpus_are_named_from_the_driver_files(tmp_path: Path) -> None:
    root = fake_machine(tmp_path, gpus=2)
    (root / "proc" / "driver" / "nvidia" / "version").write_text(
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar  5 22:23:56 UTC 2024\n"
        "GCC version:  gcc version 12.2.0\n")
    report = env_report({}, root=root)
    assert report["machine"]["gpus"] == ["Tesla T4", "Tesla T4"]
    assert report["machine"]["nvidia_driver"] == "550.54.15"
    shown = table(format_report(report))
    assert shown["machine"]["gpus"] == "2 x Tesla T4"
    assert shown["machine"]["nvidia driver"] == "550.54.15"
    assert shown["environment"]["accelerator"] == "cuda"
    assert table(format_report(env_report({}, root=fake_machine(tmp_path / "cpu"))))[
        "machine"]["gpus"] == "none"


def test_cuda_and_nccl_are_read_without_importing_torch(tmp_path: Path) -> None:
    # A CUDA build of torch as installed (its version.py, and the NCCL package its wheel pulls),
    # on a path ahead of this venv's own torch: `xlaunch env` reads both files, imports nothing.
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "version.py").write_text(
        "from typing import Optional\n__version__ = '2.15.0+cu128'\ncuda: Optional[str] = '12.8'\n")
    for name, version in (("torch", "2.15.0+cu128"), ("nvidia_nccl_cu12", "2.27.5")):
        info = site / f"{name}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    code = ("import json, sys\nfrom xlaunch.cli.env import env_report\nreport = env_report()\n"
            "print(json.dumps([report['versions'], 'torch' in sys.modules]))")
    env = environ(XLAUNCH_ACCELERATOR="cpu",
                  PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    versions, imported = json.loads(result.stdout)
    assert (versions["torch"], versions["cuda"], versions["nccl"]) == ("2.15.0+cu128", "12.8", "2.27.5")
    assert not imported
    shown = subprocess.run([sys.executable, "-m", "xlaunch", "env"], env=env, cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert table(shown.stdout)["versions"]["cuda"] == "12.8", shown.stdout + shown.stderr
    assert table(shown.stdout)["versions"]["nccl"] == "2.27.5"


def test_cuda_and_nccl_come_from_torch_when_it_is_already_imported(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    from xlaunch.cli.env import cuda_versions

    fake = types.SimpleNamespace(
        version=types.SimpleNamespace(cuda="12.8"),
        cuda=types.SimpleNamespace(nccl=types.SimpleNamespace(version=lambda: (2, 27, 5))))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert cuda_versions() == {"cuda": "12.8", "nccl": "2.27.5"}
    fake.version.cuda = None  # a CPU build: neither
    assert cuda_versions() == {"cuda": None, "nccl": None}


def test_the_table_leaves_out_cuda_and_nccl_on_a_cpu_build() -> None:
    report = env_report(environ(XLAUNCH_ACCELERATOR="cpu"))
    report["versions"].update(cuda=None, nccl=None)
    assert {"cuda", "nccl"}.isdisjoint(table(format_report(report))["versions"])


PURE = r"""
import sys
seen = []
def audit(event, args):
    writing = event == "open" and (args[1] or "r") not in ("r", "rb") and not str(args[0]).startswith("/dev/")
    if event in ("socket.bind", "socket.connect", "subprocess.Popen", "os.fork", "os.posix_spawn",
                 "os.mkdir", "os.remove", "os.rename") or writing:
        seen.append((event, str(args[:2])))
from xlaunch.cli.env import env_report
from xlaunch.detect import detect
from xlaunch.plan import LaunchOptions, make_plan
sys.addaudithook(audit)
spmd = sys.argv[1:] == ["spmd"]
for options in ((LaunchOptions(spmd=True),) if spmd else (
        LaunchOptions(), LaunchOptions(num_processes=2),
        LaunchOptions(num_processes=2, use_port="29511", start_method="spawn"),
        LaunchOptions(num_processes=2, num_nodes=2, node_rank=1, master_addr="10.1.2.3"))):
    make_plan(detect(), options)
    env_report(options=options)
print(seen)
"""


@pytest.mark.parametrize("which, steering", [
    ("every path", {"XLAUNCH_ACCELERATOR": "cpu"}),
    ("spmd", {"XLAUNCH_ACCELERATOR": "xla", "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "4"}),
])
def test_planning_binds_no_socket_starts_no_process_writes_no_file(which, steering) -> None:
    # An audit hook (PEP 578) sees every bind, fork, spawn and write the planner would make.
    result = subprocess.run([sys.executable, "-c", PURE, which], capture_output=True, text=True,
                            env=environ(**steering), timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_env_shows_what_this_process_already_did(tmp_path) -> None:
    """Autograd's threads, CUDA and the XLA runtime started before a launch decide how it may
    start its workers: `xlaunch env` shows each fact the plan was given."""
    report = env_report({}, root=fake_machine(tmp_path))
    facts = {key: report["machine"][key] for key in
             ("autograd_threads", "cuda_initialised", "xla_runtime_initialised")}
    assert facts == {"autograd_threads": False, "cuda_initialised": False,
                     "xla_runtime_initialised": False}
    text = format_report(report)
    for row in ("autograd threads", "CUDA started", "XLA runtime"):
        assert re.search(rf"\n  {row}\s+no, in this process\n", text), row
