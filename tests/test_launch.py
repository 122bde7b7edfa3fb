"""The CPU path for real: worker processes started by torch elastic through notebook_launcher.

Functions given to the launcher are defined in this module and reach the workers by fork, as a
notebook's functions do. Tests never assert a duration; a hang ends at pytest's timeout.
"""

from __future__ import annotations

import inspect
import os
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

import xlaunch
from xlaunch import LaunchError, LaunchTimeout, debug_launcher, notebook_launcher


@pytest.fixture(autouse=True)
def cpu_only(monkeypatch):
    monkeypatch.setenv("XLAUNCH_ACCELERATOR", "cpu")


def rank_and_world(offset):
    import torch.distributed as dist

    return {"rank": dist.get_rank(), "world": dist.get_world_size(), "offset": offset,
            "local_rank": int(os.environ["LOCAL_RANK"]),
            "tensor": torch.full((2,), float(dist.get_rank()))}


def test_launch_returns_local_rank_zero_result():
    result = notebook_launcher(rank_and_world, args=(7,), num_processes=2)
    assert result["rank"] == 0 and result["world"] == 2 and result["offset"] == 7
    assert result["local_rank"] == 0
    assert torch.equal(result["tensor"], torch.zeros(2))


def test_launch_is_the_same_function():
    assert xlaunch.launch is notebook_launcher


def test_debug_launcher_three_processes():
    assert debug_launcher(rank_and_world, args=(1,), num_processes=3)["world"] == 3


def all_reduce_rank():
    import torch.distributed as dist

    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    return value.item()


@pytest.mark.parametrize("rdzv_backend", ["static", "c10d"])
def test_rendezvous_backends_form_a_working_group(rdzv_backend):
    assert notebook_launcher(all_reduce_rank, num_processes=2, rdzv_backend=rdzv_backend) == 3.0


def engine_variables():
    return {key: os.environ.get(key) for key in
            ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "TORCHELASTIC_RUN_ID", "XLAUNCH_MIXED_PRECISION")}


def test_workers_get_the_engine_environment_and_the_options():
    seen = notebook_launcher(engine_variables, num_processes=2, rdzv_id="my-run-17",
                             mixed_precision="BF16", monitor_interval=0.05)
    assert seen["RANK"] == "0" and seen["LOCAL_RANK"] == "0" and seen["WORLD_SIZE"] == "2"
    assert seen["MASTER_ADDR"] == "127.0.0.1" and int(seen["MASTER_PORT"]) > 0
    assert seen["TORCHELASTIC_RUN_ID"] == "my-run-17"
    assert seen["XLAUNCH_MIXED_PRECISION"] == "bf16"


def test_the_options_reach_the_workers_as_torchrun_names_them(tmp_path):
    seen = notebook_launcher(engine_variables, num_processes=2, rdzv_id="abc", max_restarts=2,
                             log_line_prefix_template="${rank}: ")
    assert seen["TORCHELASTIC_RUN_ID"] == "abc" and seen["WORLD_SIZE"] == "2"


def fail_until_third_attempt(counter):
    import torch.distributed as dist

    attempt = xlaunch.ProcessState().restart_count
    assert attempt == int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if dist.get_rank() == 0:
        Path(counter).write_text(str(attempt))
    if attempt < 2:
        raise RuntimeError(f"failing on attempt {attempt}")
    return attempt


def test_max_restarts_reruns_the_workers(tmp_path):
    counter = tmp_path / "attempts"
    assert notebook_launcher(fail_until_third_attempt, args=(str(counter),), num_processes=2,
                             max_restarts=3) == 2
    assert counter.read_text() == "2"


def test_each_restart_is_said_with_the_failure_that_ended_the_attempt(tmp_path, capfd):
    assert notebook_launcher(fail_until_third_attempt, args=(str(tmp_path / "n"),),
                             num_processes=2, max_restarts=2) == 2
    said = [line for line in capfd.readouterr().err.splitlines() if "restarting" in line]
    assert len(said) == 2, said  # both ranks raise: the first to, by its own clock, is named
    for number, line in enumerate(said):
        assert re.fullmatch(rf"xlaunch: restarting \(attempt {number + 2} of 3\) after rank [01] "
                            rf"raised RuntimeError: failing on attempt {number}", line), said


