"""Two simulated hosts (network namespaces), a launch on each, as a user runs several machines:
static and c10d meetings, a late host, a rank raising, a host's launcher killed, a restart, a
rerun on the same port, an endpoint where nobody listens."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.hosts.netns import PYTHON, Host, node_env, wait_for

pytestmark = pytest.mark.timeout(240)

NODE = '''
import os, sys, time, xlaunch
from pathlib import Path

scenario, node_rank, folder = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
options = dict(num_processes=2, num_nodes=2, node_rank=node_rank, timeout=60,
               master_addr="10.77.0.1", use_port="29514", rdzv_id=scenario)
if scenario in ("c10d", "restart"):
    options.update(rdzv_backend="c10d", rdzv_endpoint="10.77.0.1:29515")
if scenario == "restart":
    options.update(max_restarts=1)
if scenario == "dead-endpoint":
    options.update(rdzv_backend="c10d", rdzv_endpoint="10.77.0.1:29516", timeout=10)
if scenario == "dead-master":  # static: nobody listens at master_addr (or no longer does)
    options.update(use_port="29517", timeout=10)
if scenario == "master-alone":  # node 0, whose launch ends before the other node comes
    options.update(use_port="29517", timeout=3)
if scenario == "loopback":
    del options["master_addr"]
    options.update(timeout=5)

def train():
    import torch, torch.distributed as dist
    state = xlaunch.ProcessState()
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    (folder / f"joined-{dist.get_rank()}-{state.restart_count}").touch()
    if scenario == "raise" and dist.get_rank() == 3:
        raise RuntimeError("rank three gives up")
    if scenario == "restart" and dist.get_rank() == 3 and state.restart_count == 0:
        raise RuntimeError("first attempt fails")
    while scenario == "killed":  # training: a collective every step
        dist.all_reduce(total)
        time.sleep(0.05)
    dist.barrier()
    return dist.get_world_size(), total.item(), state.restart_count

started = time.monotonic()
try:
    print("result", xlaunch.notebook_launcher(train, **options), flush=True)
except BaseException as error:
    print("ended by", type(error).__name__, str(error), flush=True)
print(f"returned after {time.monotonic() - started:.1f} s", flush=True)
'''


def launch(hosts: list[Host], tmp_path, scenario: str, delay: float = 0.0) -> list[tuple[str, str]]:
    script = tmp_path / "node.py"
    script.write_text(NODE)
    nodes = []
    for rank, host in enumerate(hosts):
        if rank and delay:
            time.sleep(delay)
        nodes.append(host.start(PYTHON, str(script), scenario, str(rank), str(tmp_path),
                                env=node_env()))
    return [node.communicate(timeout=150) for node in nodes]


def returned_after(output: str) -> float:
    return float(output.split("returned after ")[1].split(" s")[0])


@pytest.mark.parametrize("scenario", ["static", "c10d"])
def test_two_hosts_form_one_world(hosts, tmp_path, scenario):
    outputs = launch(hosts, tmp_path, scenario)
    for out, err in outputs:
        assert "result (4, 6.0, 0)" in out, (out, err)
    if scenario == "c10d":  # each host says where the rendezvous put it, once it has
        said = sorted(line for _, err in outputs for line in err.splitlines()
                      if "the c10d rendezvous made this machine node" in line)
        assert said == ["xlaunch: the c10d rendezvous made this machine node 0 of 2, ranks 0-1",
                        "xlaunch: the c10d rendezvous made this machine node 1 of 2, ranks 2-3"
                        ], outputs
        assert all("as one of 2 nodes" in err for _, err in outputs), outputs


def test_a_host_that_starts_late_is_waited_for(hosts, tmp_path):
    outputs = launch(hosts, tmp_path, "static", delay=8)
    for out, err in outputs:
        assert "result (4, 6.0, 0)" in out, (out, err)
    assert "waiting for the 2 nodes to meet at 10.77.0.1:29514" in outputs[0][1], outputs[0]


def test_a_rank_raising_on_one_host_ends_both_with_its_traceback_there(hosts, tmp_path):
    (out0, err0), (out1, err1) = launch(hosts, tmp_path, "raise")
    assert "ended by LaunchError" in out1 and "rank three gives up" in out1, (out1, err1)
    assert "ended by LaunchError" in out0, (out0, err0)
    assert returned_after(out0) < 40 and returned_after(out1) < 40, (out0, out1)


def test_a_hosts_launcher_killed_ends_the_other_hosts_launch_and_leaves_nothing(hosts, tmp_path):
    script = tmp_path / "node.py"
    script.write_text(NODE)
    nodes = [host.start(PYTHON, str(script), "killed", str(rank), str(tmp_path), env=node_env())
             for rank, host in enumerate(hosts)]
    assert wait_for([tmp_path / f"joined-{rank}-0" for rank in range(4)], 60), \
        [node.communicate(timeout=5) for node in nodes]
    os.kill(nodes[1].pid, signal.SIGKILL)  # `ip netns exec` runs the launcher in its own place
    killed = time.monotonic()
    out, err = nodes[0].communicate(timeout=60)
    assert "ended by LaunchError" in out, (out, err)
    assert time.monotonic() - killed < 30, (out, err)
    nodes[1].wait(timeout=30)
    # Nothing of host 2's launch is left: its workers went with their launcher's guard.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and hosts[1].running():
        time.sleep(0.2)
    assert not hosts[1].running(), hosts[1].running()


def test_a_failed_first_attempt_restarts_every_host(hosts, tmp_path):
    for out, err in launch(hosts, tmp_path, "restart"):
        assert "result (4, 6.0, 1)" in out, (out, err)


def test_a_rerun_on_the_same_port_right_after_works(hosts, tmp_path):
    for attempt in range(2):
        for out, err in launch(hosts, tmp_path, "static"):
            assert "result (4, 6.0, 0)" in out, (attempt, out, err)


def test_an_endpoint_where_nobody_listens_ends_within_the_timeout(hosts, tmp_path):
    host = hosts[0]
    script = tmp_path / "node.py"
    script.write_text(NODE)
    started = time.monotonic()
    out, err = host.start(PYTHON, str(script), "dead-endpoint", "0", str(tmp_path),
                          env=node_env()).communicate(timeout=120)
    assert "ended by" in out and time.monotonic() - started < 10 + 3 + 15, (out, err)


def test_a_host_reaching_a_c10d_endpoint_where_nobody_listens_says_so_and_ends_in_time(
        hosts, tmp_path):
    """Host 2 meets at host 1's address, where no launch runs: while torch's c10d handler tries
    to reach the store it says so, and how long each try lasts (before, it said the meeting's
    bound, which does not apply until the store answers)."""
    script = tmp_path / "node.py"
    script.write_text(NODE)
    started = time.monotonic()
    out, err = hosts[1].start(PYTHON, str(script), "dead-endpoint", "1", str(tmp_path),
                              env=node_env()).communicate(timeout=120)
    assert "ended by LaunchTimeout" in out, (out, err)
    # The timeout, the grace, a few seconds (interpreter and torch's import included): torch's
    # store connecting tries again after its own 10 s, which the launch does not wait out.
    assert time.monotonic() - started < 10 + 3 + 6, (out, err)
    assert "(no worker had started yet); it was waiting for the 2 nodes to meet at " \
           "10.77.0.1:29516 (torch elastic's c10d rendezvous, whose store there had not " \
           "answered)" in out, out
    assert "waiting for the 2 nodes to meet at 10.77.0.1:29516 (torch elastic's c10d " \
           "rendezvous, 5 s so far); it has had no answer yet from its store there (each try " \
           "to reach it gives up after 10 s" in err, err



def run_node(host: Host, tmp_path, scenario: str, node_rank: int) -> tuple[str, str, float]:
    script = tmp_path / "node.py"
    script.write_text(NODE)
    started = time.monotonic()
    out, err = host.start(PYTHON, str(script), scenario, str(node_rank), str(tmp_path),
                          env=node_env()).communicate(timeout=120)
    return out, err, time.monotonic() - started


def test_a_static_master_where_nobody_listens_ends_within_the_timeout_naming_it(hosts, tmp_path):
    out, err, took = run_node(hosts[1], tmp_path, "dead-master", 1)
    assert "ended by LaunchTimeout" in out, (out, err)
    assert took < 10 + 3 + 6, (out, err)
    assert "it was waiting for the 2 nodes to meet at 10.77.0.1:29517 (torch elastic's static " \
           "rendezvous)" in out, out


def test_a_node_whose_master_already_ended_ends_within_its_timeout(hosts, tmp_path):
    out, err, _ = run_node(hosts[0], tmp_path, "master-alone", 0)
    assert "ended by LaunchTimeout" in out, (out, err)
    out, err, took = run_node(hosts[1], tmp_path, "dead-master", 1)
    assert "ended by LaunchTimeout" in out, (out, err)
    assert took < 10 + 3 + 6, (out, err)


def test_several_nodes_at_the_default_loopback_address_are_told_so(hosts, tmp_path):
    out, err, _ = run_node(hosts[1], tmp_path, "loopback", 1)
    assert "ended by LaunchTimeout" in out, (out, err)
    assert "xlaunch: master_addr=127.0.0.1 is this machine's loopback: the 2 nodes can meet " \
           "only if they all run here" in err, err
