"""Fixtures of the notebook tier: real Jupyter kernels of this interpreter, isolated.

Every kernel runs ``sys.executable`` through a kernelspec written to a temporary directory (found
through ``JUPYTER_PATH``), so the tests use the venv that runs pytest whatever kernels the machine
has registered. The kernel's environment marks it as a test run (``XLAUNCH_NOTEBOOK_CI=1``: the
notebooks skip ``pip install``), forces the CPU path (``XLAUNCH_ACCELERATOR=cpu``), and puts this
venv's ``bin`` first on ``PATH`` so that ``!xlaunch env`` finds the installed command.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from nbkernel import KERNEL_NAME, Kernel


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.notebook)


@pytest.fixture(scope="session")
def kernel_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Register this interpreter's kernel under a private name; the environment kernels get."""
    jupyter_dir = tmp_path_factory.mktemp("jupyter")
    spec_dir = jupyter_dir / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "xlaunch tests",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec))
    saved = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(jupyter_dir), saved]))
    bin_dir = os.path.dirname(sys.executable)
    env = dict(
        os.environ,
        XLAUNCH_NOTEBOOK_CI="1",
        XLAUNCH_ACCELERATOR="cpu",
        PATH=os.pathsep.join([bin_dir, os.environ.get("PATH", "")]),
        IPYTHONDIR=str(tmp_path_factory.mktemp("ipython")),  # no shared history database
        JUPYTER_RUNTIME_DIR=str(tmp_path_factory.mktemp("runtime")),
        PYDEVD_DISABLE_FILE_VALIDATION="1",
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


@pytest.fixture(scope="module")
def kernel(kernel_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    """One kernel for a whole test module, as one notebook session; nothing may outlive it."""
    started = Kernel(kernel_env, tmp_path_factory.mktemp("kernel-cwd"))
    yield started
    leftovers = [process.pid for process in started.shutdown()]
    assert not leftovers, f"processes outlived their kernel (killed now): {leftovers}"