def test_every_attempts_root_cause_is_kept_when_the_last_fails_too(tmp_path):
    with pytest.raises(LaunchError) as caught:
        notebook_launcher(fail_until_third_attempt, args=(str(tmp_path / "n"),), num_processes=2,
                          max_restarts=1)
    assert "failing on attempt 1" in caught.value.root_cause.message
    assert [attempt[0].message for attempt in caught.value.earlier_attempts] == [
        "failing on attempt 0"]
    assert "attempt 1 (restarted) failed first with rank" in str(caught.value)


def test_without_restarts_the_first_failure_ends_the_launch(tmp_path):
    with pytest.raises(LaunchError, match="failing on attempt 0"):
        notebook_launcher(fail_until_third_attempt, args=(str(tmp_path / "n"),), num_processes=2)


def raise_on_rank_one_while_rank_zero_sleeps():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise ValueError("rank one has bad data")
    time.sleep(100)


@pytest.mark.timeout(60)  # the peer sleeps 100 s: only a launch that stops it can pass
def test_raise_while_peer_sleeps_ends_with_the_raisers_message():
    with pytest.raises(LaunchError) as caught:
        notebook_launcher(raise_on_rank_one_while_rank_zero_sleeps, num_processes=2)
    error = caught.value
    assert error.root_cause.rank == 1
    assert error.root_cause.exc_type == "ValueError"
    text = str(error)
    assert text.index("[root cause] rank 1") < text.find("rank 0") or "rank 0" not in text
    assert "ValueError: rank one has bad data" in text
    assert "raise_on_rank_one_while_rank_zero_sleeps" in text  # the user's frame
    assert "worker.py" not in error.root_cause.traceback  # the launcher's frames are not


def raise_then_peer_breaks():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        raise KeyError("missing column 'label'")
    dist.barrier()  # fails once rank 1 is gone: a secondary failure


@pytest.mark.timeout(120)
def test_root_cause_leads_and_peers_are_secondary():
    with pytest.raises(LaunchError) as caught:
        notebook_launcher(raise_then_peer_breaks, num_processes=2)
    failures = caught.value.failures
    assert failures[0].rank == 1 and failures[0].exc_type == "KeyError"
    assert not failures[0].secondary
    assert all(f.secondary for f in failures[1:])
    assert str(caught.value).splitlines()[2].startswith("[root cause] rank 1")


def rank_one_never_reaches_the_barrier():
    import torch.distributed as dist

    if dist.get_rank() == 1:
        time.sleep(100)
    xlaunch.wait_for_everyone()


@pytest.mark.timeout(60)
def test_timeout_stops_every_rank_and_shows_where_each_stood():
    with pytest.raises(LaunchTimeout) as caught:
        # long enough for the workers to start on a loaded machine, so each has a stack to show
        notebook_launcher(rank_one_never_reaches_the_barrier, num_processes=2, timeout=15)
    stacks = {f.rank: f.stack for f in caught.value.failures}
    assert set(stacks) == {0, 1}
    assert "wait_for_everyone" in stacks[0]
    assert "rank_one_never_reaches_the_barrier" in stacks[1] and "wait_for_everyone" not in stacks[1]
    for failure in caught.value.failures:
        assert not psutil.pid_exists(failure.pid) or psutil.Process(failure.pid).status() == "zombie"


def return_on_rank_zero_sleep_on_rank_one():
    if xlaunch.ProcessState().process_index == 0:
        return "done"
    time.sleep(100)


def test_a_timeout_lists_only_the_ranks_still_working():
    with pytest.raises(LaunchTimeout) as caught:
        notebook_launcher(return_on_rank_zero_sleep_on_rank_one, num_processes=2, timeout=15)
    assert [f.rank for f in caught.value.failures] == [1]
    source, first = inspect.getsourcelines(return_on_rank_zero_sleep_on_rank_one)
    sleep_line = first + next(i for i, text in enumerate(source) if "time.sleep(100)" in text)
    # faulthandler's dump: the file, the line of the call it stood in, and the function.
    assert (f"line {sleep_line} in return_on_rank_zero_sleep_on_rank_one"
            in caught.value.failures[0].stack)


def test_timeout_in_a_single_inline_process():
    with pytest.raises(LaunchTimeout) as caught:
        notebook_launcher(time.sleep, args=(100,), num_processes=1, timeout=1)
    assert caught.value.failures[0].rank == 0


