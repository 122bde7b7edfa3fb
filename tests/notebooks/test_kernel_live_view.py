"""The live view of the ranks in the launching cell, in a real Jupyter kernel (issue 31): one
table updated in place while the launch runs (a row per rank: state, elapsed, last line), gone
at the end when no report takes its place; ``XLAUNCH_LIVE_VIEW=0`` turns it off; a terminal
launch shows nothing of it. The first two tests failed before the live view existed (checked).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(300)

DEFINITIONS = '''
import os, time
from xlaunch import ProcessState, notebook_launcher

def work():
    rank = ProcessState().process_index
    for step in range(4):
        print(f"step {step} of rank {rank}")
        time.sleep(0.4)
'''


def live_updates(cell):
    """Every state of the cell's live view, in order (its html, or its text once cleared)."""
    return [(display_id, data) for display_id, data in cell.display_updates
            if display_id.startswith("xlaunch-live")]


def rows(html):
    """rank -> (state, elapsed, last line) of one state of the table."""
    found = re.findall(r'<tr class="xlaunch-live-rank"><td>(\d+)</td><td>(\w+)</td><td>([^<]*)'
                       r'</td><td[^>]*>([^<]*)</td></tr>', html)
    return {int(rank): (state, elapsed, last) for rank, state, elapsed, last in found}


def test_the_live_view_shows_each_ranks_state_and_last_line_then_goes(kernel):
    assert kernel.run(DEFINITIONS).status == "ok"
    cell = kernel.run("notebook_launcher(work, num_processes=2)")
    assert cell.status == "ok", cell.describe()
    updates = live_updates(cell)
    assert updates, cell.display_updates
    assert len({display_id for display_id, _ in updates}) == 1, updates  # one display
    tables = [rows(data["text/html"]) for _, data in updates if "text/html" in data]
    assert all(set(table) == {0, 1} for table in tables), tables
    seen = {table[rank][0] for table in tables for rank in (0, 1)}
    assert "running" in seen, tables
    last = tables[-1]
    for rank in (0, 1):
        state, elapsed, line = last[rank]
        assert state == "finished", tables
        assert elapsed.endswith(" s") and int(elapsed[:-2]) >= 1, last
        assert line == f"step 3 of rank {rank}", last
    assert any(table[0][2].startswith("step ") and table[0][0] == "running" for table in tables)
    # A few updates a second at most: the launch takes about two seconds.
    assert len(updates) <= 12, len(updates)
    # No report on the CPU path here: the view goes (updated to nothing) at the end.
    assert updates[-1][1] == {"text/plain": ""}, updates[-1]


def test_a_failed_rank_and_the_peer_it_stopped_show_so_then_the_view_goes(kernel):
    kernel.run(DEFINITIONS)
    cell = kernel.run('''
def fails():
    rank = ProcessState().process_index
    print(f"working on rank {rank}")
    time.sleep(1.0)
    if rank == 1:
        raise ValueError("rank 1 gives up")
    time.sleep(60)

notebook_launcher(fails, num_processes=2)
''')
    assert cell.status == "error", cell.describe()
    updates = live_updates(cell)
    tables = [rows(data["text/html"]) for _, data in updates if "text/html" in data]
    assert tables, updates
    assert tables[-1][1][0] == "failed" and tables[-1][0][0] == "stopped", tables[-1]
    assert tables[-1][0][2] == "working on rank 0", tables[-1]
    assert updates[-1][1] == {"text/plain": ""}, updates[-1]  # a failed launch: no view left


def test_the_live_view_becomes_the_report_when_the_report_shows(kernel):
    kernel.run(DEFINITIONS)
    cell = kernel.run('''
import torch

def compiles():
    print(torch.compile(lambda x: x + 1, backend="eager")(torch.ones(2)))

notebook_launcher(compiles, num_processes=2)
''')
    assert cell.status == "ok", cell.describe()
    updates = live_updates(cell)
    assert updates, cell.display_updates
    assert 'class="xlaunch-report"' in updates[-1][1].get("text/html", ""), updates[-1]
    reports = [data for data in cell.displays if 'class="xlaunch-report"' in data.get("text/html", "")]
    assert not reports, reports  # the report took the view's place: not shown twice


def test_no_live_view_when_it_is_turned_off(kernel):
    kernel.run(DEFINITIONS)
    assert live_updates(kernel.run("notebook_launcher(work, num_processes=2)"))
    cell = kernel.run('os.environ["XLAUNCH_LIVE_VIEW"] = "0"\n'
                      'try:\n    notebook_launcher(work, num_processes=2)\n'
                      'finally:\n    del os.environ["XLAUNCH_LIVE_VIEW"]')
    assert cell.status == "ok", cell.describe()
    assert not live_updates(cell), cell.display_updates
    assert "[rank 1] step 3 of rank 1\n" in cell.stdout, cell.describe()


def test_a_terminal_launch_shows_nothing_of_the_live_view(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(DEFINITIONS + "\nif __name__ == '__main__':\n"
                      "    notebook_launcher(work, num_processes=2)\n")
    env = {**os.environ, "XLAUNCH_ACCELERATOR": "cpu"}
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=env, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert "[rank 1] step 3 of rank 1" in output, output
    for trace in ("xlaunch-live", "running", "finished", "<table", "elapsed"):
        assert trace not in output, output
