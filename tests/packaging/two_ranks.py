"""Run by scripts/package_check.sh as `xlaunch run --num-processes 2 two_ranks.py`, from a fresh
venv holding only the built wheel and torch: the installed package forms the group and runs it.

Not collected by pytest (no test_ prefix): it is a user's script, and the check reads its output.
"""

import torch
import torch.distributed as dist

import xlaunch

state = xlaunch.ProcessState()
total = torch.tensor([float(state.process_index + 1)])
dist.all_reduce(total)  # 1 + 2 = 3 when both ranks took part
print(f"rank {state.process_index} of {state.num_processes}: sum {total.item():g}, "
      f"backend {state.backend}, xlaunch from {xlaunch.__file__}")
