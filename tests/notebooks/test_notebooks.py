"""The notebooks in colab/, executed end to end in a real Jupyter kernel through nbclient.

The kernel runs with ``XLAUNCH_NOTEBOOK_CI=1`` (the install cell skips pip) and
``XLAUNCH_ACCELERATOR=cpu``: each notebook's launch cell then asks for 2 CPU processes, so the
launched training runs for real through the fallback path. The TPU notebooks stop at their
``runtime`` cell on a runtime without a TPU unless ``XLAUNCH_NOTEBOOK_ALLOW_NO_TPU=1`` (set here for
the end-to-end runs; one test checks the stop itself). Their XLA code runs in tests/xla, in a kernel
of the torch_xla venv. Cells are found by their tags (``install``, ``env``, ``train``, ``launch``,
``check``, and ``runtime`` in the TPU notebooks); the launch cell leaves its return value in
``result``.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import nbformat
import psutil
import pytest
from nbkernel import CELL_TIMEOUT, KERNEL_NAME, STARTUP_TIMEOUT, descendants, kill_all, living

COLAB = Path(__file__).resolve().parents[2] / "colab"
NOTEBOOKS = sorted(COLAB.glob("*.ipynb"))
EXPECTED = {"tpu_colab_quickstart.ipynb", "tpu_kaggle.ipynb", "gpu_cpu_fallback.ipynb"}
# The menu each TPU notebook names when the runtime has no TPU.
TPU_MENUS = {"tpu_colab_quickstart.ipynb": "Runtime > Change runtime type > TPU",
             "tpu_kaggle.ipynb": "Settings > Accelerator > TPU"}
TPU_NOTEBOOKS = set(TPU_MENUS)
REQUIRED_TAGS = ("install", "env", "train", "launch", "check")
# Where each notebook's install cell looks for the uploaded wheel, by platform.
PLATFORM_FOLDERS = {"tpu_colab_quickstart.ipynb": ("/content",), "tpu_kaggle.ipynb": ("/kaggle/input",),
                    "gpu_cpu_fallback.ipynb": ("/content", "/kaggle/input")}
RESULT_MARK = "XLAUNCH-TEST-RESULT "


def tagged(nb: nbformat.NotebookNode, tag: str) -> nbformat.NotebookNode:
    cells = [cell for cell in nb.cells if tag in cell.metadata.get("tags", [])]
    assert len(cells) == 1, f"expected one cell tagged {tag!r}, found {len(cells)}"
    return cells[0]


def streams(cell: nbformat.NotebookNode, name: str) -> str:
    return "".join(o.get("text", "") for o in cell.outputs
                   if o.output_type == "stream" and o.name == name)


def errors(nb: nbformat.NotebookNode) -> list[str]:
    return [f"{o.ename}: {o.evalue}" for cell in nb.cells if cell.cell_type == "code"
            for o in cell.outputs if o.output_type == "error"]


def test_the_three_notebooks_exist():
    assert {path.name for path in NOTEBOOKS} == EXPECTED


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stripped_v4_and_complete(path: Path):
    nb = nbformat.read(path, as_version=nbformat.NO_CONVERT)
    assert nb.nbformat == 4
    nbformat.validate(nb)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, "outputs must be stripped"
    for tag in REQUIRED_TAGS:
        tagged(nb, tag)
    install = tagged(nb, "install").source
    assert "XLAUNCH_NOTEBOOK_CI" in install and "%pip install" in install
    assert tagged(nb, "env").source.strip() == "!xlaunch env"
    assert "disable=not state.is_local_main_process" in tagged(nb, "train").source
    launch = tagged(nb, "launch").source
    assert "notebook_launcher(train" in launch and "result = " in launch
    # Plain xlaunch everywhere (no extra): the TPU images' torch, torch_xla and libtpu stay as
    # they are. Until the first release, from the wheel; the PyPI line is marked for later.
    assert re.search(r"^\s*%pip install --quiet \{wheel\}$", install, re.M), install
    assert 'os.environ.get("XLAUNCH_WHEEL_DIR", ' in install and "raise FileNotFoundError" in install
    # The wheel is looked for before pip runs, where the platform puts uploads.
    assert install.index("raise FileNotFoundError") < install.index("%pip install")
    for folder in PLATFORM_FOLDERS[path.name]:
        assert f'"{folder}"' in install, (folder, install)
    assert re.search(r"^\s*# after the first release: %pip install --quiet xlaunch$", install,
                     re.M), install
    if path.name in TPU_NOTEBOOKS:
        assert tagged(nb, "machine-check").source.strip() == "!xlaunch check"
    if path.name in TPU_NOTEBOOKS:
        assert "XLAUNCH_NOTEBOOK_ALLOW_NO_TPU" in tagged(nb, "runtime").source
        assert TPU_MENUS[path.name] in tagged(nb, "runtime").source
        assert 'mixed_precision="bf16"' in launch
    # No links to a home the project does not have yet: the first cell says how to open the file.
    assert "http" not in "".join(cell.source for cell in nb.cells)
    opening = nb.cells[0].source
    assert f"`colab/{path.name}`" in opening
    assert "File > Upload notebook" in opening or "File > Import Notebook" in opening


def execute(path: Path, kernel_env: dict[str, str], cwd: Path) -> tuple[nbformat.NotebookNode, list]:
    """Run every cell, then one test-only cell printing ``result``; return the notebook and the
    kernel's processes that were still alive after the last cell."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(
        f"import json\nprint({RESULT_MARK!r} + json.dumps(result))"))
    client = NotebookClient(nb, kernel_name=KERNEL_NAME, timeout=CELL_TIMEOUT,
                            startup_timeout=STARTUP_TIMEOUT, allow_errors=False)
    seen: list[psutil.Process] = []
    alive_after_cells: list[psutil.Process] = []
    with client.setup_kernel(env=kernel_env, cwd=str(cwd)):
        kernel_pid = client.km.provisioner.process.pid
        try:
            for index, cell in enumerate(nb.cells):
                client.execute_cell(cell, index)
                seen.extend(descendants(kernel_pid))
            alive_after_cells = living(descendants(kernel_pid))
        finally:
            seen.extend(descendants(kernel_pid))
    survivors = kill_all(seen)
    assert not survivors, f"processes outlived the kernel (killed now): {survivors}"
    return nb, alive_after_cells


