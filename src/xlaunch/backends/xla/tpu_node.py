"""Legacy TPU Nodes: a remote TPU reached over gRPC, for torch_xla 2.0 and older only."""

from __future__ import annotations

import importlib.util
import re
import socket
import time
from collections.abc import Mapping

from xlaunch.detect.runtime import installed_version

TPU_NODE_PORT_WAIT_S = 120.0


def prepare_tpu_node(environ: Mapping[str, str], xla_version: str | None = None) -> dict[str, str]:
    """Ready a legacy TPU Node for torch_xla <= 2.0; return the variables its workers need.

    A TPU Node is a remote TPU reached over gRPC (XRT). Its software must match torch_xla's, so
    the runtime version is selected with cloud-tpu-client, as torch_xla 1.x did on import.
    """
    version = xla_version or installed_version("torch_xla")
    match = re.match(r"(\d+)\.(\d+)", version or "")
    release = (int(match[1]), int(match[2])) if match else None
    if release is None or release > (2, 0) or importlib.util.find_spec("cloud_tpu_client") is None:
        found = f"torch_xla {version}" if version else "torch_xla is not installed"
        raise RuntimeError(
            "This runtime is a legacy TPU Node (COLAB_TPU_ADDR / TPU_NAME name a remote TPU; this "
            "machine has no TPU chips). TPU Nodes run only with torch_xla 2.0 or older (the XRT "
            "runtime) plus cloud-tpu-client, and Google ended them in 2025; here "
            f"{found}. The package registry no longer offers torch_xla 2.0 or older: switch to "
            "a TPU VM runtime (Colab: Runtime > Change runtime type > a v5e or v6e TPU). On an "
            "image that still has torch_xla <= 2.0 installed, add cloud-tpu-client "
            "(`pip install 'xlaunch[tpu-node]'`)."
        )
    import cloud_tpu_client

    address = environ.get("COLAB_TPU_ADDR") or environ.get("TPU_NAME", "").split("grpc://")[-1]
    remote = ":" in address
    target = f"grpc://{address}" if remote else environ.get("TPU_NAME")
    client = cloud_tpu_client.Client(tpu=target)
    client.configure_tpu_version(f"pytorch-{release[0]}.{release[1]}", restart_type="ifNeeded")
    if not remote:
        return {}
    host, port = address.rsplit(":", 1)
    _wait_for_port(host, int(port), TPU_NODE_PORT_WAIT_S)  # the runtime restarts if it changed
    return {"XRT_TPU_CONFIG": f"tpu_worker;0;{address}"}


def _wait_for_port(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as probe:
            probe.settimeout(2)
            if probe.connect_ex((host, port)) == 0:
                return
        if time.monotonic() >= deadline:
            raise RuntimeError(f"the TPU Node at {host}:{port} did not come up in {timeout:.0f} s")
        time.sleep(1)

