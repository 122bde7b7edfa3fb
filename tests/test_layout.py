"""The tree shows the design: folders by role, imports that run one way, modules one can read.

Read from the source with `ast` (every import, those inside functions too), so a change that sends
an import against the flow, or grows a module past a sitting's read, fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src" / "xlaunch"
MAX_TOP_LEVEL_MODULES = 8
MAX_MODULE_CODE_LINES = 300
MAX_FUNCTION_CODE_LINES = 60

# What each part may import from xlaunch (besides itself). The flow: detect -> plan -> backends
# -> result; the worker below the backends; names (and the registries a process keeps: sharing,
# stopping) below everything; api and cli on top.
ALLOWED: dict[str, set[str]] = {
    "names": set(),
    "_compat": set(),
    "sharing": set(),
    "stopping": set(),
    "state": {"names", "_compat", "sharing", "stopping"},
    "detect": {"names"},
    "plan": {"names", "detect"},
    "result": {"names"},
    "worker": {"names", "result", "state", "stopping", "_compat"},
    "backends": {"names", "plan", "result", "worker", "stopping", "_compat", "detect.runtime"},
    "api": {"names", "detect", "plan", "backends", "result", "state", "worker", "_compat"},
    "cli": {"names", "detect", "plan", "api", "result", "state", "worker", "backends", "_compat",
            "__init__"},
    "__init__": {"api", "detect", "result", "state"},
    "__main__": {"cli"},
}


def part_of(module: str) -> str:
    """``xlaunch.plan.make`` -> ``plan``; ``xlaunch`` -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports_of(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "xlaunch":
                found |= {f"xlaunch.{alias.name}" for alias in node.names}
            elif node.module.startswith("xlaunch."):
                found.add(node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("xlaunch.")}
        elif isinstance(node, ast.ImportFrom) and node.level:
            found.add(f"relative import at line {node.lineno}")
    return found


def module_name(path: Path) -> str:
    relative = path.relative_to(SRC.parent).with_suffix("")
    parts = list(relative.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


SOURCES = sorted(SRC.rglob("*.py"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_imports_run_one_way(path: Path) -> None:
    here = module_name(path)
    own = part_of(here) if "." in here else "__init__"
    if path.name == "__main__.py":
        own = "__main__"
    for target in imports_of(path):
        assert not target.startswith("relative import"), f"{here}: use absolute imports ({target})"
        theirs = part_of(target)
        if theirs == own or target in ("xlaunch.__version__",):
            continue
        allowed = ALLOWED[own]
        sub = ".".join(target.split(".")[1:3])
        assert theirs in allowed or sub in allowed, f"{here} imports {target} against the flow"


def test_at_most_a_few_modules_at_the_top() -> None:
    top = [p.name for p in SRC.glob("*.py")]
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top
    packages = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").exists())
    assert packages == ["backends", "cli", "detect", "plan", "result", "worker"]


def code_lines(node: ast.AST, source: list[str]) -> int:
    """Lines of code in ``node``: no blank lines, comments or docstrings."""
    docstrings = set()
    for inner in ast.walk(node):
        body = getattr(inner, "body", None)
        if (isinstance(inner, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            docstrings |= set(range(body[0].lineno, body[0].end_lineno + 1))
    start = getattr(node, "lineno", 1)
    end = getattr(node, "end_lineno", len(source))
    return sum(1 for number in range(start, end + 1) if number not in docstrings
               and source[number - 1].strip() and not source[number - 1].strip().startswith("#"))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_modules_and_functions_read_in_one_sitting(path: Path) -> None:
    source = path.read_text().splitlines()
    tree = ast.parse("\n".join(source))
    assert code_lines(tree, source) <= MAX_MODULE_CODE_LINES, path
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            assert code_lines(node, source) <= MAX_FUNCTION_CODE_LINES, f"{path}:{node.name}"