def run_until_an_error(nb: nbformat.NotebookNode, env: dict[str, str], cwd: Path) -> int | None:
    """Run all, as a user would: the cells in order until one raises. Returns that cell's index
    (None if none raised), after checking that no process of the kernel's outlived it."""
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    client = NotebookClient(nb, kernel_name=KERNEL_NAME, timeout=CELL_TIMEOUT,
                            startup_timeout=STARTUP_TIMEOUT)
    stopped_at = None
    seen: list[psutil.Process] = []
    with client.setup_kernel(env=env, cwd=str(cwd)):
        kernel_pid = client.km.provisioner.process.pid
        for index, cell in enumerate(nb.cells):
            try:
                client.execute_cell(cell, index)
            except CellExecutionError:
                stopped_at = index
                break
            finally:
                seen.extend(descendants(kernel_pid))
    assert not kill_all(seen), "processes outlived the kernel"
    return stopped_at


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs_end_to_end(path: Path, kernel_env: dict[str, str], tmp_path: Path):
    nb, alive = execute(path, dict(kernel_env, XLAUNCH_NOTEBOOK_ALLOW_NO_TPU="1"), tmp_path)
    assert not errors(nb)
    assert not alive, f"the launch left processes running in the kernel: {alive}"

    env_output = streams(tagged(nb, "env"), "stdout")
    assert re.search(r"^\s*accelerator\s+cpu\s*$", env_output, re.M), env_output

    launch = tagged(nb, "launch")
    out, err = streams(launch, "stdout"), streams(launch, "stderr")
    for rank in (0, 1):
        assert re.search(rf"^\[rank {rank}\] process {rank} of 2 on cpu: \d+ samples$", out, re.M), out
    assert all(re.match(r"\[rank [01]\] ", line) for line in out.splitlines()), out
    # The progress bar: drawn to the end, by the main process only. A text bar redrawn with
    # carriage returns is the rank's live line in a notebook: an output updated in place.
    live = [o["data"]["text/plain"] for o in launch.outputs
            if o.output_type == "display_data" and "text/plain" in o.get("data", {})]
    bar_pieces = [piece for piece in re.split(r"[\r\n]", err) + live if "it/s" in piece]
    assert bar_pieces and all(piece.startswith("[rank 0] ") for piece in bar_pieces), (err, live)
    assert any("100%|" in piece for piece in bar_pieces), (err, live)
    assert [o for o in launch.outputs if o.output_type == "execute_result"], "result is displayed"

    assert "training worked" in streams(tagged(nb, "check"), "stdout")
    printed = streams(nb.cells[-1], "stdout")
    result = json.loads(printed.split(RESULT_MARK, 1)[1])
    assert result["processes"] == 2
    assert math.isfinite(result["final_loss"]) and result["final_loss"] < result["initial_loss"]
    expected_precision = "bf16" if path.name in TPU_NOTEBOOKS else "no"
    assert result["mixed_precision"] == expected_precision

    if path.name == "gpu_cpu_fallback.ipynb":
        failure = streams(tagged(nb, "failure"), "stdout")
        assert "root cause: rank 1" in failure and "ValueError: bad batch in process 1" in failure
        if "[secondary failure" in failure:  # a peer's broken barrier, when it lost the race
            assert failure.index("[root cause] rank 1") < failure.index("[secondary failure")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", sorted(TPU_NOTEBOOKS))