def test_single_process_runs_in_the_caller():
    assert notebook_launcher(os.getpid, num_processes=1) == os.getpid()
    assert notebook_launcher(os.getpid) == os.getpid()  # CPU-only machine: one process


def test_single_process_failure_is_a_launch_error_with_the_original_chained():
    def broken():
        raise ZeroDivisionError("inline")

    with pytest.raises(LaunchError) as caught:
        notebook_launcher(broken, num_processes=1)
    assert isinstance(caught.value.__cause__, ZeroDivisionError)
    assert caught.value.root_cause.exc_type == "ZeroDivisionError"


def listening_addresses():
    """Every listening socket of this worker and of the launching process."""
    import torch.distributed as dist

    dist.barrier()
    found = []
    for process in (psutil.Process(), psutil.Process(os.getppid())):
        for conn in process.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                found.append(conn.laddr.ip)
    dist.barrier()
    return found


@pytest.mark.parametrize("rdzv_backend", ["static", "c10d"])
def test_single_node_listens_on_loopback_only(rdzv_backend):
    addresses = notebook_launcher(listening_addresses, num_processes=2, rdzv_backend=rdzv_backend)
    assert all(ip in ("127.0.0.1", "::1") or ip.startswith("127.") for ip in addresses), addresses


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def master_port():
    return int(os.environ["MASTER_PORT"])


def test_default_port_taken_uses_another():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 29500))
        holder.listen()
        assert notebook_launcher(master_port, num_processes=2) != 29500


def test_named_port_taken_is_an_error_naming_it():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"port {port} .*already in use"):
            notebook_launcher(master_port, num_processes=2, use_port=str(port))


def test_a_port_whose_last_connection_waits_in_time_wait_is_free_for_a_rerun():
    """A launch that just ended leaves its store's connections in TIME-WAIT; the store's own
    listener binds with SO_REUSEADDR, so the same port is free for the next launch."""
    from xlaunch.backends.ports import port_free

    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        accepted, _ = listener.accept()
        assert not port_free("127.0.0.1", port)  # listened on: taken
        accepted.close()  # the side that closes first waits in TIME-WAIT on the port
        client.close()
    assert port_free("127.0.0.1", port)
    assert notebook_launcher(master_port, num_processes=2, use_port=str(port)) == port


@pytest.mark.parametrize("named", ["29500", 29500])
def test_the_default_port_named_explicitly_and_taken_is_an_error_naming_it(named):
    # A port the user named is theirs, the default's number included: no quiet move elsewhere.
    with socket.socket() as holder:
        try:
            holder.bind(("127.0.0.1", 29500))
            holder.listen()
        except OSError:  # already held by another program: taken all the same
            pass
        with pytest.raises(RuntimeError, match=r"port 29500 .*already in use \(use_port='29500'\)"):
            notebook_launcher(master_port, num_processes=2, use_port=named)


def test_named_free_port_is_used():
    port = free_port()
    assert notebook_launcher(master_port, num_processes=2, use_port=str(port)) == port


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_processes": 0}, "num_processes"),
        ({"num_processes": 2, "node_rank": 1}, "node_rank"),
        ({"num_processes": 2, "mixed_precision": "fp8"}, "mixed_precision"),
        ({"num_processes": 2, "rdzv_backend": "zookeeper"}, "rdzv_backend"),
        ({"num_processes": 2, "use_port": "http"}, "use_port"),
        ({"num_processes": 2, "timeout": 0}, "timeout"),
        ({"num_processes": 2, "start_method": "thread"}, "start_method"),
    ],
)
def test_bad_arguments_are_refused_before_any_process_starts(kwargs, message):
    before = {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match=message):
        notebook_launcher(os.getpid, **kwargs)
    after = {child.pid for child in psutil.Process().children(recursive=True)}
    assert after <= before


def test_more_processes_than_gpus_is_refused(monkeypatch):
    monkeypatch.setenv("XLAUNCH_ACCELERATOR", "cuda")  # this machine has none
    with pytest.raises(ValueError, match="GPU"):
        notebook_launcher(os.getpid, num_processes=2)


def test_not_callable_is_a_type_error():
    with pytest.raises(TypeError, match="callable"):
        notebook_launcher("train", num_processes=2)


