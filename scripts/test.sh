#!/usr/bin/env bash
# The whole test suite, in tiers: lint and types, core tests (torch CPU; then torch 2.8, the floor,
# and 2.15, the newest: XLAUNCH_SKIP_TORCH_RELEASES=1 skips those two), several hosts in network
# namespaces, notebooks in a real
# Jupyter kernel, the docs build, the package as built and installed, the torch_xla tiers (2.9,
# and 2.8 as Kaggle's TPU image pins it), the TorchTPU tier and the browser tier (JupyterLab in
# headless Chromium), each in its own venv.
# Tiers on their own: XLAUNCH_SKIP_TORCH_RELEASES=1, XLAUNCH_SKIP_XLA=1, XLAUNCH_SKIP_TORCH_TPU=1 and
# XLAUNCH_SKIP_BROWSER=1 leave theirs out; XLAUNCH_ONLY_BROWSER=1 runs the browser tier alone.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh

status=0
run_tier() {  # run_tier NAME COMMAND...: pytest's "no tests collected" (5) is a failure here too
  echo "=== $1"; shift
  if ! "$@"; then echo "=== FAILED: $*"; status=1; fi
}

# The browser tier: JupyterLab (from PyPI) in Debian's headless Chromium, driven by selenium through
# Debian's chromedriver, shows each rank's tqdm.auto bar (tests/browser). Chromium comes from
# Debian's packages, installed here when missing (as root); no tool downloads a browser. Where it
# cannot be installed the tier says so loudly and runs nothing.
browser_tier() {
  local why="" log bpy
  if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if [ "$(id -u)" != 0 ]; then
      why="chromium and chromium-driver are not installed, and installing them needs root"
    elif ! command -v apt-get >/dev/null; then
      why="chromium and chromium-driver are not installed, and there is no apt-get"
    else
      echo "[setup] apt-get install chromium chromium-driver (first run only)" >&2
      log=$(mktemp)
      if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
               apt-get install -y -q chromium chromium-driver; } >"$log" 2>&1; then
        tail -n 5 "$log" >&2
        why="apt-get install -y chromium chromium-driver failed"
      fi
      rm -f "$log"
    fi
  fi
  if [ -n "$why" ]; then
    echo "=== browser tier SKIPPED: $why"
    return
  fi
  bpy=$(checkout_venv browser requirements/browser.txt)
  run_tier "browser tier (JupyterLab $("$bpy" -c 'import jupyterlab; print(jupyterlab.__version__)'), $(chromium --version 2>/dev/null | head -n 1), headless)" \
    "$bpy" -m pytest tests/browser -q -p no:cacheprovider
}
if [ "${XLAUNCH_ONLY_BROWSER:-0}" = 1 ]; then
  browser_tier
  exit $status
fi

PY=$(checkout_venv dev requirements/dev.txt)
BIN=$(dirname "$PY")

run_tier "lint (ruff)" "$BIN/ruff" check src tests bench
run_tier "types (mypy)" "$BIN/mypy"
run_tier "core tests (torch $("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))'))" \
  "$PY" -m pytest tests --ignore=tests/xla --ignore=tests/notebooks --ignore=tests/torch_tpu --ignore=tests/browser --ignore=tests/hosts -q -p no:cacheprovider
# The same core tests on the other torch releases a user may have: the floor pyproject declares
# (2.8.0) and the newest on the registry (2.15.0). The registry has only CUDA builds of them (about
# 6 GB a venv, built once); they run on the CPU here. This machine's pip config caps torch at
# 2.14.1: a release above it brings its own constraints file, which PIP_CONSTRAINT puts in place of
# the config's (only while its venv is built).
torch_release_tier() {  # torch_release_tier NAME REQUIREMENTS WHAT [CONSTRAINTS]
  local rpy version
  rpy=$(if [ -n "${4:-}" ]; then export PIP_CONSTRAINT="$PWD/$4"; fi; checkout_venv "$1" "$2")
  version=$("$rpy" -c 'import importlib.metadata as m; print(m.version("torch"))')
  run_tier "core tests (torch $version, $3)" \
    "$rpy" -m pytest tests --ignore=tests/xla --ignore=tests/notebooks --ignore=tests/torch_tpu --ignore=tests/browser --ignore=tests/hosts -q -p no:cacheprovider
}
if [ "${XLAUNCH_SKIP_TORCH_RELEASES:-0}" != 1 ]; then
  torch_release_tier core-torch28 requirements/core-torch28.txt "the floor"
  torch_release_tier core-torch215 requirements/core-torch215.txt "the newest" \
    requirements/constraints-torch215.txt
fi
# Several hosts on this machine: network namespaces joined by a bridge (tests/hosts; needs root
# and iproute2, as CI runs). Where they cannot be made, pytest's -rs line says why, and the tier
# says SKIPPED.
if [ -d tests/hosts ]; then
  run_tier "multi-host tier (network namespaces)" "$PY" -m pytest tests/hosts -q -rs -p no:cacheprovider
fi
if [ -d tests/notebooks ]; then
  run_tier "notebook tests (real Jupyter kernel)" "$PY" -m pytest tests/notebooks -q -p no:cacheprovider
fi
if [ -f mkdocs.yml ]; then
  run_tier "docs build (mkdocs --strict)" "$BIN/mkdocs" build --strict --quiet --site-dir "$(mktemp -d)"
fi
# The wheel and sdist as a user gets them: built, twine-checked, installed into a fresh venv
# (torch 2.13.0 from this machine's disk), and run from there without this checkout.
run_tier "packaging (build, twine check, a fresh venv: xlaunch env, a 2-process run)" \
  bash scripts/package_check.sh "$PY"
xla_tier() {  # xla_tier NAME REQUIREMENTS: the XLA suite (TPU notebooks included) on one release
  local xpy version
  xpy=$(checkout_venv "$1" "$2")
  pip_quiet "$xpy" -r requirements/xla-test.txt
  version=$("$xpy" -c 'import importlib.metadata as m; print(m.version("torch_xla"))')
  run_tier "torch_xla $version tier (PJRT_DEVICE=CPU)" env PJRT_DEVICE=CPU CPU_NUM_DEVICES=1 \
    "$xpy" -m pytest tests/xla -q -p no:cacheprovider
}
if [ -d tests/xla ] && [ "${XLAUNCH_SKIP_XLA:-0}" != 1 ]; then
  xla_tier xla requirements/xla.txt      # the newest torch_xla (what a TPU VM installs)
  xla_tier xla28 requirements/xla28.txt  # the release Kaggle's TPU image pins
fi
# TorchTPU: the real torch-tpu package (with libtpu) beside torch 2.13.0 CPU, in its own venv. No
# TPU here: nothing may start TorchTPU's runtime, and libtpu must not query the metadata server.
torch_tpu_tier() {
  local tpy version
  tpy=$(checkout_venv torch-tpu requirements/torch-tpu.txt)
  version=$("$tpy" -c 'import importlib.metadata as m; print(m.version("torch-tpu"))')
  run_tier "torch-tpu $version tier (no TPU: TPU_SKIP_MDS_QUERY=1, gloo and CPU substituted)" \
    env TPU_SKIP_MDS_QUERY=1 "$tpy" -m pytest tests/torch_tpu -q -p no:cacheprovider
}
if [ -d tests/torch_tpu ] && [ "${XLAUNCH_SKIP_TORCH_TPU:-0}" != 1 ]; then
  torch_tpu_tier
fi
if [ -d tests/browser ] && [ "${XLAUNCH_SKIP_BROWSER:-0}" != 1 ]; then
  browser_tier
fi
exit $status
