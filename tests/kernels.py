"""A Jupyter kernel of this interpreter, registered privately, with the environment tests give it.

Both notebook tiers use it: the core tier's kernels (torch, the CPU path) and the torch_xla tier's
(the XLA path on the CPU device). The kernelspec lives in a temporary directory found through
``JUPYTER_PATH``, so the tests use the venv running pytest whatever kernels the machine has.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def kernel_environment(tmp_path_factory: pytest.TempPathFactory, kernel_name: str,
                       display_name: str, **overrides: str) -> Iterator[dict[str, str]]:
    """Register ``kernel_name``; yield the environment its kernels get (``overrides`` on top)."""
    jupyter_dir = tmp_path_factory.mktemp("jupyter")
    spec_dir = jupyter_dir / "kernels" / kernel_name
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": display_name, "language": "python"}))
    saved = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(jupyter_dir), saved]))
    env = dict(
        os.environ,
        XLAUNCH_NOTEBOOK_CI="1",  # the notebooks' install cells skip pip
        # this venv's bin first, so that `!xlaunch env` finds the installed command
        PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]),
        IPYTHONDIR=str(tmp_path_factory.mktemp("ipython")),  # no shared history database
        JUPYTER_RUNTIME_DIR=str(tmp_path_factory.mktemp("runtime")),
        PYDEVD_DISABLE_FILE_VALIDATION="1",
        **overrides,
    )
    for name in ("JPY_PARENT_PID", "JPY_SESSION_NAME"):
        env.pop(name, None)
    try:
        yield env
    finally:
        if saved is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = saved