def test_a_function_defined_in_place_runs_under_spawn():
    # As a notebook cell's function: neither importable nor picklable by name; it travels by value.
    offset = 10

    def defined_inside_a_test(scale):
        import torch.distributed as dist

        value = torch.tensor([float(dist.get_rank() + offset) * scale])
        dist.all_reduce(value)
        return value.item(), os.getpid()

    total, pid = notebook_launcher(defined_inside_a_test, (2.0,), num_processes=2,
                                   start_method="spawn")
    assert total == (10 + 11) * 2.0 and pid != os.getpid()


def test_what_cloudpickle_cannot_send_under_spawn_is_a_type_error_naming_it():
    import threading

    def defined_inside_a_test(lock):
        return 1

    before = {child.pid for child in psutil.Process().children(recursive=True)}
    with pytest.raises(TypeError, match=r"defined_inside_a_test: its args cannot be sent to spawned"):
        notebook_launcher(defined_inside_a_test, (threading.Lock(),), num_processes=2,
                          start_method="spawn")
    assert {child.pid for child in psutil.Process().children(recursive=True)} <= before


def test_spawn_start_method_runs_a_module_function():
    assert notebook_launcher(all_reduce_rank, num_processes=2, start_method="spawn") == 3.0


def test_cuda_initialised_in_the_caller_is_a_fact_the_plan_is_given(monkeypatch):
    # No GPU exists here: stand in for CUDA's own flag, the one thing that cannot be real.
    from xlaunch.detect import Environment, Machine
    from xlaunch.plan import LaunchOptions, make_plan

    assert not Machine.here().cuda_initialised
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    here = Machine.here()
    assert here.cuda_initialised
    gpus = Environment("local", "cuda", 2)
    with pytest.raises(RuntimeError, match="start_method='fork': CUDA is already initialised"):
        make_plan(gpus, LaunchOptions(start_method="fork"), here, {})
    assert make_plan(gpus, LaunchOptions(), here, {}).spec.start_method == "spawn"


def unpicklable_result():
    return lambda: 1


def test_unpicklable_return_value_is_reported():
    with pytest.raises(LaunchError, match="cannot be sent back"):
        notebook_launcher(unpicklable_result, num_processes=2)


def run_script(tmp_path, body, *args, env=None, timeout=120):
    script = tmp_path / "launch_script.py"
    script.write_text(textwrap.dedent(body))
    full_env = {**os.environ, "XLAUNCH_ACCELERATOR": "cpu", **(env or {})}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def test_output_is_prefixed_with_the_rank(tmp_path):
    done = run_script(tmp_path, """
        import xlaunch
        def hello():
            import logging, torch.distributed as dist
            logging.basicConfig(level=logging.INFO)
            print("hello from", dist.get_rank())
            logging.getLogger("train").info("logged by %d", dist.get_rank())
        xlaunch.notebook_launcher(hello, num_processes=2)
    """)
    assert done.returncode == 0, done.stderr
    assert "[rank 0] hello from 0" in done.stdout and "[rank 1] hello from 1" in done.stdout
    assert "[rank 1] INFO:train:logged by 1" in done.stderr


def test_log_line_prefix_template_reaches_the_engine(tmp_path):
    done = run_script(tmp_path, """
        import xlaunch
        def hello():
            import torch.distributed as dist
            print("hello from", dist.get_rank())
        xlaunch.notebook_launcher(hello, num_processes=2, log_line_prefix_template="<${rank}> ")
    """)
    assert done.returncode == 0, done.stderr
    assert "<0> hello from 0" in done.stdout and "<1> hello from 1" in done.stdout


