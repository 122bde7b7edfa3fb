"""Plans whose TorchTPU variables the real ``set_tpu_launch_env`` computed, as a launch does.

``TORCH_TPU_TOPOLOGY`` is given as on a host (TorchTPU would read it off the PCI bus there); with
no TPU and no topology TorchTPU raises, and the caller's environment must come back as it was.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.fakes import fake_machine
from xlaunch.backends.environment import torch_tpu_layer
from xlaunch.detect import detect
from xlaunch.plan import LaunchOptions, make_plan

ROOT = Path(__file__).resolve().parents[2]


def v5e_plan(tmp_path: Path, **options):
    env = detect({}, root=fake_machine(tmp_path, tpu_chips=8, tpu_device="0x0063", dev="vfio"))
    return make_plan(env, LaunchOptions(**options))


def test_torch_tpus_own_variables_reach_the_plan(tmp_path: Path, monkeypatch) -> None:
    import torch  # noqa: F401 - imported before the launch, as in a notebook

    monkeypatch.setenv("TORCH_TPU_TOPOLOGY", "2,2,1")
    plan = v5e_plan(tmp_path, num_processes=4)
    before = dict(os.environ)
    first = torch_tpu_layer(plan, plan.spec, os.environ)
    assert dict(os.environ) == before  # computed for the workers, never left in the caller
    addresses = first["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",")
    assert len(addresses) == 4 and all(a.startswith("localhost:") for a in addresses)
    assert len(set(addresses)) == 4
    assert first["TORCH_TPU_XPROF_SESSION_ID"].isdigit()
    assert "TORCH_TPU_TOPOLOGY" not in first  # given: TorchTPU keeps it
    assert 0 < int(first["TORCH_TPU_INTERNAL_HANDSHAKE_PORT"]) < 65536
    # A second launch in the same process gets ports of its own (TorchTPU memoizes its first).
    second = torch_tpu_layer(plan, plan.spec, os.environ)
    assert second["TORCH_TPU_SLICEBUILDER_ADDRESSES"] != first["TORCH_TPU_SLICEBUILDER_ADDRESSES"]


def test_a_handshake_port_the_user_set_is_kept(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_TPU_TOPOLOGY", "2,4,1")
    monkeypatch.setenv("TORCH_TPU_INTERNAL_HANDSHAKE_PORT", "41000")
    plan = v5e_plan(tmp_path)
    assert "TORCH_TPU_INTERNAL_HANDSHAKE_PORT" not in torch_tpu_layer(plan, plan.spec, os.environ)


def test_no_tpu_and_no_topology_raises_and_restores_the_environment(tmp_path: Path,
                                                                    monkeypatch) -> None:
    monkeypatch.delenv("TORCH_TPU_TOPOLOGY", raising=False)
    plan = v5e_plan(tmp_path)
    before = dict(os.environ)
    with pytest.raises(ValueError, match="expected TPU devices, got none"):
        torch_tpu_layer(plan, plan.spec, os.environ)
    assert dict(os.environ) == before  # TorchTPU had written its slice-builder addresses


def test_a_pod_host_gets_the_slices_addresses_and_its_rank_from_gce(tmp_path: Path) -> None:
    # GCE's variables are there when the process starts (TorchTPU reads them once, in C++).
    root = fake_machine(tmp_path, tpu_chips=4, tpu_device="0x006f", dev="vfio")
    code = textwrap.dedent(f"""
        import json, os
        import torch
        from xlaunch.backends.environment import torch_tpu_layer
        from xlaunch.detect import detect
        from xlaunch.plan import make_plan
        plan = make_plan(detect(root={str(root)!r}))
        before = dict(os.environ)
        variables = torch_tpu_layer(plan, plan.spec, os.environ)
        print(json.dumps({{"vars": variables, "same": dict(os.environ) == before,
                          "summary": plan.summary()}}))
        """)
    env = {**os.environ, "TPU_WORKER_HOSTNAMES": "host-a,host-b", "TPU_WORKER_ID": "1",
           "TORCH_TPU_TOPOLOGY": "2,4,1", "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    variables = result["vars"]
    assert result["same"] and "on host 1 of 2" in result["summary"]
    assert variables["TORCH_TPU_SLICEBUILDER_ADDRESSES"].split(",") == [
        f"{host}:{8070 + i}" for host in ("host-a", "host-b") for i in range(4)]
    assert (variables["NODE_RANK"], variables["NNODES"], variables["MASTER_ADDR"]) == (
        "1", "2", "host-a")
    assert variables["TORCH_TPU_INTERNAL_HANDSHAKE_PORT"] == "36423"  # every host assumes it
