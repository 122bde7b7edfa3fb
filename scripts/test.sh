#!/usr/bin/env bash
# The whole test suite, in tiers, each in its own venv (built once under ~/.cache/xlaunch, or
# $XLAUNCH_CACHE, and reused): lint and types, core tests (torch 2.13 CPU, on this machine's
# Python), the core tests on other torch releases, several hosts in network namespaces, notebooks in
# a real Jupyter kernel, the docs build, the package as built and installed, the torch_xla tiers,
# the TorchTPU tier and the browser tier (JupyterLab in headless Chromium).
# The notebooks' own Pythons: Colab's TPU runtime (Python 3.13, torch 2.9, torch_xla 2.9) and
# Kaggle's TPU image (Python 3.12, torch 2.8, torch_xla 2.8). Each runs the core tests and tests/xla
# on its torch and torch_xla. Python 3.13 comes from Debian trixie's packages, in a root that
# debootstrap makes once (scripts/_debian_root.sh). Python 3.12 is in no Debian suite: the py312
# tier uses the CPython 3.12 this machine has (XLAUNCH_PYTHON312=/path/to/python3.12, python3.12
# on PATH, or pyenv's); where there is none it says SKIPPED, and torch 2.8 and torch_xla 2.8 run
# on this machine's python3 instead. A 3.13 found the same way serves where no root can be made.
#
# One tier alone, or a few: XLAUNCH_ONLY="NAME ..." (spaces or commas), e.g.
#   XLAUNCH_ONLY=py313 bash scripts/test.sh
# NAMEs: lint, types, core (torch 2.13), torch215 (the newest torch), hosts, notebooks, docs,
# packaging, py313, py312, torch-tpu, browser; and where a notebook Python cannot be had, what it
# runs on this machine's Python instead: xla (torch_xla 2.9, for py313), torch28 and xla28 (torch
# 2.8, the floor, and torch_xla 2.8, for py312). XLAUNCH_ONLY_BROWSER=1 is XLAUNCH_ONLY=browser.
# Each tier's time is printed after it, and the whole run's at the end.
# Leaving some out: XLAUNCH_SKIP_TORCH_RELEASES=1 (the core tests on torch other than 2.13),
# XLAUNCH_SKIP_XLA=1 (tests/xla, everywhere), XLAUNCH_SKIP_TORCH_TPU=1, XLAUNCH_SKIP_BROWSER=1.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
. scripts/_debian_root.sh

