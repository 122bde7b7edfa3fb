"""Hosts that ask for different numbers of processes are refused at the rendezvous, on every
host, each told every host's count (issue 33): before, both waited in a barrier until the
timeout, each numbering its ranks in a different world."""

from __future__ import annotations

import time

import pytest

from tests.hosts.netns import PYTHON, node_env

pytestmark = pytest.mark.timeout(240)

NODE = '''
import sys, time, xlaunch

def train():
    import torch.distributed as dist
    dist.barrier()
    return dist.get_world_size()

started = time.monotonic()
try:
    print("result", xlaunch.notebook_launcher(
        train, num_processes=int(sys.argv[2]), num_nodes=2, node_rank=int(sys.argv[1]),
        master_addr="10.77.0.1", use_port="29513", rdzv_id="counts", timeout=90))
except BaseException as error:
    print("ended by", type(error).__name__, str(error), flush=True)
print(f"returned after {time.monotonic() - started:.1f} s", flush=True)
'''


def test_hosts_with_different_process_counts_are_refused_on_every_host(hosts, tmp_path):
    script = tmp_path / "node.py"
    script.write_text(NODE)
    started = time.monotonic()
    nodes = [host.start(PYTHON, str(script), str(rank), str(count), env=node_env())
             for rank, (host, count) in enumerate(zip(hosts, (2, 1), strict=True))]
    outputs = [node.communicate(timeout=120) for node in nodes]
    for out, err in outputs:
        assert "ended by LaunchError" in out, (out, err)
        assert "different numbers of processes (node 0: 2, node 1: 1)" in out, (out, err)
    assert time.monotonic() - started < 60, outputs  # at the meeting, not at the timeout (90 s)
