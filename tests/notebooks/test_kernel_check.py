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


REPORTED = '''
from xlaunch import LaunchTimeout, ProcessState, notebook_launcher

def rank_of():
    return ProcessState().process_index

def compiled_rank():
    import torch

    model = torch.compile(torch.nn.Linear(4, 1), backend="eager")
    model(torch.randn(2, 4)).sum().backward()
    return ProcessState().process_index

def sleeps():
    import time

    time.sleep(120)
'''


def test_a_cpu_launch_with_nothing_to_say_displays_no_report(kernel):
    assert kernel.run(REPORTED).status == "ok"
    cell = kernel.run("notebook_launcher(rank_of, num_processes=2)")
    assert cell.status == "ok", cell.describe()
    assert not cell.shown, cell.describe()  # no table of dashes after a plain CPU launch
    assert cell.results == ["0"]
    # Still kept, and its text/plain is the summary, not the dataclass's fields.
    shown = kernel.run("import xlaunch\nxlaunch.last_report()")
    assert shown.results[0].startswith("xlaunch report: elastic launch, 2 rank(s) reported"), shown.describe()


def test_a_launch_with_torch_compile_counters_displays_the_table_with_a_row_per_rank(kernel):
    assert kernel.run(REPORTED).status == "ok"
    cell = kernel.run("notebook_launcher(compiled_rank, num_processes=2)")
    assert cell.status == "ok", cell.describe()
    html = [data["text/html"] for data in cell.shown if "text/html" in data]
    assert len(html) == 1, cell.describe()
    table = html[0]
    assert table.count('<tr class="xlaunch-rank">') == 2, table
    assert "<td>0</td>" in table and "<td>1</td>" in table
    assert "1 graph(s), 0 break(s)" in table  # what torch.compile did in each rank
    assert "peak memory" in table and 'class="xlaunch-memory-bar"' in table  # the machine's memory
    plain = [data["text/plain"] for data in cell.shown if "text/html" in data][0]
    assert plain.startswith("xlaunch report: elastic launch, 2 rank(s) reported"), plain
    assert "RankReport(" not in plain


def test_a_timeout_displays_no_empty_table(kernel):
    assert kernel.run(REPORTED).status == "ok"
    cell = kernel.run("notebook_launcher(sleeps, num_processes=2, timeout=3)")
    assert cell.status == "error" and cell.error["ename"] == "LaunchTimeout", cell.describe()
    assert not cell.shown, cell.describe()


def test_report_false_displays_nothing(kernel):
    assert kernel.run(REPORTED).status == "ok"
    cell = kernel.run("notebook_launcher(compiled_rank, num_processes=2, report=False)")
    assert cell.status == "ok", cell.describe()
    assert not cell.shown, cell.describe()
