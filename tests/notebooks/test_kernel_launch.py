"""notebook_launcher in a real Jupyter kernel, as a person uses it: one session, cell after cell.

The tests share one kernel and run in order, like the cells of a notebook: functions are defined in
cells (so workers get them by fork, never by pickling), launches follow one another, a failed and
an interrupted launch are each followed by one that must work. The kernel has
``XLAUNCH_ACCELERATOR=cpu`` in its environment. After every launch the kernel must have no process
left (its workers end with the launch); the fixture checks that nothing outlives the kernel.
Nothing here asserts a duration: every wait has a limit and fails the test when it passes.
"""

from __future__ import annotations

import os
import re
import signal
import time

import psutil
import pytest

pytestmark = pytest.mark.timeout(300)

DEFINITIONS = '''
import os, sys, time
from xlaunch import LaunchError, LaunchTimeout, ProcessState, notebook_launcher

def hello(greeting):
    state = ProcessState()
    print(f"{greeting} from process {state.process_index} of {state.num_processes}")
    print(f"stderr of process {state.process_index}", file=sys.stderr)
    return {"rank": state.process_index, "world": state.num_processes, "pid": os.getpid()}
'''


def check_no_workers_left(kernel):
    alive = kernel.children()
    assert not alive, f"processes left running in the kernel after the launch: {alive}"


def test_two_processes_print_into_the_cell_with_rank_prefixes(kernel):
    assert kernel.run(DEFINITIONS).status == "ok"
    cell = kernel.run('notebook_launcher(hello, args=("hello",), num_processes=2)')
    assert cell.status == "ok", cell.describe()
    for rank in (0, 1):
        assert f"[rank {rank}] hello from process {rank} of 2\n" in cell.stdout, cell.describe()
        assert f"[rank {rank}] stderr of process {rank}\n" in cell.stderr, cell.describe()
    # Every line a worker printed carries its rank; the value shown is process 0's.
    assert all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in cell.stdout.splitlines())
    assert len(cell.results) == 1 and "'rank': 0" in cell.results[0] and "'world': 2" in cell.results[0]
    check_no_workers_left(kernel)


def test_two_launches_in_a_row(kernel):
    cell = kernel.run(
        'first = notebook_launcher(hello, args=("one",), num_processes=2)\n'
        'second = notebook_launcher(hello, args=("two",), num_processes=2)\n'
        'print("results", first["rank"], first["world"], second["rank"], second["world"],\n'
        '      first["pid"] != second["pid"])'
    )
    assert cell.status == "ok", cell.describe()
    for word in ("one", "two"):
        for rank in (0, 1):
            assert f"[rank {rank}] {word} from process {rank} of 2\n" in cell.stdout
    assert "results 0 2 0 2 True\n" in cell.stdout, cell.describe()
    check_no_workers_left(kernel)


def test_a_failed_launch_shows_the_raising_rank_then_the_next_launch_works(kernel):
    defined = kernel.run('''
def fails_in_rank_1():
    state = ProcessState()
    if state.process_index == 1:
        raise ValueError("rank 1 could not read its shard")
    state.wait_for_everyone()  # rank 0 waits for the rank that failed
''')
    assert defined.status == "ok"
    failed = kernel.run("notebook_launcher(fails_in_rank_1, num_processes=2)")
    assert failed.status == "error" and failed.error is not None, failed.describe()
    assert failed.error["ename"] == "LaunchError"
    message = failed.error["evalue"]
    assert "[root cause] rank 1" in message, message
    assert "ValueError: rank 1 could not read its shard" in message
    assert 'raise ValueError("rank 1 could not read its shard")' in message  # its traceback
    check_no_workers_left(kernel)

    after = kernel.run('notebook_launcher(hello, args=("after the failure",), num_processes=2)')
    assert after.status == "ok", after.describe()
    assert "[rank 1] after the failure from process 1 of 2\n" in after.stdout
    check_no_workers_left(kernel)


