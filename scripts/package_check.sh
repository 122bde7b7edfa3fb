#!/usr/bin/env bash
# The packaging check, as a user meets the package: build the sdist and the wheel (the wheel from
# the sdist, so a file missing from the sdist fails here), `twine check` both, install the wheel
# into a fresh venv outside the checkout, and run the installed command there: `xlaunch env` and a
# real 2-process launch. PYTHONPATH is unset and the working directory is not the checkout, so
# what pip sees installed and what runs is the wheel, not src/.
# Usage: package_check.sh PYTHON  (a python with `build` and `twine`: the dev venv's)
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
unset PYTHONPATH  # _venv.sh puts src/ first; here only the installed wheel may count
PY=${1:?usage: package_check.sh PYTHON}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if ! "$PY" -m build --outdir "$work/dist" . >"$work/build.log" 2>&1; then
  cat "$work/build.log"; exit 1
fi
"$PY" -m twine check --strict "$work"/dist/*
"$PY" - "$work"/dist/*.whl <<'PYCODE'
import sys, zipfile
names = zipfile.ZipFile(sys.argv[1]).namelist()
assert "xlaunch/py.typed" in names and "xlaunch/cli/__init__.py" in names, names
assert not [n for n in names if n.startswith(("tests/", "bench/", "colab/"))], names
metadata = zipfile.ZipFile(sys.argv[1]).read("xlaunch-0.1.0.dist-info/METADATA").decode()
assert "License-Expression: Apache-2.0" in metadata.splitlines(), metadata[:800]
assert "xlaunch-0.1.0.dist-info/licenses/LICENSE" in names, names
print(f"wheel: {len(names)} files, xlaunch/ only, licence Apache-2.0 with its LICENSE file")
PYCODE

# A fresh venv; torch pinned to the CPU build on this machine's disk, so pip does not fetch a CUDA
# build to satisfy the wheel's `torch>=2.8`.
python3 -m venv "$work/venv"
echo "torch==2.13.0" >"$work/constraints.txt"
pip_quiet "$work/venv/bin/python" -c "$work/constraints.txt" "$work"/dist/*.whl
cp tests/packaging/two_ranks.py "$work/"
cd "$work"
venv/bin/xlaunch --version
venv/bin/xlaunch env >env.txt || { cat env.txt; exit 1; }
grep -q "^  accelerator " env.txt || { cat env.txt; exit 1; }
echo "xlaunch env: $(grep -m1 -E '^  path ' env.txt | tr -s ' ' | sed 's/^ //')"
venv/bin/xlaunch run --num-processes 2 two_ranks.py >run.txt 2>&1 || { cat run.txt; exit 1; }
for rank in 0 1; do
  if ! grep -q "^\[rank $rank\] rank $rank of 2: sum 3, backend gloo, xlaunch from $work/venv/" run.txt; then
    echo "rank $rank did not report from the installed wheel:"; cat run.txt; exit 1
  fi
done
echo "packaging: 2-process run from the installed wheel: ok"
