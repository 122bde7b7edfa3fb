#!/usr/bin/env bash
# The main job: show this machine as xlaunch sees it, then train a small model across its
# processes (every TPU core, every GPU, or 2 CPU processes here) and check that ranks agree.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
# The venvs are shared by every checkout on this machine: this checkout's code comes first.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

PY=$(make_venv demo requirements/demo.txt)
install_here "$PY"
BIN=$(dirname "$PY")
"$BIN/xlaunch" env
"$BIN/xlaunch" demo "$@"
