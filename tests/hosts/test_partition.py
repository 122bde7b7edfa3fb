"""A host cut off from the others: ``timeout=`` ends the launch on every host, the cut-off one
included, and nothing waits for the link to come back (issue 33)."""

from __future__ import annotations

import time

import pytest

from tests.hosts.netns import PYTHON, node_env, wait_for

pytestmark = pytest.mark.timeout(240)

NODE = '''
import sys, time, xlaunch
from pathlib import Path

node_rank, folder, timeout = int(sys.argv[1]), Path(sys.argv[2]), float(sys.argv[3])

def train():
    import torch, torch.distributed as dist
    total = torch.ones(1)
    dist.all_reduce(total)  # every host has joined
    (folder / f"joined-{dist.get_rank()}").touch()
    time.sleep(300)

started = time.monotonic()
try:
    xlaunch.notebook_launcher(train, num_processes=1, num_nodes=2, node_rank=node_rank,
                              master_addr="10.77.0.1", use_port="29512", rdzv_id="cut",
                              timeout=timeout)
except BaseException as error:
    print("ended by", type(error).__name__, str(error).splitlines()[0], flush=True)
print(f"returned after {time.monotonic() - started:.1f} s", flush=True)
'''


def returned_after(output: str) -> float:
    return float(output.split("returned after ")[1].split(" s")[0])


def test_a_host_cut_off_mid_run_ends_within_its_timeout_on_every_host(hosts, tmp_path):
    script = tmp_path / "node.py"
    script.write_text(NODE)
    timeout = 20.0
    nodes = [host.start(PYTHON, str(script), str(rank), str(tmp_path), str(timeout),
                        env=node_env()) for rank, host in enumerate(hosts)]
    assert wait_for([tmp_path / "joined-0", tmp_path / "joined-1"], 60), \
        [node.communicate(timeout=5) for node in nodes]
    hosts[1].cut_off()
    cut = time.monotonic()
    outputs = []
    for node in nodes:
        # The bound the issue sets: the timeout, the stop's grace (3 s), a few seconds more.
        limit = timeout + 3 + 10
        try:
            outputs.append(node.communicate(timeout=max(1.0, limit - (time.monotonic() - cut))))
        except Exception:
            hosts[1].reconnect()
            pytest.fail(f"a host had not returned {limit:g} s after the cut: "
                        f"{[n.communicate(timeout=60) for n in nodes]}")
    for out, err in outputs:
        assert "ended by LaunchTimeout" in out, (out, err)
        assert returned_after(out) < 60 + timeout + 13, (out, err)
    # Each names what it waited for: the cut-off host its store, the other the silent host.
    assert "; no answer from the rendezvous store at 10.77.0.1:" in outputs[1][0], outputs[1]
    assert "; node 1 (host xlhost2) not heard from through the store for " in outputs[0][0], \
        outputs[0]
