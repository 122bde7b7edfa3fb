# Sourced by the scripts: make_venv NAME REQUIREMENTS... -> prints the venv's python (made with
# $VENV_PYTHON, python3 by default).
# Venvs live outside the checkout, keyed by their requirements, so later runs (and CI on the same
# machine) reuse them; a changed requirements file makes a new one.
CACHE_DIR="${XLAUNCH_CACHE:-$HOME/.cache/xlaunch}"

make_venv() {
  local name="$1"; shift
  local key
  key=$(cat "$@" | sha256sum | cut -c1-12)
  local venv="$CACHE_DIR/$name-$key"
  if [ ! -f "$venv/.complete" ]; then
    echo "[setup] creating $venv (first run only)" >&2
    rm -rf "$venv"
    mkdir -p "$CACHE_DIR"
    "${VENV_PYTHON:-python3}" -m venv "$venv" >&2
    "$venv/bin/python" -m pip install -q --upgrade pip >&2 2>/dev/null || true
    local req
    for req in "$@"; do  # a failed install leaves the venv unfinished: the next run starts again
      pip_quiet "$venv/bin/python" -r "$req" || return 1
    done
    touch "$venv/.complete"
  fi
  echo "$venv/bin/python"
}

# pip_quiet PYTHON ARGS...: pip install without this machine's notes on its local package mirrors.
pip_quiet() {
  local py="$1"; shift
  { "$py" -m pip install -q "$@" 2>&1; } \
    | { grep -v -e "is ignored: it is neither" -e "is ignored: it is either" -e "^\s*$" || true; } >&2
}

# install_here PYTHON: this checkout into the venv, editable, without touching its dependencies.
install_here() {
  pip_quiet "$1" --no-deps -e .
}

# checkout_venv NAME REQUIREMENTS...: make_venv, then this checkout installed into it.
checkout_venv() {
  local py
  py=$(make_venv "$@")
  install_here "$py"
  echo "$py"
}

# The venvs are shared by every checkout on this machine: this checkout's code comes first.
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