def test_sigint_stops_every_worker_and_the_next_launch_works(tmp_path):
    script = tmp_path / "interrupted.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, time, xlaunch
        # Ctrl-C raises KeyboardInterrupt, as in a notebook, even if this started with it ignored
        signal.signal(signal.SIGINT, signal.default_int_handler)
        def sleeper():
            open(os.path.join({str(tmp_path)!r}, "pid-" + os.environ["RANK"]), "w").write(str(os.getpid()))
            time.sleep(100)
        def quick():
            import torch.distributed as dist
            return dist.get_world_size()
        try:
            xlaunch.notebook_launcher(sleeper, num_processes=2)
        except KeyboardInterrupt:
            print("interrupted", flush=True)
        print("relaunch", xlaunch.notebook_launcher(quick, num_processes=2), flush=True)
        try:
            xlaunch.notebook_launcher(sleeper, num_processes=2)
        except KeyboardInterrupt:
            print("interrupted again", flush=True)
    """))
    env = {**os.environ, "XLAUNCH_ACCELERATOR": "cpu"}
    launcher = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=env)
    try:
        worker_pids = []
        for _ in range(2):
            pid_files = [tmp_path / "pid-0", tmp_path / "pid-1"]
            deadline = time.monotonic() + 60
            while not all(p.exists() and p.read_text() for p in pid_files):
                assert time.monotonic() < deadline, "workers never started"
                time.sleep(0.05)
            worker_pids += [int(p.read_text()) for p in pid_files]
            for p in pid_files:
                p.unlink()
            launcher.send_signal(2)
        out, err = launcher.communicate(timeout=60)
    finally:
        launcher.kill()
    assert "interrupted\nrelaunch 2\ninterrupted again" in out, err
    for pid in worker_pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == "zombie"


def run_two_nodes(script):
    """Two launcher processes on this machine, node ranks 0 and 1: (stdout, stderr) of each."""
    env = {**os.environ, "XLAUNCH_ACCELERATOR": "cpu"}
    nodes = [subprocess.Popen([sys.executable, str(script), str(rank)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for rank in (0, 1)]
    try:
        return [node.communicate(timeout=150) for node in nodes]
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.kill()
        pytest.fail(f"the nodes did not finish: {[node.communicate() for node in nodes]}")
    finally:
        for node in nodes:
            node.kill()


def test_two_nodes_form_one_world(tmp_path):
    port = free_port()
    script = tmp_path / "node.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch, xlaunch
        def world():
            import torch.distributed as dist
            total = torch.tensor([float(dist.get_rank())])
            dist.all_reduce(total)
            return dist.get_rank(), dist.get_world_size(), total.item()
        node_rank = int(sys.argv[1])
        print("result", xlaunch.notebook_launcher(
            world, num_processes=2, num_nodes=2, node_rank=node_rank, rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:{port}", rdzv_id="two-nodes", timeout=120))
    """))
    outputs = run_two_nodes(script)
    lines = [line for out, _ in outputs for line in out.splitlines()]
    results = sorted(line for line in lines if line.startswith("result"))
    assert len(results) == 2, outputs
    # Each node returns its own local rank 0: global ranks 0 and 2 of a world of 4; 0+1+2+3 = 6.
    assert results == ["result (0, 4, 6.0)", "result (2, 4, 6.0)"]
    # c10d numbers the machines as they arrive: the launch line cannot say which node this is,
    # the rendezvous does once they meet (the node_rank given is not what places a machine).
    placed = sorted(line for _, err in outputs for line in err.splitlines()
                    if "rendezvous made this machine" in line)
    assert placed == ["xlaunch: the c10d rendezvous made this machine node 0 of 2, ranks 0-1",
                      "xlaunch: the c10d rendezvous made this machine node 1 of 2, ranks 2-3"], \
        outputs
    assert all("as one of 2 nodes (torch elastic's c10d rendezvous numbers them)" in err
               for _, err in outputs), outputs


LONELY_NODE = """
import sys, xlaunch
def nothing():
    return 1
timeout = float(sys.argv[2]) if len(sys.argv) > 2 else None
xlaunch.notebook_launcher(nothing, num_processes=1, num_nodes=2, rdzv_backend="c10d",
                          rdzv_endpoint=sys.argv[1], rdzv_id="alone", timeout=timeout)
"""


def lonely_node(tmp_path, *arguments):
    """One node of two, started alone: nobody else ever reaches its rendezvous."""
    script = tmp_path / "lonely.py"
    script.write_text(LONELY_NODE)
    return subprocess.Popen([sys.executable, str(script), f"127.0.0.1:{free_port()}", *arguments],
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "XLAUNCH_ACCELERATOR": "cpu"})


