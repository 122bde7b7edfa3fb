"""What workers display reaches the launching cell, in a real Jupyter kernel (issue 31).

A forked worker may not use the kernel's sockets (jupyter_client drops it: "attempted to send
message from fork"); the launch's caller publishes what each rank displays instead. The
frontend's view is rebuilt as a notebook keeps it: each display id's last data, each widget's
state (`nbkernel.CellRun`). Every test here failed before displays travelled (checked).
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.timeout(300)

DEFINITIONS = '''
import logging, os, sys, time
from xlaunch import ProcessState, notebook_launcher
'''


def progress_bars(cell):
    """tqdm.notebook's bars: the state of each progress widget the cell shows."""
    return [state for state in cell.widget_states.values()
            if state.get("_model_name") in ("FloatProgressModel", "IntProgressModel")]


def test_the_tutorials_main_only_tqdm_auto_bar_reaches_the_cell_and_finishes(kernel):
    assert kernel.run(DEFINITIONS).status == "ok"
    cell = kernel.run('''
from tqdm.auto import tqdm

def train():
    for _ in tqdm(range(40), disable=not ProcessState().is_local_main_process):
        time.sleep(0.01)

notebook_launcher(train, num_processes=2)
''')
    assert cell.status == "ok", cell.describe()
    bars = progress_bars(cell)
    assert len(bars) == 1, (cell.widget_states, cell.describe())
    assert bars[0]["value"] == bars[0]["max"] == 40, bars
    shown = [d for d in cell.displays if "application/vnd.jupyter.widget-view+json" in d]
    assert len(shown) == 1, cell.displays
    assert cell.display_senders == {kernel.pid}, "a worker wrote to the kernel's sockets"


def test_a_bar_on_each_rank_gives_two_finished_bars(kernel):
    cell = kernel.run('''
from tqdm.auto import tqdm

def both():
    for _ in tqdm(range(30), desc=f"rank {ProcessState().process_index}"):
        time.sleep(0.01)

notebook_launcher(both, num_processes=2)
''')
    assert cell.status == "ok", cell.describe()
    bars = progress_bars(cell)
    assert len(bars) == 2, cell.widget_states
    assert all(bar["value"] == bar["max"] == 30 for bar in bars), bars
    labels = " ".join(str(state.get("value")) for state in cell.widget_states.values())
    labels = labels.replace("\u2007", " ")  # tqdm pads with figure spaces
    assert "rank 0" in labels and "rank 1" in labels, labels


def test_a_display_updated_in_place_from_a_worker_ends_at_its_last_state(kernel):
    cell = kernel.run('''
from IPython.display import HTML, display

def shows():
    if ProcessState().process_index == 0:
        handle = display(HTML("<b>step 0</b>"), display_id=True)
        for step in range(1, 200):
            handle.update(HTML(f"<b>step {step}</b>"))

notebook_launcher(shows, num_processes=2)
''')
    assert cell.status == "ok", cell.describe()
    html = [d for d in cell.displays if "text/html" in d and "xlaunch-live" not in d["text/html"]]
    assert len(html) == 1, cell.displays  # one output, updated in place (the live view aside)
    states = [data for display_id, data in cell.display_states.items()
              if not display_id.startswith("xlaunch-live")]
    assert states[0]["text/html"] == "<b>step 199</b>"
    assert cell.display_senders == {kernel.pid}, "a worker wrote to the kernel's sockets"


def test_a_notebooks_logging_configuration_keeps_the_rank_on_workers_lines(kernel):
    cell = kernel.run('''
logging.basicConfig(format="%(levelname)s %(name)s: %(message)s", level=logging.INFO, force=True)

def logs():
    logging.getLogger("train").info("step done by %d", ProcessState().process_index)

notebook_launcher(logs, num_processes=2)
''')
    assert cell.status == "ok", cell.describe()
    for rank in (0, 1):
        assert f"[rank {rank}] INFO train: step done by {rank}\n" in cell.stderr, cell.describe()
    kernel.run("logging.getLogger().handlers.clear()")


