"""Every install line a user can copy works as written today, or says it is for later.

xlaunch is not on the package registry yet, so ``pip install xlaunch`` fails on a fresh machine
(and anyone could register the name). Each ``pip install`` in the README, the docs and the
notebooks must therefore install only what the registry has (the names below, pinned here because
CI has no registry to ask), or a local file or folder (the wheel ``python -m build`` makes, a
clone of the source), or carry `MARK`: the line for after the first release, which the page then
puts next to the line that works now. docs/release.md says what to change on the day.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "after the first release"
# On the package registry today (each checked by installing it on a fresh machine).
REGISTRY = {"torch", "torch_xla", "torch-xla", "libtpu", "cloud-tpu-client", "torch-tpu",
            "accelerate", "build", "twine", "tqdm", "mkdocs"}
PIP = re.compile(r"pip install((?:\s+[^\s`|]+)+)")


def sources() -> list[tuple[str, str]]:
    """(where, line) for every line of the README, the docs and the notebooks' cells."""
    found = []
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    for page in pages:
        for number, line in enumerate(page.read_text().splitlines(), start=1):
            found.append((f"{page.relative_to(ROOT)}:{number}", line))
    for notebook in sorted((ROOT / "colab").glob("*.ipynb")):
        for index, cell in enumerate(json.loads(notebook.read_text())["cells"]):
            for line in "".join(cell["source"]).splitlines():
                found.append((f"{notebook.relative_to(ROOT)} cell {index}", line))
    return found


def requirements(line: str) -> list[str]:
    """The things each ``pip install`` on the line would fetch (options and paths left out)."""
    wanted = []
    for match in PIP.finditer(line):
        words = match.group(1).replace('"', " ").replace("'", " ").split()
        for word in words:
            if word.startswith(("http://", "https://")):
                continue  # an index's address (--index-url), not a package
            if word.startswith(("-", "#")) or word in ("\\", "&&", ";"):
                if word.startswith("#"):
                    break
                continue
            if word.startswith(("/", "./", "../", "~", "$", "{")) or word.endswith(".whl"):
                continue  # a local file or folder: the wheel, a clone
            if not re.match(r"^[A-Za-z0-9]", word):
                break  # prose after the command
            wanted.append(word)
    return wanted


def name_of(requirement: str) -> str:
    return re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower()


def test_the_walk_finds_the_install_lines():
    lines = [line for _, line in sources() if "pip install" in line]
    assert len(lines) >= 10
    assert requirements('pip install torch==2.9.0 "torch_xla[tpu]==2.9.0" xlaunch') == [
        "torch==2.9.0", "torch_xla[tpu]==2.9.0", "xlaunch"]
    assert requirements("%pip install --quiet /content/xlaunch-*.whl") == []
    assert requirements("`pip install xlaunch` keeps them") == ["xlaunch"]


def test_every_install_line_works_today_or_is_marked_for_after_the_release():
    unresolvable = []
    for where, line in sources():
        names = {name_of(requirement) for requirement in requirements(line)}
        unknown = sorted(names - REGISTRY)
        if unknown and MARK not in line.lower():
            unresolvable.append(f"{where}: {unknown}: {line.strip()}")
    assert not unresolvable, (
        "install lines naming packages the registry does not have (mark them "
        f"'{MARK}' next to a line that works now):\n" + "\n".join(unresolvable))


def test_each_page_with_a_marked_line_also_gives_the_line_that_works_now():
    pages: dict[str, list[str]] = {}
    for where, line in sources():
        pages.setdefault(where.split(":")[0].split(" cell ")[0], []).append(line)
    for page, lines in pages.items():
        marked = [line for line in lines if MARK in line.lower() and "pip install" in line]
        if marked:
            works = [line for line in lines if "pip install" in line and MARK not in line.lower()
                     and re.search(r"xlaunch-\*\.whl|\.whl|\./xlaunch|/xlaunch\b|\{wheel\}", line)]
            assert works, f"{page}: only the line for after the first release: {marked}"


def passages() -> list[tuple[str, str]]:
    """(where, text) for every paragraph of the README and the docs and every notebook cell,
    whitespace made single, so a sentence wrapped over lines reads as one."""
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for index, paragraph in enumerate(re.split(r"\n\s*\n", page.read_text())):
            found.append((f"{page.relative_to(ROOT)} paragraph {index}", " ".join(paragraph.split())))
    for notebook in sorted((ROOT / "colab").glob("*.ipynb")):
        for index, cell in enumerate(json.loads(notebook.read_text())["cells"]):
            text = " ".join("".join(cell["source"]).split())
            found.append((f"{notebook.relative_to(ROOT)} cell {index}", text))
    return found


def test_every_build_of_the_wheel_says_pip_install_build_first():
    # A fresh Python has no `build` module: "python -m build" alone fails with "No module named
    # build". Each place that says to run it says, before it, to install it.
    building = [(where, text) for where, text in passages() if "python -m build" in text]
    assert len(building) >= 5, building
    bare = [f"{where}: {text[:160]}" for where, text in building
            if any("pip install build" not in text[:at]
                   for at in [m.start() for m in re.finditer(r"python -m build", text)])]
    assert not bare, "`python -m build` without `pip install build` before it:\n" + "\n".join(bare)