def test_a_state_made_in_the_notebook_does_not_leak_into_the_workers(kernel):
    cell = kernel.run('''
state = ProcessState()  # made in the notebook, before the launch: one process here

@state.on_main_process
def report(text):
    print("main process says", text)

def uses_the_notebook_state():
    report(f"{state.num_processes} processes")
    return [state.process_index, state.num_processes, state.is_main_process]

print("notebook sees", state.num_processes, "process")
notebook_launcher(uses_the_notebook_state, num_processes=2)
''')
    assert cell.status == "ok", cell.describe()
    assert "notebook sees 1 process\n" in cell.stdout
    assert "[rank 0] main process says 2 processes\n" in cell.stdout, cell.describe()
    assert "[rank 1] main process says" not in cell.stdout
    assert cell.results == ["[0, 2, True]"]
    check_no_workers_left(kernel)


def test_a_timeout_stops_the_workers_with_their_stacks(kernel):
    cell = kernel.run('''
def stuck_in_rank_1():
    if ProcessState().process_index == 1:
        time.sleep(3600)

notebook_launcher(stuck_in_rank_1, num_processes=2, timeout=15)
''')
    assert cell.status == "error" and cell.error is not None, cell.describe()
    assert cell.error["ename"] == "LaunchTimeout"
    assert "rank 1" in cell.error["evalue"] and "stuck_in_rank_1" in cell.error["evalue"], cell.describe()
    check_no_workers_left(kernel)
    after = kernel.run('notebook_launcher(hello, args=("after the timeout",), num_processes=2)')
    assert after.status == "ok", after.describe()
    check_no_workers_left(kernel)


def send_sigint_to_the_kernel_only(kernel):
    os.kill(kernel.pid, signal.SIGINT)


INTERRUPTS = {
    # What jupyter_client does for the stop button: SIGINT to the kernel's process group, which
    # includes the workers.
    "interrupt_kernel": lambda kernel: kernel.interrupt(),
    # A frontend that signals the kernel process alone: the launcher must stop the workers itself.
    "sigint_to_kernel_only": send_sigint_to_the_kernel_only,
}


@pytest.mark.parametrize("how", list(INTERRUPTS))
def test_an_interrupted_launch_stops_every_worker_and_the_next_launch_works(kernel, tmp_path, how):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    workers: list[psutil.Process] = []
    during: list[psutil.Process] = []  # the kernel's processes while the launch ran

    def interrupt_once_both_workers_sleep():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            files = sorted(pid_dir.glob("ready-*"))
            if len(files) == 2:
                workers.extend(psutil.Process(int(f.read_text())) for f in files)
                during.extend(kernel.children())
                INTERRUPTS[how](kernel)
                return
            time.sleep(0.05)
        # Never interrupted: the cell then ends by the kernel's own limit and the test fails.

    cell = kernel.run(f'''
def sleeps(pid_dir):
    rank = ProcessState().process_index
    path = os.path.join(pid_dir, f"ready-{{rank}}")
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    print("sleeping", flush=True)
    time.sleep(3600)

notebook_launcher(sleeps, args=({str(pid_dir)!r},), num_processes=2)
''', timeout=180, while_running=interrupt_once_both_workers_sleep)
    assert len(workers) == 2, f"the workers never wrote their pid files:\n{cell.describe()}"
    assert set(workers) <= set(during), "the workers are the kernel's own processes, seen while running"
    assert cell.status == "error" and cell.error is not None, cell.describe()
    assert cell.error["ename"] == "KeyboardInterrupt", cell.describe()
    assert cell.error["evalue"] == "interrupted: every worker of the launch was stopped"
    frames = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(cell.error["traceback"]))  # no colours
    ours = [frame for frame in cell.error["traceback"] if "/xlaunch/" in frame]
    assert not ours, f"the user's cell, then the message, no frame of xlaunch's:\n{frames}"
    assert "notebook_launcher(sleeps, " in frames, frames

    _, alive = psutil.wait_procs(workers, timeout=30)
    assert not alive, f"workers still alive after the interrupt: {alive}"
    check_no_workers_left(kernel)

    after = kernel.run('notebook_launcher(hello, args=("after the interrupt",), num_processes=2)')
    assert after.status == "ok", after.describe()
    for rank in (0, 1):
        assert f"[rank {rank}] after the interrupt from process {rank} of 2\n" in after.stdout
    check_no_workers_left(kernel)


