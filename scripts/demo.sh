#!/usr/bin/env bash
# The main job: show this machine as xlaunch sees it, then train a small model across its
# processes (every TPU core, every GPU, or 2 CPU processes here) and check that ranks agree.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh

PY=$(checkout_venv demo requirements/demo.txt)
BIN=$(dirname "$PY")
"$BIN/xlaunch" env
"$BIN/xlaunch" demo "$@"
