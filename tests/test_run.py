"""`xlaunch run script.py ARGS` as users run it: the real command, real worker processes (CPU).

Each test starts ``python -m xlaunch run`` in a subprocess with a short script written for it, and
checks what a shell would see: output, stderr and the exit status. Nothing asserts a duration; a
hang ends at the subprocess timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

STEERING = ("XLAUNCH_ACCELERATOR", "PJRT_DEVICE", "CPU_NUM_DEVICES", "GPU_NUM_DEVICES",
            "OMP_NUM_THREADS")


def xlaunch_run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in STEERING}
    env["XLAUNCH_ACCELERATOR"] = "cpu"
    return subprocess.run([sys.executable, "-m", "xlaunch", "run", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=180)


def write(folder: Path, name: str, source: str) -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(source))
    return path


def test_script_runs_as_main_in_every_rank_with_its_arguments(tmp_path):
    write(tmp_path, "helper.py", "GREETING = 'hello from a module next to the script'\n")
    write(tmp_path, "show.py", """\
        import os, sys
        import torch.distributed as dist
        from helper import GREETING  # the script's folder is importable, as with `python show.py`
        from xlaunch import ProcessState

        if __name__ == "__main__":
            state = ProcessState()
            with open(os.path.join(os.path.dirname(__file__), f"pid-{state.process_index}"), "w") as f:
                f.write(str(os.getpid()))
            print(f"rank={state.process_index} world={state.num_processes} argv={sys.argv[1:]}")
            print(GREETING, dist.get_world_size())
        """)
    result = xlaunch_run("--num-processes", "2", "show.py", "a", "b", "--flag", "x", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] rank={rank} world=2 argv=['a', 'b', '--flag', 'x']" in result.stdout
        assert f"[rank {rank}] hello from a module next to the script 2" in result.stdout
        pid = int((tmp_path / f"pid-{rank}").read_text())
        assert pid != os.getpid()
        assert not _alive(pid), f"rank {rank}'s worker (pid {pid}) outlived the command"


def test_torchrun_script_that_makes_its_own_process_group(tmp_path):
    write(tmp_path, "torchrun_style.py", """\
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")  # the launcher has made it already: this must not fail
        total = torch.ones(1)
        dist.all_reduce(total)
        print("sum", int(total.item()))
        dist.destroy_process_group()
        """)
    result = xlaunch_run("--nproc_per_node", "2", "torchrun_style.py", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("sum 2") == 2


def test_exception_in_one_rank_exits_1_with_its_root_cause(tmp_path):
    write(tmp_path, "fails.py", """\
        from xlaunch import ProcessState

        if ProcessState().process_index == 1:
            raise ValueError("rank 1 could not read its shard")
        """)
    result = xlaunch_run("--num-processes", "2", "fails.py", cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    root_cause = result.stderr.split("[root cause]", 1)[1]
    assert root_cause.startswith(" rank 1")
    assert "ValueError: rank 1 could not read its shard" in root_cause
    assert f'File "{tmp_path / "fails.py"}", line 4, in <module>' in root_cause
    assert 'raise ValueError("rank 1 could not read its shard")' in root_cause
    assert "<frozen runpy>" not in root_cause  # the trace opens at the script, not the machinery


def test_sys_exit_status_of_the_failed_rank_is_the_exit_status(tmp_path):
    write(tmp_path, "exits.py", """\
        import sys
        from xlaunch import ProcessState

        if ProcessState().process_index == 1:
            sys.exit(3)
        """)
    result = xlaunch_run("--num-processes", "2", "exits.py", cwd=tmp_path)
    assert result.returncode == 3, result.stderr
    assert "rank 1" in result.stderr.split("[root cause]", 1)[1].splitlines()[0]


def test_timeout_stops_every_rank_and_exits_124(tmp_path):
    write(tmp_path, "stuck.py", """\
        import time

        def wait_for_data():
            time.sleep(120)

        wait_for_data()
        """)
    # long enough for the workers to start on a loaded machine, so each has a stack to show
    result = xlaunch_run("--num-processes", "2", "--timeout", "15", "stuck.py", cwd=tmp_path)
    assert result.returncode == 124, result.stderr
    assert "timeout=15.0" in result.stderr
    assert "wait_for_data" in result.stderr  # where each rank stood when it was stopped


def test_one_process_runs_in_the_command_itself(tmp_path):
    write(tmp_path, "single.py", """\
        import os, sys
        from xlaunch import ProcessState
        print("world", ProcessState().num_processes, "pid", os.getpid(), "argv", sys.argv[1:])
        sys.exit(int(sys.argv[1]))
        """)
    result = xlaunch_run("--cpu", "single.py", "4", cwd=tmp_path)
    assert result.returncode == 4, result.stderr
    assert "world 1" in result.stdout and "argv ['4']" in result.stdout


@pytest.mark.parametrize("option, message", [
    (["--num-processes", "0"], "num_processes must be a whole number of at least 1"),
    (["--mixed-precision", "fp8"], "mixed_precision='fp8' is not one of no, fp16, bf16"),
    (["--node-rank", "2", "--num-nodes", "2"], "node_rank=2 must be between 0 and num_nodes-1=1"),
    (["--num-processes", "two"], "expected a whole number, 'auto', 'gpu' or 'cpu', got 'two'"),
])
def test_bad_option_value_exits_2_before_any_process_starts(tmp_path, option, message):
    write(tmp_path, "never.py", "open('ran', 'w').close()\n")
    result = xlaunch_run(*option, "never.py", cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert not (tmp_path / "ran").exists()


def test_missing_script_exits_2(tmp_path):
    result = xlaunch_run("--num-processes", "2", "no_such_script.py", cwd=tmp_path)
    assert result.returncode == 2
    assert "no_such_script.py" in result.stderr


def test_options_after_the_script_belong_to_the_script(tmp_path):
    """As with torchrun: `run script.py --num-processes 5` passes the option to the script."""
    write(tmp_path, "args.py", "import sys; print('script got', sys.argv[1:])\n")
    result = xlaunch_run("--cpu", "args.py", "--num-processes", "5", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "script got ['--num-processes', '5']" in result.stdout


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_torchrun_and_accelerate_spellings(tmp_path):
    write(tmp_path, "world.py", """\
        import torch.distributed as dist
        print("world", dist.get_world_size())
        """)
    for options in (["--standalone", "--nproc-per-node", "2"], ["--nproc_per_node=2"],
                    ["--num_processes", "2", "--num_machines", "1"]):
        result = xlaunch_run(*options, "world.py", cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        assert "[rank 1] world 2" in result.stdout, options


@pytest.mark.parametrize("options, message", [
    (["--num_processes", "3", "--num_machines", "2"], "accelerate's count of processes on all 2"),
    (["--num_processes", "2", "--num-processes", "2"], "not both"),
    (["--standalone", "--nnodes", "2"], "--standalone is torchrun's one-machine mode"),
])
def test_spellings_that_mean_something_else_are_refused_saying_the_difference(
        tmp_path, options, message):
    write(tmp_path, "never.py", "open('ran', 'w').close()\n")
    result = xlaunch_run(*options, "never.py", cwd=tmp_path)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert not (tmp_path / "ran").exists()


def test_a_module_runs_as_main_with_dash_m(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    write(package, "train.py", """\
        import sys
        from xlaunch import ProcessState
        if __name__ == "__main__":
            print(f"module rank={ProcessState().process_index} argv={sys.argv[1:]}")
            if "--fail" in sys.argv:
                raise ValueError("the module failed")
        """)
    result = xlaunch_run("--num-processes", "2", "-m", "pkg.train", "x", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "[rank 1] module rank=1 argv=['x']" in result.stdout
    failed = xlaunch_run("--num-processes", "2", "-m", "pkg.train", "--fail", cwd=tmp_path)
    assert failed.returncode == 1 and "ValueError: the module failed" in failed.stderr
    assert 'pkg/train.py", line 6' in failed.stderr  # the traceback opens at the module's line


def test_version(tmp_path):
    import xlaunch

    result = subprocess.run([sys.executable, "-m", "xlaunch", "--version"], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == f"xlaunch {xlaunch.__version__}"


def test_a_scripts_own_process_group_gets_the_backend_and_timeout_it_asked_for(tmp_path):
    write(tmp_path, "own_group.py", """\
        import datetime, sys, time
        import torch.distributed as dist
        dist.init_process_group(sys.argv[1], timeout=datetime.timedelta(seconds=3))
        print("backend", dist.get_backend(), "world", dist.get_world_size(), flush=True)
        if dist.get_rank() == 1:
            time.sleep(60)  # rank 0 waits alone: only the script's 3 s timeout ends that
        dist.barrier()
        """)
    result = xlaunch_run("--num-processes", "2", "--timeout", "100", "own_group.py", "gloo",
                         cwd=tmp_path)
    assert "[rank 1] backend gloo world 2" in result.stdout, result.stderr
    assert result.returncode == 1 and "3000ms" in result.stderr, result.stderr[-3000:]
    nccl = xlaunch_run("--num-processes", "2", "own_group.py", "nccl", cwd=tmp_path)
    assert nccl.returncode == 1, nccl.stdout
    assert "[root cause]" in nccl.stderr and "nccl" in nccl.stderr.lower()


def test_a_scripts_own_group_meets_through_a_private_file(tmp_path):
    write(tmp_path, "own_store.py", """\
        import os, stat
        import torch.distributed as dist
        from xlaunch.names import STORE_DIR_VAR
        dist.init_process_group("gloo")
        dist.barrier()
        folder = os.environ[STORE_DIR_VAR]
        modes = {name: oct(stat.S_IMODE(os.lstat(os.path.join(folder, name)).st_mode))
                 for name in os.listdir(folder) if name.startswith("script-group-")}
        print("stores", sorted(modes.items()), flush=True)
        dist.barrier()
        """)
    env = {k: v for k, v in os.environ.items() if k not in STEERING}
    env["XLAUNCH_ACCELERATOR"] = "cpu"
    result = subprocess.run([sys.executable, "-m", "xlaunch", "run", "--num-processes", "2",
                             "own_store.py"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=180, preexec_fn=lambda: os.umask(0))
    assert result.returncode == 0, result.stderr[-3000:]
    for rank in (0, 1):  # under umask 0 too: only the user can read or write it
        assert f"[rank {rank}] stores [('script-group-0', '0o600')]" in result.stdout, result.stdout
