"""A real frontend: JupyterLab, in headless Chromium, shows every rank's ``tqdm.auto`` bar (issue 31).

The notebook tier checks the messages a kernel sends; this tier checks what a user sees. The test
starts a JupyterLab server (loopback only, a free port, a token) with a kernel of this venv, opens
a notebook in Debian's Chromium (driven by selenium through Debian's chromedriver; nothing is
downloaded by a tool), runs it, and reads the rendered page: one bar widget per rank, labelled
with its rank, finished. A screenshot of the page is kept in the test's folder.

Run by ``scripts/test.sh`` (its browser tier, which installs Debian's ``chromium`` and
``chromium-driver`` when they are missing) or alone: ``XLAUNCH_ONLY_BROWSER=1 bash scripts/test.sh``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernels import kernel_environment

pytestmark = pytest.mark.timeout(300)

psutil = pytest.importorskip("psutil")
nbformat = pytest.importorskip("nbformat")
webdriver = pytest.importorskip("selenium.webdriver")
pytest.importorskip("jupyterlab")

KERNEL_NAME = "xlaunch-browser-tests"
STEPS = 40
DONE = "XLAUNCH-BROWSER-LAUNCH-RETURNED"
CELL = f'''
import time
from tqdm.auto import tqdm
from xlaunch import ProcessState, notebook_launcher

def train():
    rank = ProcessState().process_index
    for _ in tqdm(range({STEPS}), desc=f"rank {{rank}}"):
        time.sleep(0.02)

notebook_launcher(train, num_processes=2)
print("{DONE}")
'''


def program(name: str) -> str:
    """Debian's binary, from PATH (``/usr/bin`` where Debian puts it)."""
    found = shutil.which(name) or shutil.which(name, path="/usr/bin")
    if found is None:
        pytest.skip(f"{name} is not installed (scripts/test.sh installs Debian's chromium and "
                    f"chromium-driver)")
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def family(pid: int) -> list[psutil.Process]:
    try:
        process = psutil.Process(pid)
        return [process, *process.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


@pytest.fixture
def lab(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A JupyterLab server on 127.0.0.1, a free port, a token; stopped with all it started."""
    root = tmp_path / "notebooks"
    root.mkdir()
    with kernel_environment(tmp_path_factory, KERNEL_NAME, "xlaunch browser tests",
                            XLAUNCH_ACCELERATOR="cpu") as env:
        port, token = free_port(), secrets.token_hex(16)
        home = tmp_path / "home"
        env.update(JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
                   HOME=str(home))
        # No "official Jupyter news?" toast over the page (it asks nothing of the network anyway).
        (home / "config" / "labconfig").mkdir(parents=True)
        (home / "config" / "labconfig" / "page_config.json").write_text(json.dumps(
            {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}))
        server = subprocess.Popen(
            [sys.executable, "-m", "jupyterlab", "--no-browser", "--allow-root", "--ip=127.0.0.1",
             f"--port={port}", "--ServerApp.port_retries=0",
             f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}",
             "--LabApp.expose_app_in_browser=True",
             f"--LabApp.workspaces_dir={home / 'workspaces'}",
             f"--LabApp.user_settings_dir={home / 'settings'}",
             "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
             "--LabApp.news_url=None", "--ServerApp.terminals_enabled=False"],
            env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "server.log", "w"),
            start_new_session=True)
        seen: dict[int, psutil.Process] = {}
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 90
            while True:
                try:
                    with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=5):
                        break
                except OSError:
                    if server.poll() is not None or time.monotonic() > deadline:
                        raise AssertionError("JupyterLab did not start: "
                                             + (tmp_path / "server.log").read_text()) from None
                    time.sleep(0.3)
            yield {"url": url, "token": token, "root": root, "server": server, "seen": seen}
        finally:
            seen.update({p.pid: p for p in family(server.pid)})
            server.send_signal(signal.SIGINT)  # shuts its kernels down, then itself
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
            seen.pop(server.pid, None)  # reaped above
            _, survivors = psutil.wait_procs(list(seen.values()), timeout=10)
            for process in survivors:
                process.kill()
            assert not survivors, f"processes outlived the server (killed now): {survivors}"


def listening(processes: list[psutil.Process]) -> set[str]:
    found = set()
    for process in processes:
        try:
            connections = process.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found |= {c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN}
    return found


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[webdriver.Chrome]:
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = program("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1280,900",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(program("chromedriver")))
    try:
        yield driver
    finally:
        driver.quit()


def wait_for(what: str, check, timeout: float) -> object:
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


# Every progress widget the page shows, read from the DOM: its label, its bar's width and style,
# the text beside it (tqdm.notebook: an HBox of an HTML label, a FloatProgress, an HTML text).
READ_BARS = """
return Array.from(document.querySelectorAll('.jp-OutputArea-output .widget-hbox')).map(box => {
  const bar = box.querySelector('.widget-hprogress .progress-bar');
  if (!bar) { return null; }
  return {text: box.innerText, width: bar.style.width, classes: bar.className,
          visible: box.getBoundingClientRect().height > 0};
}).filter(Boolean);
"""


def test_jupyterlab_shows_each_ranks_finished_tqdm_auto_bar(lab: dict, browser, tmp_path: Path
                                                            ) -> None:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "xlaunch browser tests",
                                 "language": "python"}
    nb.cells = [nbformat.v4.new_code_cell(CELL)]
    nbformat.write(nb, lab["root"] / "bars.ipynb")

    browser.get(f"{lab['url']}/lab/tree/bars.ipynb?token={lab['token']}")
    # The app, exposed by --LabApp.expose_app_in_browser, once the notebook's kernel is idle.
    wait_for("the notebook's kernel", lambda: browser.execute_script("""
        const app = window.jupyterapp;
        const panel = app && app.shell.currentWidget;
        const kernel = panel && panel.sessionContext && panel.sessionContext.session
                       && panel.sessionContext.session.kernel;
        return !!(kernel && kernel.status === 'idle');"""), 120)
    lab["seen"].update({p.pid: p for p in family(lab["server"].pid)})
    browser.execute_script("window.jupyterapp.commands.execute('notebook:run-all-cells');")

    wait_for("the launch to return", lambda: DONE in browser.execute_script(
        "return Array.from(document.querySelectorAll('.jp-OutputArea-output'))"
        ".map(e => e.innerText).join('\\n');"), 180)
    processes = family(lab["server"].pid)
    lab["seen"].update({p.pid: p for p in processes})
    # The server and its kernel listen on loopback only.
    assert listening(processes) <= {"127.0.0.1"}, listening(processes)

    # The last update reaches the page up to the relay's flush after the launch returned.
    def finished() -> list[dict]:
        bars = browser.execute_script(READ_BARS)
        return bars if len(bars) == 2 and all(b["width"] == "100%" for b in bars) else []

    try:
        bars = wait_for("two finished bars", finished, 20)
    finally:
        shot = tmp_path / "jupyterlab-bars.png"
        browser.save_screenshot(str(shot))
        (tmp_path / "page.html").write_text(browser.page_source)
    texts = sorted(" ".join(bar["text"].replace("\u2007", " ").split()) for bar in bars)
    for rank, text in enumerate(texts):
        assert text.startswith(f"rank {rank}: 100%"), texts
        assert f"{STEPS}/{STEPS}" in text, texts
    assert all(bar["visible"] and "progress-bar-success" in bar["classes"] for bar in bars), bars
    # No widget left unrendered (the text fallback of a widget JupyterLab could not show).
    outputs = browser.execute_script(
        "return Array.from(document.querySelectorAll('.jp-OutputArea-output')).map(e => e.innerText);")
    assert not any("HBox(children=" in text or "FloatProgress(" in text for text in outputs), outputs

    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "the screenshot is not a PNG"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 800 and height >= 600 and len(data) > 10_000, (width, height, len(data))
    print(f"screenshot: {shot}")
    print(json.dumps(bars, indent=1))
