"""`xlaunch check` and the launch report in a real Jupyter kernel, as a notebook user meets them.

The kernel has ``XLAUNCH_ACCELERATOR=cpu``. The check runs from the kernel's own process (its
workers are forked from the kernel, as a notebook's launch is) and as the shell command the TPU
notebooks run right after installing.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.timeout(300)


def test_check_in_the_kernel_process_passes(kernel):
    cell = kernel.run("from xlaunch.cli import main\nprint('exit status', main(['check']))")
    assert cell.status == "ok", cell.describe()
    assert "xlaunch check: ok, every step held" in cell.stdout, cell.describe()
    assert "exit status 0" in cell.stdout
    assert not kernel.children(), "the check left processes running in the kernel"


def test_check_as_a_shell_command_in_a_cell(kernel):
    cell = kernel.run("!xlaunch check")
    assert cell.status == "ok", cell.describe()
    assert "xlaunch check: ok, every step held" in cell.stdout, cell.describe()
