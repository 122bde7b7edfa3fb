"""The tree shows the design: folders by role, imports that run one way, modules one can read.

Read from the source with `ast` (every import, those inside functions too), so a change that sends
an import against the flow, or grows a module past a sitting's read, fails here.
"""

from __future__ import annotations

import ast
import sys
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
    "detect": {"names", "_compat"},
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
            elif node.module.startswith("xlaunch."):  # a package's submodules are theirs
                found |= {f"{node.module}.{alias.name}" if _module_file(
                    f"{node.module}.{alias.name}") else node.module for alias in node.names}
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


# --- one owner of a launch's processes ----------------------------------------------------------

OWNER = SRC / "backends" / "processes.py"
# Signals sent elsewhere, each not to a worker: a process ending itself of the signal it was sent
# (stopping.py), a timeout raised in the caller's own thread (inline.py), and the null signal
# that only asks whether a process exists (launch_dir.py's sweep).
NOT_TO_A_WORKER = {("stopping.py", "os.kill"), ("inline.py", "signal.pthread_kill")}
SIGNALLING = {"os.kill", "os.killpg", "signal.pthread_kill", "signal.pidfd_send_signal"}
SIGNALLING_METHODS = {"terminate", "kill", "send_signal"}


def signals_sent(path: Path) -> list[str]:
    """Every call in ``path`` that sends a signal, as ``name:line``, less the null signal."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        null = len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value == 0
        if name in SIGNALLING:
            if not null and (path.name, name) not in NOT_TO_A_WORKER:
                found.append(f"{name}:{node.lineno}")
        elif isinstance(node.func, ast.Attribute) and node.func.attr in SIGNALLING_METHODS:
            found.append(f"{name}:{node.lineno}")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_no_module_but_the_owner_signals_a_worker(path: Path) -> None:
    if path == OWNER:
        assert signals_sent(path), "the owner is where every stop is sent from"
        return
    assert signals_sent(path) == [], f"{path.name} signals a process: only {OWNER.name} may"


def test_the_owner_check_would_see_a_signal_sent_elsewhere(tmp_path: Path) -> None:
    stray = tmp_path / "stray.py"
    stray.write_text("import os, signal\ndef f(p, pid):\n    os.kill(pid, signal.SIGTERM)\n"
                     "    p.terminate()\n    os.kill(pid, 0)\n")
    assert signals_sent(stray) == ["os.kill:3", "p.terminate:4"]


def test_compat_patches_no_library_and_swaps_no_process_wide_state() -> None:
    """Every private API is read in _compat; none is written: no attribute of another module
    assigned, no setattr, no module-level registry swapped. The exceptions: in a worker only,
    Lightning's "interactive" flag, which it computed from the kernel before the fork; the send
    of the forked copy of the kernel's session (what the worker displays goes to the caller,
    which the kernel's own session would drop); and the public functions a worker's own code
    finds standing in while it runs (`standing_in`: a script's process group, its xmp.spawn,
    use_spmd in a replica), put back after. In the caller, multiprocessing's default context put
    back to unset when CPython's spawn preparation fixed it while a launch started a process of
    its own explicit context (it undoes a change, never makes one)."""
    tree = ast.parse((SRC / "_compat.py").read_text())
    writes = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        writes += [ast.unparse(t) for t in targets if isinstance(t, ast.Attribute)]
        if isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "delattr"):
            writes.append(ast.unparse(node))
    assert sorted(writes) == ["default._actual_context", "module._IS_INTERACTIVE", "session.send",
                              "setattr(owner, name, original)", "setattr(owner, name, stand_in)"]


# --- a plan that decides from what it is given --------------------------------------------------

PROCESS_WIDE = {"os.environ", "os.getpid", "os.getenv", "Machine.here", "sys.modules", "os.path.expanduser",
                "os.getcwd", "os.cpu_count", "os.sched_getaffinity"}


def process_wide_reads(path: Path) -> list[str]:
    """Reads of process-wide state in ``path``: the names above, and torch in any form."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and ast.unparse(node) in PROCESS_WIDE:
            found.append(f"{ast.unparse(node)}:{node.lineno}")
        elif isinstance(node, ast.Name) and node.id in ("torch", "torch_xla"):
            found.append(f"{node.id}:{node.lineno}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            names += [alias.name for alias in node.names]
            found += [f"import {name}:{node.lineno}" for name in names
                      if name.split(".")[0] in ("torch", "torch_xla", "torch_tpu")
                      or name == "environ"]
    return found


@pytest.mark.parametrize("path", sorted((SRC / "plan").glob("*.py")), ids=lambda p: p.name)
def test_the_plan_reads_no_process_wide_state(path: Path) -> None:
    """The plan reads the environment mapping, the machine's facts and the options it is given:
    what this process did (CUDA, the XLA runtime, autograd's threads) is gathered before."""
    assert process_wide_reads(path) == [], f"{path.name} reads process-wide state"


def test_the_purity_check_would_see_a_read(tmp_path: Path) -> None:
    impure = tmp_path / "impure.py"
    impure.write_text("import os, sys\nfrom os import environ\nimport torch\n"
                      "def f(machine):\n    os.environ.get('X'); os.getpid()\n"
                      "    Machine.here(); sys.modules.get('torch')\n")
    assert sorted(process_wide_reads(impure)) == sorted([
        "import environ:2", "import torch:3", "os.environ:5", "os.getpid:5", "Machine.here:6",
        "sys.modules:6"])


# --- another library's private names and functions: in _compat only ---------------------------


def _libraries_bound(tree: ast.AST) -> set[str]:
    """Names a module binds to another library's module (not xlaunch's, not the standard
    library's): its imports, and its ``sys.modules`` look-ups."""
    bound = set()
    for node in ast.walk(tree):
        pairs: list[tuple[str, str]] = []
        if isinstance(node, ast.Import):
            pairs = [(alias.name, alias.asname or alias.name.split(".")[0]) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            pairs = [(node.module, alias.asname or alias.name) for alias in node.names]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            looked_up = [ast.literal_eval(inner.args[0]) for inner in ast.walk(node.value)
                         if isinstance(inner, ast.Call) and ast.unparse(inner.func) ==
                         "sys.modules.get" and isinstance(inner.args[0], ast.Constant)]
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            pairs = [(module, target.id) for module in looked_up for target in targets
                     if isinstance(target, ast.Name)]
        bound |= {name for module, name in pairs
                  if module.split(".")[0] not in ("xlaunch", *sys.stdlib_module_names)}
    return bound


def _root(node: ast.AST) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_uses_and_patches(path: Path) -> list[str]:
    """``library._name`` reads, ``setattr``/``delattr`` calls and attribute writes on another
    library's module in ``path``, as ``what:line``."""
    tree = ast.parse(path.read_text())
    libraries = _libraries_bound(tree)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__") and _root(node.value) in libraries
                and not isinstance(node.ctx, ast.Store)):
            found.append(f"private {ast.unparse(node)}:{node.lineno}")
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("setattr", "delattr") \
                and node.args and _root(node.args[0]) in libraries:
            found.append(f"{ast.unparse(node.func)}:{node.lineno}")
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and _root(node.value) in libraries:
            found.append(f"write {ast.unparse(node)}:{node.lineno}")
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_private_names_and_patches_of_other_libraries_are_in_compat_only(path: Path) -> None:
    if path.name == "_compat.py":
        return
    assert private_uses_and_patches(path) == [], f"{path.name}: through _compat.py only"


def test_the_compat_check_would_see_a_private_name_and_a_patch(tmp_path: Path) -> None:
    stray = tmp_path / "stray.py"
    stray.write_text(
        "import sys\nimport torch_xla\nimport torch.distributed as dist\n"
        "def f(x):\n    torch_xla._XLAC._get_xla_sharding_spec(x)\n"
        "    setattr(torch_xla, 'launch', f)\n    dist.init_process_group = f\n"
        "    mod = sys.modules.get('torch_xla.runtime')\n    mod.use_spmd = f\n"
        "    sys._getframe(0); x._private; setattr(sys, 'ps1', '>')\n")
    assert sorted(private_uses_and_patches(stray)) == sorted([
        "private torch_xla._XLAC._get_xla_sharding_spec:5", "private torch_xla._XLAC:5",
        "setattr:6", "write dist.init_process_group:7", "write mod.use_spmd:9"])


# --- no import circle ----------------------------------------------------------------------------


def _module_file(module: str) -> Path | None:
    """The file of an xlaunch module (a package's __init__.py), or None for a name in one."""
    base = SRC.parent.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def import_graph() -> dict[Path, set[Path]]:
    """file -> the xlaunch files it imports (inside functions and TYPE_CHECKING blocks too; an
    imported name that is no module counts as its module)."""
    graph = {}
    for path in SOURCES:
        targets = set()
        for module in imports_of(path):
            target = _module_file(module) or _module_file(module.rsplit(".", 1)[0])
            if target is not None and target != path:
                targets.add(target)
        graph[path] = targets
    return graph


def circles(graph: dict[Path, set[Path]]) -> list[list[str]]:
    """The import circles of ``graph`` (Tarjan's strongly connected components of 2+ files)."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    stack: list[Path] = []
    found = []

    def visit(node: Path) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(str(member.relative_to(SRC)))
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_import_circle() -> None:
    assert circles(import_graph()) == []


def test_the_circle_check_would_see_one() -> None:
    files = {name: SRC / f"{name}.py" for name in "abc"}
    graph = {files["a"]: {files["b"]}, files["b"]: {files["a"], files["c"]}, files["c"]: set()}
    assert circles(graph) == [["a.py", "b.py"]]


# --- the launch folder's protocol: every file name in worker/launch_dir.py alone ----------------

LAUNCH_DIR = SRC / "worker" / "launch_dir.py"


def protocol_names() -> list[str]:
    """The fixed part of every name the launch folder's protocol defines (its constants and
    marks), as launch_dir.py spells them."""
    import xlaunch.worker.launch_dir as launch_dir

    patterns = [value for name, value in vars(launch_dir).items()
                if name.isupper() and isinstance(value, str) and name not in ("PREFIX",)]
    marks = [value for name, value in vars(launch_dir.Mark).items() if name.isupper()]
    parts = [part for pattern in patterns + [f"{mark}-" for mark in marks]
             for part in pattern.split("{}")]
    return [part for part in parts if "-" in part or "." in part]  # a word alone may be prose


def names_spelled_out(path: Path, names: list[str]) -> list[str]:
    """String literals in ``path`` (docstrings aside) that spell a name of the protocol."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                       ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                and id(node) not in docstrings):
            text = node.value
            found += [f"{text!r}:{node.lineno}" for name in names if text.startswith(name)]
    return found


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(SRC)))
def test_the_launch_folders_file_names_are_written_in_its_module_alone(path: Path) -> None:
    if path == LAUNCH_DIR:
        return
    assert names_spelled_out(path, protocol_names()) == [], \
        f"{path.name}: name launch-folder files through worker/launch_dir.py's constants"


def test_the_protocol_check_would_see_a_name_spelled_out(tmp_path: Path) -> None:
    stray = tmp_path / "stray.py"
    stray.write_text('"""A docstring may say pid-N."""\ndef f(folder):\n'
                     '    return folder / f"stack-{1}", folder / "group-store", "returned-"\n')
    assert sorted(names_spelled_out(stray, protocol_names())) == [
        "'group-store':3", "'returned-':3", "'stack-':3"]