def rendered_lines(text):
    """Each line as a terminal shows it: the segments a carriage return redrew over it."""
    return [[segment for segment in line.split("\r") if segment] for line in text.split("\n")]


def test_text_bars_from_two_ranks_both_finish_and_never_share_a_line(kernel):
    cell = kernel.run('''
from tqdm import tqdm

def text_bars():
    for _ in tqdm(range(30), mininterval=0):
        time.sleep(0.01)

notebook_launcher(text_bars, num_processes=2)
''')
    assert cell.status == "ok", cell.describe()
    for segments in rendered_lines(cell.stderr):
        ranks = {re.match(r"\[rank (\d)\]", s).group(1) for s in segments
                 if re.match(r"\[rank (\d)\]", s)}
        assert len(ranks) <= 1, f"two ranks redraw one line: {segments}"
    finals = [data.get("text/plain", "") for data in cell.display_states.values()]
    finals += [segments[-1] for segments in rendered_lines(cell.stderr) if segments]
    for rank in (0, 1):
        assert any(text.startswith(f"[rank {rank}]") and "30/30" in text for text in finals), (
            finals, cell.describe())


def test_a_notebook_run_by_nbclient_stores_the_finished_bar_and_the_last_display(kernel_env,
                                                                                   tmp_path):
    """What a saved notebook keeps (nbclient, ``store_widget_state=True``): the main-only
    ``tqdm.auto`` bar's widget at its total, one output per display at its last state."""
    import nbformat
    from nbclient import NotebookClient
    from nbkernel import CELL_TIMEOUT, KERNEL_NAME, STARTUP_TIMEOUT

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(DEFINITIONS + '''
from tqdm.auto import tqdm
from IPython.display import HTML, display

def train():
    state = ProcessState()
    for _ in tqdm(range(25), disable=not state.is_local_main_process):
        time.sleep(0.01)
    if state.is_main_process:
        handle = display(HTML("<i>epoch 0</i>"), display_id=True)
        for epoch in range(1, 50):
            handle.update(HTML(f"<i>epoch {epoch}</i>"))
'''), nbformat.v4.new_code_cell("notebook_launcher(train, num_processes=2)")]
    client = NotebookClient(nb, kernel_name=KERNEL_NAME, timeout=CELL_TIMEOUT,
                            startup_timeout=STARTUP_TIMEOUT, store_widget_state=True,
                            resources={"metadata": {"path": str(tmp_path)}})
    with client.setup_kernel(env=kernel_env, cwd=str(tmp_path)):
        for index, cell in enumerate(nb.cells):
            client.execute_cell(cell, index)
        client.set_widgets_metadata()  # what execute() does once every cell ran
    states = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    bars = [m["state"] for m in states.values()
            if m["model_name"] in ("FloatProgressModel", "IntProgressModel")]
    assert len(bars) == 1 and bars[0]["value"] == bars[0]["max"] == 25, states
    html = [o for o in nb.cells[1].outputs if "text/html" in o.get("data", {})]
    assert [o["data"]["text/html"] for o in html] == ["<i>epoch 49</i>"], nb.cells[1].outputs


def test_a_line_four_ranks_print_alike_shows_once_with_their_ranks(kernel):
    cell = kernel.run('''
from xlaunch import ProcessState, notebook_launcher

def alike():
    ProcessState().wait_for_everyone()  # all four released together: close together
    print("validation done")

notebook_launcher(alike, num_processes=4)
''')
    assert cell.status == "ok", cell.describe()
    assert cell.stdout.count("validation done") == 1, cell.describe()
    assert "[ranks 0-3] validation done\n" in cell.stdout, cell.describe()