def test_the_stop_button_still_stops_plain_cells_after_the_launches(kernel, tmp_path):
    """A launch holds off a second Ctrl-C while a stop cleans up (its own SIGINT handler, for
    that moment); the kernel's handler must be put back."""
    marker = tmp_path / "running"

    def interrupt_once_running():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if marker.exists():
                kernel.interrupt()
                return
            time.sleep(0.05)

    cell = kernel.run(f"open({str(marker)!r}, 'w').close()\nwhile True:\n    time.sleep(0.1)",
                      timeout=180, while_running=interrupt_once_running)
    assert cell.status == "error" and cell.error is not None, cell.describe()
    assert cell.error["ename"] == "KeyboardInterrupt", cell.describe()


def test_a_failed_launch_opens_on_the_users_call_then_the_message(kernel):
    """No frame of xlaunch's shows, not even the one that raises (which IPython shows whatever
    its ``__tracebackhide__``), and no report sits between the launch line and the error."""
    cell = kernel.run('''
def fails():
    raise ValueError("bad batch 7")

notebook_launcher(fails, num_processes=2)
''')
    assert cell.status == "error" and cell.error["ename"] == "LaunchError", cell.describe()
    frames = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(cell.error["traceback"]))  # no colours
    ours = [frame for frame in cell.error["traceback"] if "/xlaunch/" in frame]
    assert not ours, frames  # the user's call, then the message
    assert "notebook_launcher(fails, num_processes=2)" in frames
    assert "skipping hidden" not in frames, frames
    assert "bad batch 7" in cell.error["evalue"]
    assert not cell.shown, "no report table before the error"


def test_a_launch_that_fails_before_any_worker_ran_opens_on_the_users_call_then_the_message(
        kernel):
    """The launch's own failure (here: the port it was told to use is taken), raised before a
    worker started: no frame of xlaunch's either."""
    cell = kernel.run('''
import socket
from xlaunch import notebook_launcher
holder = socket.socket()
holder.bind(("127.0.0.1", 0))
holder.listen()
taken = str(holder.getsockname()[1])
try:
    notebook_launcher(print, num_processes=2, use_port=taken)
finally:
    holder.close()
''')
    assert cell.status == "error" and cell.error["ename"] == "RuntimeError", cell.describe()
    frames = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(cell.error["traceback"]))  # no colours
    ours = [frame for frame in cell.error["traceback"] if "/xlaunch/" in frame]
    assert not ours, frames  # the user's call, then the message
    assert "notebook_launcher(print, num_processes=2, use_port=taken)" in frames, frames
    assert "already in use" in cell.error["evalue"]


@pytest.mark.parametrize("call, ename, words", [
    ("notebook_launcher(print, num_processes=0)", "ValueError", "num_processes"),
    ("notebook_launcher(print, args=5)", "TypeError", "args must be a tuple"),
    ("debug_launcher(print, num_processes=-1)", "ValueError", "num_processes"),
])
def test_input_refused_up_front_opens_on_the_users_call_then_the_message(kernel, call, ename,
                                                                          words):
    """Bad input, refused before any launch (the plan's refusals, the arguments' checks): the
    cell shows the user's call, then the message, no frame of xlaunch's."""
    cell = kernel.run(f"from xlaunch import notebook_launcher, debug_launcher\n{call}\n")
    assert cell.status == "error" and cell.error["ename"] == ename, cell.describe()
    frames = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(cell.error["traceback"]))
    assert not [frame for frame in cell.error["traceback"] if "/xlaunch/" in frame], frames
    assert call in frames, frames
    assert words in cell.error["evalue"], cell.error["evalue"]