def test_tpu_notebook_stops_on_a_runtime_without_a_tpu(name: str, kernel_env: dict[str, str],
                                                        tmp_path: Path):
    """Run all, as a user would on a CPU runtime: the runtime cell stops it, naming the menu."""
    env = dict(kernel_env)
    for variable in ("XLAUNCH_ACCELERATOR", "XLAUNCH_NOTEBOOK_ALLOW_NO_TPU"):
        env.pop(variable, None)  # a plain runtime: whatever this machine has, and it has no TPU
    nb = nbformat.read(COLAB / name, as_version=4)
    stopped_at = run_until_an_error(nb, env, tmp_path)
    assert stopped_at is not None and nb.cells[stopped_at] is tagged(nb, "runtime"), stopped_at
    (error,) = [o for o in nb.cells[stopped_at].outputs if o.output_type == "error"]
    assert error.ename == "RuntimeError"
    assert "needs a TPU runtime" in error.evalue and TPU_MENUS[name] in error.evalue, error.evalue
    assert "gpu_cpu_fallback.ipynb" in error.evalue
    assert tagged(nb, "launch").outputs == [], "nothing ran after the stop"


# Each notebook on each platform it serves: (notebook, platform variables, where the wheel sits
# below the searched folder, what the stop sentence tells the user to do).
INSTALLS = [
    ("tpu_colab_quickstart.ipynb", {}, "", "upload xlaunch-0.1.0-py3-none-any.whl with the Files panel"),
    ("tpu_kaggle.ipynb", {"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, "my-wheel/",
     "as a dataset (Add Input > Upload)"),
    ("gpu_cpu_fallback.ipynb", {}, "", "upload xlaunch-0.1.0-py3-none-any.whl with the Files panel"),
    ("gpu_cpu_fallback.ipynb", {"KAGGLE_KERNEL_RUN_TYPE": "Interactive"}, "my-wheel/",
     "as a dataset (Add Input > Upload)"),
]

INSTALL_IDS = ["colab-tpu", "kaggle-tpu", "gpu_cpu-on-colab", "gpu_cpu-on-kaggle"]


def user_kernel_env(kernel_env: dict[str, str], uploads: Path, platform: dict[str, str]) -> dict[str, str]:
    """A user's runtime: no test flag (the install cell runs for real), the platform's variables,
    and the cell's search pointed at ``uploads`` instead of /content or /kaggle/input."""
    env = {k: v for k, v in kernel_env.items()
           if k != "XLAUNCH_NOTEBOOK_CI" and not k.startswith("KAGGLE_")}
    return dict(env, XLAUNCH_WHEEL_DIR=str(uploads), **platform)


def a_wheel(folder: Path) -> Path:
    """A small, valid wheel named as the build names xlaunch's (pip reads only its metadata here)."""
    import base64
    import hashlib
    import zipfile

    info = "xlaunch-0.1.0.dist-info"
    files = {f"{info}/METADATA": "Metadata-Version: 2.1\nName: xlaunch\nVersion: 0.1.0\n",
             f"{info}/WHEEL": ("Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                               "Tag: py3-none-any\n")}

    def digest(text: str) -> str:
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()

    record = "".join(f"{name},sha256={digest(text)},{len(text)}\n" for name, text in files.items())
    folder.mkdir(parents=True, exist_ok=True)
    wheel = folder / "xlaunch-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(f"{info}/RECORD", record + f"{info}/RECORD,,\n")
    return wheel


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, platform, below, told", INSTALLS, ids=INSTALL_IDS)
def test_run_all_without_the_wheel_stops_at_the_install_cell_saying_where_to_upload_it(
        name: str, platform: dict[str, str], below: str, told: str, kernel_env: dict[str, str],
        tmp_path: Path):
    """Run all before uploading the wheel: the install cell stops it in one sentence, pip never
    runs (no "not a valid wheel filename"), and no later cell runs (no `xlaunch: command not found`)."""
    uploads = tmp_path / "uploads"
    (uploads / "some-other-dataset").mkdir(parents=True)  # what else a user has there
    (uploads / "some-other-dataset" / "train.csv").write_text("x\n")
    nb = nbformat.read(COLAB / name, as_version=4)
    stopped_at = run_until_an_error(nb, user_kernel_env(kernel_env, uploads, platform), tmp_path)
    install = tagged(nb, "install")
    assert stopped_at is not None and nb.cells[stopped_at] is install, stopped_at
    (error,) = [o for o in install.outputs if o.output_type == "error"]
    assert error.ename == "FileNotFoundError", error
    sentence = error.evalue
    assert sentence.startswith(f"No xlaunch wheel in {uploads}") and told in sentence, sentence
    assert sentence.endswith("then run this cell again.") and sentence.count(". ") == 0, sentence
    printed = "".join(o.get("text", "") for o in install.outputs if o.output_type == "stream")
    assert "pip" not in printed.lower() and "not a valid wheel" not in printed, printed
    later = [cell for cell in nb.cells[stopped_at + 1:] if cell.cell_type == "code"]
    assert later and all(cell.outputs == [] for cell in later), "cells after the stop ran"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, platform, below, told", INSTALLS, ids=INSTALL_IDS)
def test_the_install_cell_installs_the_uploaded_wheel(
        name: str, platform: dict[str, str], below: str, told: str, kernel_env: dict[str, str],
        tmp_path: Path):
    """With the wheel where the platform puts it, the cell runs pip on that file. pip runs for
    real in the kernel, as a dry run that writes its installation report: this venv is left as
    it is (PIP_TARGET too, should the dry run not hold)."""
    from nbclient import NotebookClient

    uploads = tmp_path / "uploads"
    wheel = a_wheel(uploads / below)
    report = tmp_path / "pip-report.json"
    env = dict(user_kernel_env(kernel_env, uploads, platform), PIP_DRY_RUN="1",
               PIP_REPORT=str(report), PIP_NO_INDEX="1", PIP_IGNORE_INSTALLED="1",
               PIP_TARGET=str(tmp_path / "target"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    nb = nbformat.read(COLAB / name, as_version=4)
    install = tagged(nb, "install")
    client = NotebookClient(nb, kernel_name=KERNEL_NAME, timeout=CELL_TIMEOUT,
                            startup_timeout=STARTUP_TIMEOUT)
    with client.setup_kernel(env=env, cwd=str(tmp_path)):
        client.execute_cell(install, nb.cells.index(install))
    assert not [o for o in install.outputs if o.output_type == "error"], install.outputs
    installed = json.loads(report.read_text())["install"]
    assert [(item["metadata"]["name"], item["download_info"]["url"]) for item in installed] == [
        ("xlaunch", wheel.as_uri())]
    assert not (tmp_path / "target").exists()
