"""Fixtures of the notebook tier: real Jupyter kernels of this interpreter, isolated.

Every kernel runs ``sys.executable`` through a kernelspec written to a temporary directory (found
through ``JUPYTER_PATH``), so the tests use the venv that runs pytest whatever kernels the machine
has registered. The kernel's environment marks it as a test run (``XLAUNCH_NOTEBOOK_CI=1``: the
notebooks skip ``pip install``), forces the CPU path (``XLAUNCH_ACCELERATOR=cpu``), and puts this
venv's ``bin`` first on ``PATH`` so that ``!xlaunch env`` finds the installed command.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from nbkernel import KERNEL_NAME, Kernel

from tests.kernels import kernel_environment


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).parent == Path(__file__).parent:
            item.add_marker(pytest.mark.notebook)


@pytest.fixture(scope="session")
def kernel_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """Register this interpreter's kernel under a private name; the environment kernels get."""
    with kernel_environment(tmp_path_factory, KERNEL_NAME, "xlaunch tests",
                            XLAUNCH_ACCELERATOR="cpu") as env:
        yield env


@pytest.fixture(scope="module")
def kernel(kernel_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kernel]:
    """One kernel for a whole test module, as one notebook session; nothing may outlive it."""
    started = Kernel(kernel_env, tmp_path_factory.mktemp("kernel-cwd"))
    yield started
    leftovers = [process.pid for process in started.shutdown()]
    assert not leftovers, f"processes outlived their kernel (killed now): {leftovers}"
