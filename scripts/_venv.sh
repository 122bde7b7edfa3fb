# Sourced by the scripts: make_venv NAME REQUIREMENTS... -> prints the venv's python.
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
    python3 -m venv "$venv" >&2
    "$venv/bin/python" -m pip install -q --upgrade pip >&2 2>/dev/null || true
    local req
    for req in "$@"; do
      "$venv/bin/python" -m pip install -q -r "$req" >&2
    done
    touch "$venv/.complete"
  fi
  echo "$venv/bin/python"
}