def test_a_node_waiting_for_the_others_says_where_and_for_how_long_within_its_timeout(tmp_path):
    started = time.monotonic()
    node = lonely_node(tmp_path, "8")
    try:
        _, err = node.communicate(timeout=120)
    finally:
        node.kill()
    waiting = [line for line in err.splitlines() if "waiting for the 2 nodes to meet at" in line]
    assert waiting and "127.0.0.1:" in waiting[0], err
    assert "c10d rendezvous" in waiting[0] and "gives up after 8 s" in waiting[0], err
    assert "LaunchTimeout" in err and time.monotonic() - started < 8 + 20, err


def test_without_a_timeout_a_waiting_node_says_so_and_names_the_engines_bound(tmp_path):
    for _ in range(3):  # a free port another test took before the store bound it: another port
        node = lonely_node(tmp_path)
        lines: list[str] = []
        reader = threading.Thread(target=lines.extend, args=(node.stderr,), daemon=True)
        reader.start()
        try:
            deadline = time.monotonic() + 60
            while (time.monotonic() < deadline and node.poll() is None
                   and not any("waiting for" in line for line in lines)):
                time.sleep(0.2)
        finally:
            node.kill()
            node.wait()
            reader.join(5)
        if not any("EADDRINUSE" in line or "address already in use" in line.lower()
                   for line in lines):
            break
    waiting = [line for line in lines if "waiting for the 2 nodes to meet at 127.0.0.1:" in line]
    assert waiting, "".join(lines)
    assert "gives up after 600 s (torch elastic's own bound" in waiting[0], waiting
    assert "rdzv_conf={'join_timeout': seconds}" in waiting[0], waiting


def precision_in_worker():
    state = xlaunch.ProcessState()
    with state.autocast():
        product = torch.ones(4, 4) @ torch.ones(4, 4)
    return state.mixed_precision, state.process_index, state.num_processes, product.dtype


@pytest.mark.parametrize("launcher_kwargs", [{"num_processes": 2}, {"num_processes": 1}])
def test_mixed_precision_takes_effect_in_the_workers(launcher_kwargs):
    precision, index, count, dtype = notebook_launcher(precision_in_worker, mixed_precision="bf16",
                                                       **launcher_kwargs)
    assert (precision, index, count, dtype) == ("bf16", 0, launcher_kwargs["num_processes"],
                                                torch.bfloat16)
    assert os.environ.get("XLAUNCH_MIXED_PRECISION") is None  # the caller is left as it was


