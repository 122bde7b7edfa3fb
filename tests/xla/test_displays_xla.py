"""What an XLA replica displays reaches the launching cell, in a real Jupyter kernel (issue 31).

``xmp.spawn`` forks the replicas from the kernel (from the launch thread, or from a launch
leader); a forked process may not use the kernel's sockets, so the launch's caller publishes what
each replica displays, as on the GPU/CPU path (tests/notebooks/test_kernel_displays.py). The
notebook is run by nbclient with ``store_widget_state=True``: the saved widget state is what a
frontend shows. Failed before the XLA path relayed displays (no bar at all: checked).
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernels import kernel_environment

pytestmark = [
    pytest.mark.xla,
    pytest.mark.notebook,
    pytest.mark.timeout(600),
    pytest.mark.skipif(importlib.util.find_spec("torch_xla") is None
                       or importlib.util.find_spec("nbclient") is None
                       or importlib.util.find_spec("ipywidgets") is None,
                       reason="needs torch_xla, nbclient and ipywidgets (the xla test tier)"),
]

nbformat = pytest.importorskip("nbformat")

KERNEL_NAME = "xlaunch-xla-display-tests"
CELL_TIMEOUT = 400
STEPS = 25

TRAIN = f'''
import os, time
from tqdm.auto import tqdm
from IPython.display import HTML, display
from xlaunch import ProcessState, notebook_launcher

def train(tag):
    import torch_xla
    for _ in tqdm(range({STEPS}), desc=f"{{tag}} rank {{ProcessState().process_index}}"):
        time.sleep(0.01)
    handle = display(HTML(f"<b>{{tag}} step 0</b>"), display_id=True)
    for step in range(1, 30):
        handle.update(HTML(f"<b>{{tag}} step {{step}}</b>"))
    return str(torch_xla.device())
'''
# One replica of xmp.spawn's pool, forked from the launch thread.
POOL = 'print("pool:", notebook_launcher(train, ("pool",)))'
# One replica of two devices: torch_xla runs it in the process that spawns, a forked leader.
LEADER = '''
os.environ["CPU_NUM_DEVICES"] = "2"
try:
    print("leader:", notebook_launcher(train, ("leader",), num_processes=1))
finally:
    os.environ["CPU_NUM_DEVICES"] = "1"
'''
# SPMD: one forked process drives every device (the tier's one).
SPMD = 'print("spmd:", notebook_launcher(train, ("spmd",), spmd=True))'


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    with kernel_environment(tmp_path_factory, KERNEL_NAME, "xlaunch torch_xla display tests",
                            TORCH_WARM_POOL="0") as env:
        yield env


def test_a_replicas_tqdm_auto_bar_and_display_reach_the_cell(kernel_env: dict[str, str],
                                                             tmp_path: Path) -> None:
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(TRAIN), nbformat.v4.new_code_cell(POOL),
                nbformat.v4.new_code_cell(LEADER), nbformat.v4.new_code_cell(SPMD)]
    client = NotebookClient(nb, kernel_name=KERNEL_NAME, timeout=CELL_TIMEOUT,
                            startup_timeout=180, store_widget_state=True, allow_errors=False)
    with client.setup_kernel(env=kernel_env, cwd=str(tmp_path)):
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        client.set_widgets_metadata()
    states = nb.metadata.get("widgets", {}).get(
        "application/vnd.jupyter.widget-state+json", {}).get("state", {})
    for index, tag in ((1, "pool"), (2, "leader"), (3, "spmd")):
        outputs = nb.cells[index].outputs
        text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
        assert f"{tag}: xla:0" in text, outputs
        views = [o["data"]["application/vnd.jupyter.widget-view+json"]["model_id"]
                 for o in outputs if "application/vnd.jupyter.widget-view+json" in o.get("data", {})]
        assert len(views) == 1, outputs  # the bar's box, shown in this cell
        box = states[views[0]]["state"]
        parts = [states[child.removeprefix("IPY_MODEL_")] for child in box["children"]]
        bars = [p["state"] for p in parts
                if p["model_name"] in ("FloatProgressModel", "IntProgressModel")]
        assert len(bars) == 1 and bars[0]["value"] == bars[0]["max"] == STEPS, parts
        labels = " ".join(str(p["state"].get("value")) for p in parts
                          if p["model_name"] == "HTMLModel").replace("\u2007", " ")
        assert f"{tag} rank 0" in labels and f"{STEPS}/{STEPS}" in labels, labels
        html = [o["data"]["text/html"] for o in outputs if "text/html" in o.get("data", {})
                and "xlaunch-report" not in o["data"]["text/html"]]  # the launch's own report
        assert html == [f"<b>{tag} step 29</b>"], outputs  # one output, at its last state


LIVE = '''
import os, time
from xlaunch import ProcessState, notebook_launcher

def work(tag):
    import torch_xla
    for step in range(4):
        print(f"{tag} step {step} of rank {ProcessState().process_index}")
        time.sleep(0.6)
    return str(torch_xla.device())
'''


def live_tables(cell: Any) -> list[Any]:
    """Each state the cell's live view showed, in order: its html, or its last data."""
    return [data for display_id, data in cell.display_updates
            if display_id.startswith("xlaunch-live")]


def test_the_live_view_shows_a_forked_replicas_row_then_becomes_the_report(
        kernel_env: dict[str, str], tmp_path: Path) -> None:
    """The live view on the torch_xla path: xmp.spawn's pool forked from the launch thread, and
    a launch leader (one replica of two devices); the view's rows come from the marks the
    replicas leave; at the end it becomes the report (shown on the XLA path)."""
    from tests.notebooks.nbkernel import Kernel

    kernel = Kernel(kernel_env, tmp_path, KERNEL_NAME)
    try:
        assert kernel.run(LIVE).status == "ok"
        cells = {"pool": kernel.run('notebook_launcher(work, ("pool",))'),
                 "leader": kernel.run('os.environ["CPU_NUM_DEVICES"] = "2"\n'
                                      'try:\n    notebook_launcher(work, ("leader",), '
                                      'num_processes=1)\nfinally:\n'
                                      '    os.environ["CPU_NUM_DEVICES"] = "1"')}
    finally:
        left = kernel.shutdown()
    assert not left, f"processes outlived the kernel: {left}"
    for tag, cell in cells.items():
        assert cell.status == "ok", cell.describe()
        tables = live_tables(cell)
        assert tables, (tag, cell.display_updates)
        shown = [data["text/plain"] for data in tables[:-1]]
        assert any(re.match(rf"rank 0: running, \d+ s  {tag} step \d of rank 0$", text)
                   for text in shown), (tag, shown)
        assert re.match(rf"rank 0: finished, \d+ s  {tag} step 3 of rank 0$", shown[-1]), shown
        assert "xlaunch-report" in tables[-1].get("text/html", ""), tables[-1]  # it became the report
