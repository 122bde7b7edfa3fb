#!/usr/bin/env bash
# The CUDA path on a machine with GPUs (for maintainers, and a lent GPU machine): xlaunch env,
# xlaunch check (a real NCCL group, one GPU included), the demo, a count above the GPUs refused,
# bf16 autocast on CUDA, a CPU launch on this GPU machine on the CPU, and the core suite with the
# GPUs present, and a launch after CUDA was initialised (spawned by default, fork refused by name).
# Its own venv, as scripts/test.sh makes them: torch from the registry, a CUDA build. On a machine
# that cannot reach the registry (a lent GPU machine), XLAUNCH_CUDA_PYTHON=/path/to/python uses
# that Python's own torch instead (this checkout installed into it without its dependencies; the
# suite's step needs pytest, psutil and cloudpickle there, and says so where they are missing).
# Without nvidia-smi there is nothing to check: it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "no GPU: nothing to check"
  exit 0
fi
. scripts/_venv.sh

if [ -n "${XLAUNCH_CUDA_PYTHON:-}" ]; then
  PY=$XLAUNCH_CUDA_PYTHON
  install_here "$PY"
else
  PY=$(checkout_venv cuda requirements/cuda.txt)
fi
BIN=$(dirname "$PY")
status=0
step() {  # step NAME COMMAND...: run it, say ok or FAILED, keep going
  echo "=== $1"; shift
  if "$@"; then echo "=== ok"; else echo "=== FAILED: $*"; status=1; fi
}

nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
GPUS=$("$PY" -c '
import torch
assert torch.version.cuda, f"torch {torch.__version__} is not a CUDA build"
assert torch.cuda.is_available(), "torch sees no GPU"
print(torch.cuda.device_count())')
echo "torch sees $GPUS GPU(s)"

step "xlaunch env" "$BIN/xlaunch" env
step "xlaunch check (every GPU, NCCL; one GPU: a group of one)" "$BIN/xlaunch" check
step "xlaunch demo" "$BIN/xlaunch" demo --timeout 300

# shellcheck disable=SC2329  # called through step
refused() {  # more processes than GPUs: refused before anything starts (exit 2), saying so
  local out code=0
  out=$("$BIN/xlaunch" env --num-processes "$((GPUS + 1))" 2>&1) || code=$?
  [ "$code" = 2 ] && grep -q "more processes than this machine has GPUs" <<<"$out"
}
step "$((GPUS + 1)) processes on $GPUS GPU(s) refused" refused

step "bf16 autocast on CUDA (one process, and every GPU)" "$PY" -c '
import torch, xlaunch
def train():
    state = xlaunch.ProcessState()
    x = torch.ones(8, 8, device=state.device)
    with state.autocast():
        y = x @ x
    return str(state.device), str(y.dtype)
for count in sorted({1, torch.cuda.device_count()}):
    seen = xlaunch.notebook_launcher(train, num_processes=count, mixed_precision="bf16")
    assert seen == ("cuda:0", "torch.bfloat16"), (count, seen)
'

step "a CPU launch on this GPU machine is on the CPU (debug_launcher, XLAUNCH_ACCELERATOR=cpu)" \
  env XLAUNCH_ACCELERATOR=cpu "$PY" -c '
import torch, xlaunch
def train():
    state = xlaunch.ProcessState()
    with state.autocast():
        y = torch.ones(8, 8) @ torch.ones(8, 8)
    return str(state.device), str(y.dtype)
for count in (1, 2):
    assert xlaunch.debug_launcher(train, num_processes=count) == ("cpu", "torch.float32")
    seen = xlaunch.notebook_launcher(train, num_processes=count, mixed_precision="bf16")
    assert seen == ("cpu", "torch.bfloat16"), (count, seen)
'
step "xlaunch check, one CPU process, on this GPU machine (a gloo group of one)" \
  env XLAUNCH_ACCELERATOR=cpu "$BIN/xlaunch" check --num-processes 1

step "after CUDA was initialised: the default launch spawns, fork asked for by name is refused" \
  "$PY" -c '
import torch, xlaunch
torch.cuda.init()
def device():
    return str(xlaunch.ProcessState().device)
assert xlaunch.notebook_launcher(device, num_processes=torch.cuda.device_count()) == "cuda:0"
try:
    xlaunch.notebook_launcher(device, num_processes=torch.cuda.device_count(), start_method="fork")
except (ValueError, RuntimeError) as refused:
    assert "CUDA" in str(refused), refused
else:
    assert torch.cuda.device_count() == 1, "a forked launch after CUDA was initialised ran"
'

if "$PY" -c 'import pytest, psutil, cloudpickle' 2>/dev/null; then
  step "core tests (GPUs present)" "$PY" -m pytest tests --ignore=tests/xla --ignore=tests/notebooks \
    --ignore=tests/torch_tpu --ignore=tests/browser --ignore=tests/hosts -q -p no:cacheprovider
else
  echo "=== core tests SKIPPED: $PY lacks pytest, psutil or cloudpickle"
  status=1
fi

exit "$status"