def test_state_made_before_the_launch_reports_each_workers_rank(tmp_path):
    state = xlaunch.ProcessState()
    assert (state.process_index, state.num_processes) == (0, 1)

    def record():
        (tmp_path / f"rank-{state.process_index}").write_text(str(state.num_processes))

    notebook_launcher(record, num_processes=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank-0", "rank-1"]
    assert (tmp_path / "rank-1").read_text() == "2"


def test_the_launch_says_what_it_runs(capfd):
    notebook_launcher(os.getpid, num_processes=2)
    err = capfd.readouterr().err
    assert "xlaunch: launching 2 CPU processes through torch.multiprocessing (gloo, fork)" in err
    notebook_launcher(os.getpid)
    err = capfd.readouterr().err
    assert "running 1 process on the CPU" in err and "launching 1 CPU process in this process" in err


def cpu_threads():
    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def test_cpu_processes_share_the_cores_instead_of_each_taking_all(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    expected = max(1, (os.cpu_count() or 1) // 2)
    assert notebook_launcher(cpu_threads, num_processes=2) == (expected, str(expected))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's own setting wins
    assert notebook_launcher(cpu_threads, num_processes=2)[1] == "1"


def killed_while_peer_waits():
    import signal

    import torch.distributed as dist

    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    xlaunch.wait_for_everyone()


@pytest.mark.timeout(120)
def test_a_rank_killed_by_a_signal_is_the_root_cause_not_its_peers_error():
    with pytest.raises(LaunchError) as caught:
        debug_launcher(killed_while_peer_waits, timeout=60)
    root = caught.value.root_cause
    assert root.rank == 1 and root.exc_type is None
    assert "without raising a Python exception" in str(caught.value)
    assert all(f.secondary for f in caught.value.failures[1:])


def test_partial_lines_are_prefixed_once():
    import io

    from xlaunch.worker.rank import PrefixedStream

    out = io.StringIO()
    stream = PrefixedStream(out, "[rank 0] ")
    for piece in ("50%", None, "\r", "100%", None, "\n", "a\nb", None, "c\n"):
        stream.flush() if piece is None else stream.write(piece)
    assert out.getvalue() == "[rank 0] 50%\r[rank 0] 100%\n[rank 0] a\n[rank 0] bc\n"
    stream.write("\r")  # how tqdm starts each redraw
    stream.write("bar 1")
    stream.flush()
    stream.write("\rbar 2\n")
    assert out.getvalue().endswith("[rank 0] bc\n\r[rank 0] bar 1\r[rank 0] bar 2\n")


def test_two_nodes_meet_without_naming_a_run(tmp_path):
    port = free_port()
    script = tmp_path / "node.py"
    script.write_text(textwrap.dedent(f"""
        import sys, xlaunch
        def world():
            import torch.distributed as dist
            return dist.get_world_size()
        print("result", xlaunch.notebook_launcher(world, num_processes=1, num_nodes=2,
              node_rank=int(sys.argv[1]), use_port="{port}", timeout=60))
    """))
    outputs = run_two_nodes(script)
    assert [out.strip().splitlines()[-1] if out.strip() else err for out, err in outputs] == \
        ["result 2", "result 2"]


@pytest.mark.timeout(120)
def test_timeout_ends_a_wait_for_nodes_that_never_come():
    port = free_port()
    with pytest.raises(LaunchTimeout, match="no worker had started"):
        notebook_launcher(os.getpid, num_processes=1, num_nodes=2, node_rank=0,
                          use_port=str(port), timeout=3)


@pytest.mark.parametrize("base", ["temp", "shared memory"])
def test_a_killed_launchers_directory_is_swept_by_the_next_process_to_launch(tmp_path, base):
    import tempfile

    folder = tempfile.gettempdir() if base == "temp" else "/dev/shm"
    if not os.access(folder, os.W_OK):
        pytest.skip(f"no {folder} here")
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(done.stdout)  # a process that has exited: its directory is a leftover
    leftover = Path(tempfile.mkdtemp(prefix=f"xlaunch-{dead_pid}-", dir=folder))
    mine = Path(tempfile.mkdtemp(prefix=f"xlaunch-{os.getpid()}-", dir=folder))  # a live one's
    try:
        done = run_script(tmp_path, """
            import os, xlaunch
            xlaunch.notebook_launcher(os.getpid, num_processes=2)  # this process's first launch
        """)
        assert done.returncode == 0, done.stderr[-2000:]
        assert not leftover.exists() and mine.exists()
    finally:
        mine.rmdir()


def test_a_logging_configuration_made_before_the_launch_keeps_the_rank(tmp_path):
    """basicConfig in the caller: its handler holds the caller's stderr, yet every worker's log
    line carries its rank (the handler is rebound in the worker; the caller's is untouched)."""
    done = run_script(tmp_path, """
        import logging, sys, xlaunch
        logging.basicConfig(format="%(levelname)s %(message)s", level=logging.INFO)
        def logs():
            logging.info("logged by %d", xlaunch.ProcessState().process_index)
        xlaunch.notebook_launcher(logs, num_processes=2)
        assert logging.getLogger().handlers[0].stream is sys.stderr
        logging.info("logged by the caller")
    """)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] INFO logged by {rank}\n" in done.stderr, done.stderr
    assert "\nINFO logged by the caller\n" in done.stderr


def test_outside_a_kernel_print_output_is_as_before(tmp_path):
    """Displays travel only from a kernel's workers: a script's output is untouched (no live
    lines, carriage returns kept, every line prefixed)."""
    done = run_script(tmp_path, """
        import sys, xlaunch
        def prints():
            rank = xlaunch.ProcessState().process_index
            print(f"line of {rank}")
            for step in range(3):
                sys.stdout.write(f"\\rstep {step} of {rank}")
                sys.stdout.flush()
            print()
        xlaunch.notebook_launcher(prints, num_processes=2)
    """)
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        assert f"[rank {rank}] line of {rank}\n" in done.stdout, done.stdout
        assert f"[rank {rank}] step 0 of {rank}" in done.stdout
        assert f"[rank {rank}] step 2 of {rank}" in done.stdout
    # Every piece prefixed with its own rank (a terminal may still mix two ranks' redraws on
    # one line, as before), nothing folded.
    assert done.stdout.count("[rank ") == 8 and "[ranks" not in done.stdout, done.stdout