TIERS=" lint types core torch28 torch215 hosts notebooks docs packaging xla xla28 py313 py312 torch-tpu browser "
ONLY=" ${XLAUNCH_ONLY:-} "
ONLY=${ONLY//,/ }
if [ "${XLAUNCH_ONLY_BROWSER:-0}" = 1 ]; then ONLY=" browser "; fi
for name in $ONLY; do
  if [[ "$TIERS" != *" $name "* ]]; then
    echo "XLAUNCH_ONLY: no tier named $name; the tiers:$TIERS" >&2
    exit 2
  fi
done
wanted() {  # wanted NAME...: one of these tiers is to run
  local name
  [ -z "${ONLY// /}" ] && return 0
  for name in "$@"; do [[ "$ONLY" == *" $name "* ]] && return 0; done
  return 1
}
releases=$([ "${XLAUNCH_SKIP_TORCH_RELEASES:-0}" != 1 ] && echo 1 || true)
xla=$([ -d tests/xla ] && [ "${XLAUNCH_SKIP_XLA:-0}" != 1 ] && echo 1 || true)
CORE_TESTS=(tests --ignore=tests/xla --ignore=tests/notebooks --ignore=tests/torch_tpu
            --ignore=tests/browser --ignore=tests/hosts -q -p no:cacheprovider)

status=0
run_tier() {  # run_tier NAME COMMAND...: pytest's "no tests collected" (5) is a failure here too
  local started=$SECONDS
  echo "=== $1"; shift
  if ! "$@"; then echo "=== FAILED: $*"; status=1; fi
  echo "=== ($((SECONDS - started)) s)"
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
torch_version() {  # torch_version PYTHON [RUNNER...]: the torch (or the distribution named by DIST) it has
  local py="$1"; shift
  "$@" "$py" -c "import importlib.metadata as m; print(m.version('${DIST:-torch}'))"
}

if wanted lint types core hosts notebooks docs packaging; then
  PY=$(checkout_venv dev requirements/dev.txt)
  BIN=$(dirname "$PY")
fi
if wanted lint; then run_tier "lint (ruff)" "$BIN/ruff" check src tests bench; fi
if wanted types; then run_tier "types (mypy)" "$BIN/mypy"; fi
if wanted core; then
  run_tier "core tests (torch $(torch_version "$PY"), Python $("$PY" -c 'import platform; print(platform.python_version())'))" \
    "$PY" -m pytest "${CORE_TESTS[@]}"
fi

# find_python X.Y: a CPython X.Y on this machine: $XLAUNCH_PYTHON3Y when set (and nothing else),
# else python X.Y on PATH, else pyenv's newest X.Y. Prints it, or why there is none (and returns 1).
find_python() {
  local v="$1" var="XLAUNCH_PYTHON${1/./}" p candidates
  if [ -n "${!var:-}" ]; then
    candidates=("${!var}")
  else
    candidates=("$(command -v "python$v" || true)")
    if command -v pyenv >/dev/null; then
      candidates+=($(ls -d "$(pyenv root)/versions/$v".*/bin/"python$v" 2>/dev/null | sort -V -r))
    fi
  fi
  for p in "${candidates[@]}"; do
    if [ -n "$p" ] && [ "$("$p" -c 'import platform; print(platform.python_implementation(), platform.python_version()[:len("'"$v"'.")])' 2>/dev/null)" = "CPython $v." ]; then
      echo "$p"
      return 0
    fi
  done
  if [ -n "${!var:-}" ]; then echo "$var=${!var} is not a CPython $v"; else
    echo "no CPython $v here (python$v on PATH, pyenv's; or set $var)"; fi
  return 1
}
PY312_WHY=""
if ! PY312=$(find_python 3.12); then
  PY312_WHY="$PY312; no Debian suite carries 3.12 (bookworm has 3.11, trixie 3.13)"
  PY312=""
fi

# The same core tests on the other torch releases a user may have: the floor pyproject declares
# (2.8.0: on Python 3.12 in the py312 tier, else here) and the newest on the registry (2.15.0). The
# registry has only CUDA builds of them (about 6 GB a venv, built once); they run on the CPU here.
# This machine's pip config caps torch at 2.14.1: a release above it brings its own constraints
# file, which PIP_CONSTRAINT puts in place of the config's (only while its venv is built).
torch_release_tier() {  # torch_release_tier NAME REQUIREMENTS WHAT [CONSTRAINTS]
  local rpy
  rpy=$(if [ -n "${4:-}" ]; then export PIP_CONSTRAINT="$PWD/$4"; fi; checkout_venv "$1" "$2")
  run_tier "core tests (torch $(torch_version "$rpy"), $3)" "$rpy" -m pytest "${CORE_TESTS[@]}"
}
if [ -n "$releases" ]; then
  if [ -z "$PY312" ] && wanted torch28; then
    torch_release_tier core-torch28 requirements/core-torch28.txt "the floor"
  fi
  if wanted torch215; then
    torch_release_tier core-torch215 requirements/core-torch215.txt "the newest" \
      requirements/constraints-torch215.txt
  fi
fi
# Several hosts on this machine: network namespaces joined by a bridge (tests/hosts; needs root
# and iproute2, as CI runs). Where they cannot be made, pytest's -rs line says why, and the tier
# says SKIPPED.
if [ -d tests/hosts ] && wanted hosts; then
  why=$("$PY" -c 'from tests.hosts.netns import why_no_hosts; print(why_no_hosts() or "")')
  if [ -n "$why" ]; then echo "=== multi-host tier SKIPPED: $why"; else
    run_tier "multi-host tier (network namespaces)" "$PY" -m pytest tests/hosts -q -rs -p no:cacheprovider
  fi
fi
if [ -d tests/notebooks ] && wanted notebooks; then
  run_tier "notebook tests (real Jupyter kernel)" "$PY" -m pytest tests/notebooks -q -p no:cacheprovider
fi
if [ -f mkdocs.yml ] && wanted docs; then
  run_tier "docs build (mkdocs --strict)" "$BIN/mkdocs" build --strict --quiet --site-dir "$(mktemp -d)"
fi
# The wheel and sdist as a user gets them: built, twine-checked, installed into a fresh venv
# (torch 2.13.0 from this machine's disk), and run from there without this checkout.
if wanted packaging; then
  run_tier "packaging (build, twine check, a fresh venv: xlaunch env, a 2-process run)" \
    bash scripts/package_check.sh "$PY"
fi
xla_tests() {  # xla_tests PYTHON WHAT [RUNNER...]: the XLA suite (TPU notebooks included)
  local xpy="$1" what="$2"; shift 2
  run_tier "torch_xla $(DIST=torch_xla torch_version "$xpy" "$@") tier ($what, PJRT_DEVICE=CPU)" \
    "$@" env PJRT_DEVICE=CPU CPU_NUM_DEVICES=1 "$xpy" -m pytest tests/xla -q -p no:cacheprovider
}
xla_tier() {  # xla_tier NAME REQUIREMENTS: the XLA suite on one release, on this machine's Python
  local xpy
  xpy=$(checkout_venv "$1" "$2")
  pip_quiet "$xpy" -r requirements/xla-test.txt
  xla_tests "$xpy" "Python $("$xpy" -c 'import platform; print(platform.python_version())')"
}
# notebook_tests PYTHON WHAT [RUNNER...]: on a notebook's Python (PYTHON run through RUNNER), the
# core tests on its torch, then tests/xla on its torch_xla (one venv holds both).
notebook_tests() {
  local py="$1" what="$2"; shift 2
  what="Python $("$@" "$py" -c 'import platform; print(platform.python_version())'): $what"
  if [ -n "$releases" ]; then
    run_tier "core tests (torch $(torch_version "$py" "$@"), $what)" "$@" "$py" -m pytest "${CORE_TESTS[@]}"
  fi
  if [ -n "$xla" ]; then xla_tests "$py" "$what" "$@"; fi
}
# Python 3.13, as Colab's TPU runtime has it: torch 2.9.0 and torch_xla 2.9.0, in one venv inside
# a Debian trixie root (its python3.13), made once with debootstrap and reused
# (scripts/_debian_root.sh). Tests run there as here: real processes, a /dev/shm, loopback, a
# second user (setpriv), a private mount namespace (unshare -m). Where no root can be made, a
# CPython 3.13 of this machine's serves; with neither, the tier says SKIPPED and torch_xla 2.9 runs
# on this machine's python3.
py313_tier() {
  local root py
  if root=$(debian_root trixie requirements/py313-debian.txt); then
    py=$(root_venv "$root" python3.13 py313 requirements/py313.txt requirements/xla-test.txt)
    in_root_pip "$root" "$py" --no-deps -e .
    notebook_tests "$py" "Colab's TPU runtime, in a Debian trixie root" in_root "$root"
  elif py=$(find_python 3.13); then
    echo "=== Python 3.13 from a Debian trixie root cannot be had ($root): $py instead"
    py=$(VENV_PYTHON="$py" checkout_venv "py$("$py" -c 'import platform; print(platform.python_version())')" \
           requirements/py313.txt requirements/xla-test.txt)
    notebook_tests "$py" "Colab's TPU runtime"
  else
    echo "=== Python 3.13 tier SKIPPED: no Debian trixie root ($root), and $py; torch_xla 2.9 runs on this machine's python3 instead"
    if [ -n "$xla" ] && wanted xla; then xla_tier xla requirements/xla.txt; fi
  fi
}
if { [ -n "$releases" ] || [ -n "$xla" ]; } && wanted py313 xla; then
  if wanted py313; then py313_tier; else xla_tier xla requirements/xla.txt; fi
fi
# Python 3.12, as Kaggle's TPU image has it: torch 2.8.0 (the floor) and torch_xla 2.8.0 in one
# venv, made with the CPython 3.12 found above; where there is none, torch 2.8 and torch_xla 2.8
# run on this machine's python3 (torch28, xla28) and this tier says SKIPPED.
if wanted py312; then
  if [ -z "$PY312" ]; then
    echo "=== Python 3.12 tier SKIPPED: $PY312_WHY; torch 2.8 and torch_xla 2.8 run on this machine's python3 instead"
  elif [ -n "$releases" ] || [ -n "$xla" ]; then
    py=$(VENV_PYTHON="$PY312" checkout_venv "py$("$PY312" -c 'import platform; print(platform.python_version())')" \
           requirements/py312.txt requirements/xla-test.txt)
    notebook_tests "$py" "Kaggle's TPU image, torch 2.8 the floor"
  fi
fi
if [ -z "$PY312" ] && [ -n "$xla" ] && wanted xla28; then
  xla_tier xla28 requirements/xla28.txt  # the release Kaggle's TPU image pins
fi
# TorchTPU: the real torch-tpu package (with libtpu) beside torch 2.13.0 CPU, in its own venv. No
# TPU here: nothing may start TorchTPU's runtime, and libtpu must not query the metadata server.
torch_tpu_tier() {
  local tpy
  tpy=$(checkout_venv torch-tpu requirements/torch-tpu.txt)
  run_tier "torch-tpu $(DIST=torch-tpu torch_version "$tpy") tier (no TPU: TPU_SKIP_MDS_QUERY=1, gloo and CPU substituted)" \
    env TPU_SKIP_MDS_QUERY=1 "$tpy" -m pytest tests/torch_tpu -q -p no:cacheprovider
}
if [ -d tests/torch_tpu ] && [ "${XLAUNCH_SKIP_TORCH_TPU:-0}" != 1 ] && wanted torch-tpu; then
  torch_tpu_tier
fi
if [ -d tests/browser ] && [ "${XLAUNCH_SKIP_BROWSER:-0}" != 1 ] && wanted browser; then
  browser_tier
fi
echo "=== all tiers: $((SECONDS / 60)) min $((SECONDS % 60)) s"
exit $status