def test_a_line_both_ranks_print_alike_shows_once_unless_folding_is_off(kernel):
    cell = kernel.run('''
def alike():
    rank = ProcessState().process_index
    print("epoch 1 done")
    print(f"loss of rank {rank}")
    print("epoch 2 done", file=sys.stderr)

notebook_launcher(alike, num_processes=2)
''')
    assert cell.status == "ok", cell.describe()
    assert cell.stdout.count("epoch 1 done") == 1, cell.describe()
    assert "[ranks 0-1] epoch 1 done\n" in cell.stdout
    assert "[rank 0] loss of rank 0\n" in cell.stdout and "[rank 1] loss of rank 1\n" in cell.stdout
    assert "[ranks 0-1] epoch 2 done\n" in cell.stderr, cell.describe()

    off = kernel.run('os.environ["XLAUNCH_FOLD_LINES"] = "0"\n'
                     'try:\n    notebook_launcher(alike, num_processes=2)\n'
                     'finally:\n    del os.environ["XLAUNCH_FOLD_LINES"]')
    assert off.status == "ok", off.describe()
    for rank in (0, 1):
        assert f"[rank {rank}] epoch 1 done\n" in off.stdout, off.describe()


def test_what_a_process_the_worker_forked_prints_reaches_the_cell_with_its_rank(kernel):
    """A DataLoader worker is a process the rank forked: it has no way to the caller of its own
    (the rank's socket is the rank's), so its lines go through the kernel's own stream, which
    carries a forked process's text to the cell, prefixed with its rank's prefix."""
    cell = kernel.run('''
import os, sys
from torch.utils.data import DataLoader, Dataset
from xlaunch import ProcessState, notebook_launcher

class Loud(Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, index):
        rank = ProcessState().process_index
        print(f"loader of rank {rank} loads item {index} in {os.getpid()}")
        print(f"loader of rank {rank} warns", file=sys.stderr)
        return index

def load():
    print(f"rank {ProcessState().process_index} runs in {os.getpid()}")
    return [int(item) for item in DataLoader(Loud(), num_workers=1)]

notebook_launcher(load, num_processes=2)
''')
    assert cell.status == "ok", cell.describe()
    for rank in (0, 1):
        for index in (0, 1):
            line = re.search(rf"^\[rank {rank}\] loader of rank {rank} loads item {index} in (\d+)$",
                             cell.stdout, re.MULTILINE)
            assert line, cell.describe()
        worker = re.search(rf"^\[rank {rank}\] rank {rank} runs in (\d+)$", cell.stdout,
                           re.MULTILINE)
        assert worker and worker.group(1) != line.group(1), cell.describe()  # another process
        assert f"[rank {rank}] loader of rank {rank} warns\n" in cell.stderr, cell.describe()
    assert cell.results and "[0, 1]" in cell.results[0], cell.describe()


def test_a_message_the_relay_cannot_take_holds_no_worker_and_loses_no_line(kernel):
    """Rank 0 sends its relay a piece of text that is not text (what a broken worker could
    send): the relay goes on reading, both ranks print on (their sends would block on a relay
    that stopped reading), every line reaches the cell and the launch ends."""
    cell = kernel.run('''
import sys, time
from xlaunch import ProcessState, notebook_launcher

def prints_after_a_bad_piece():
    rank = ProcessState().process_index
    if rank == 0:
        sys.stdout._lines([("", 5)])  # the prefixed stream's way to the relay
    time.sleep(1)  # the relay tries to show it first
    for step in range(3000):
        print(f"rank {rank} step {step} " + "x" * 60)
    return "done"

notebook_launcher(prints_after_a_bad_piece, num_processes=2, timeout=90)
''')
    assert cell.status == "ok", cell.describe()[-3000:]
    for rank in (0, 1):
        steps = re.findall(rf"\[rank {rank}\] rank {rank} step (\d+) x{{60}}$", cell.stdout,
                           re.MULTILINE)  # the piece that was not text starts a line: "5[rank 0] ..."
        assert [int(step) for step in steps] == list(range(3000)), len(steps)
    assert cell.results == ["'done'"], cell.describe()[-3000:]
