"""The core tier tests the CPU path, on any machine: on one with GPUs too.

A core test that launches "2 processes" means 2 CPU processes over gloo. On a machine with GPUs
detection would pick the GPU path instead (NCCL, one process per GPU, more processes than GPUs
refused), so every test directly under tests/ runs with ``XLAUNCH_ACCELERATOR=cpu`` set (the same
choice the subprocess tests make for the commands they run). A test that means to launch on
whatever this machine has opts out with ``@pytest.mark.any_accelerator``. The tiers in tests/xla,
tests/torch_tpu and tests/notebooks steer their own accelerator and are left alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _the_cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if Path(request.node.path).resolve().parent != CORE:
        return
    if request.node.get_closest_marker("any_accelerator") is None:
        monkeypatch.setenv("XLAUNCH_ACCELERATOR", "cpu")


@pytest.fixture
def no_tpu_runtime_installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packages as the core tier's own venv has them: torch, and no torch_xla, torch-tpu or
    libtpu. A test that describes such a machine asks for this: the notebooks' Pythons run the
    core tests in a venv that holds torch_xla too, as Colab's and Kaggle's TPU runtimes do."""
    from xlaunch.detect import runtime

    none = {"torch_xla": None, "torch-tpu": None, "libtpu": None}
    versions = tuple({**dict(runtime._installed()), **none}.items())
    monkeypatch.setattr(runtime, "_installed", lambda: versions)
