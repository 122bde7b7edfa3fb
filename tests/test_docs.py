"""Every error message the package can show is in docs/troubleshooting.md, with its cause and fix.

A user who meets an error searches the docs for its words, so each message must be findable there.
The source is read with `ast`: every exception built with a message (``raise ValueError(...)``, an
error handed on unraised, ``ModuleNotFoundError(..., name=...)``), every message of the command
line's ``usage_error(...)``, and the texts of a module's helper that builds one
(``raise RuntimeError(_held(env))``). A message made of strings, f-strings and ``+`` is cut at each
placeholder; its first run of at least `MIN_WORDS` whole constant words, up to `MAX_WORDS` of
them, is the fragment the troubleshooting page must contain (whitespace, backticks and table
escapes aside). A message with no such run is looked for by its longest run, however short.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "src" / "xlaunch"
TROUBLESHOOTING = ROOT / "docs" / "troubleshooting.md"
MIN_WORDS = 4
MAX_WORDS = 10  # enough to be distinctive; the docs may word the rest of a long message
HOLE = "\0"  # stands for a value filled in at run time
MESSAGE_FUNCTIONS = {"usage_error"}  # the command line's own refusals (exit status 2)
# Messages that are not xlaunch's to explain, each with the reason.
EXEMPT = {
    "module 'xlaunch' has no attribute": "Python's own wording for a missing name (module __getattr__)",
}


@dataclass(frozen=True)
class Message:
    where: str  # path:line
    kind: str  # the exception's name, or the message function's
    text: str  # the message, HOLE where a value goes

    @property
    def fragment(self) -> str:
        """The first run of `MIN_WORDS` whole constant words (no partial word glued to a value),
        cut to `MAX_WORDS`; else the longest run there is."""
        runs = []
        pieces = self.text.split(HOLE)
        for index, piece in enumerate(pieces):
            words = piece.split()
            if words and index > 0 and not piece[0].isspace():
                words = words[1:]  # the tail of a word that starts with a value
            if words and index < len(pieces) - 1 and not piece[-1].isspace():
                words = words[:-1]  # the head of a word that ends with a value
            if len(words) >= MIN_WORDS:
                return " ".join(words[:MAX_WORDS])
            runs.append(words)
        return " ".join(max(runs, key=len, default=[]))

    def show(self) -> str:
        return f"{self.where}: {self.kind}: {self.text.replace(HOLE, '{…}')!r}"


def literal(node: ast.expr) -> str | None:
    """The message as text with HOLEs, or None when it is not built from literals."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else HOLE
                       for part in node.values)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = literal(node.left), literal(node.right)
        if left is None and right is None:
            return None
        # A variable added to a literal holds whole words (a sentence built earlier).
        return (HOLE + " " if left is None else left) + (" " + HOLE if right is None else right)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
        template = literal(node.left)
        return None if template is None else re.sub(r"%[-#0 +]*\d*(?:\.\d+)?[a-zA-Z%]", HOLE, template)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "format"):
        template = literal(node.func.value)
        return None if template is None else re.sub(r"\{[^{}]*\}", HOLE, template)
    return None


def called_name(call: ast.Call) -> str:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def is_error_class(name: str) -> bool:
    return name.endswith(("Error", "Exception", "Timeout", "Interrupt"))


def built_by(function: ast.FunctionDef) -> list[tuple[int, str]]:
    """The literal texts a message-building helper assigns or returns (``raise E(_held(env))``)."""
    texts = []
    for node in ast.walk(function):
        value = node.value if isinstance(node, (ast.Assign, ast.AugAssign, ast.Return)) else None
        text = literal(value) if value is not None else None
        if text is not None and text.strip(HOLE + " "):
            texts.append((node.lineno, text))
    return texts


def messages() -> list[Message]:
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        helpers = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
        where = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            name = called_name(node)
            if not (is_error_class(name) or name in MESSAGE_FUNCTIONS):
                continue
            argument = node.args[0]
            if isinstance(argument, ast.Call) and called_name(argument) in helpers:
                texts = built_by(helpers[called_name(argument)])
            else:
                text = literal(argument)
                texts = [(node.lineno, text)] if text is not None and text.strip(HOLE + " ") else []
            found += [Message(f"{where}:{line}", name, text) for line, text in texts]
    return found


def normalized(text: str) -> str:
    return " ".join(text.replace("\\|", "|").replace("`", "").split())


def test_the_walk_finds_the_package_messages():
    found = messages()
    fragments = [message.fragment for message in found]
    assert len(found) >= 30, [m.show() for m in found]
    assert "is not a port number" in " | ".join(fragments)  # an f-string
    assert "a GPU launch was asked for (XLAUNCH_ACCELERATOR=cuda) but no GPU" in " | ".join(
        fragments)  # a concatenation


def test_every_error_message_is_in_troubleshooting():
    page = normalized(TROUBLESHOOTING.read_text())
    missing = [message for message in messages()
               if not any(exempt in message.text for exempt in EXEMPT)
               and normalized(message.fragment) not in page]
    assert not missing, (
        f"{len(missing)} message(s) of src/xlaunch missing from docs/troubleshooting.md (add each, "
        "with its cause and fix, quoting at least the words shown):\n"
        + "\n".join(f"  {m.show()}\n    look for: {m.fragment!r}" for m in missing))


def test_troubleshooting_covers_what_users_meet_beyond_the_package():
    page = normalized(TROUBLESHOOTING.read_text())
    for words in ("gradients were not averaged", "No module named 'torch_xla'",
                  "Runtime is already initialized", "Expected 4 worker addresses, got 1",
                  "Cannot re-initialize CUDA in forked subprocess", "BrokenProcessPool"):
        assert normalized(words) in page, words


# The pages a user reads: every *.py they name and every launch parameter they show must exist.
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "bench" / "README.md"]
# Scripts of the user's own, named in examples (`xlaunch run train.py`): not files of this source.
USER_SCRIPTS = {"train.py", "script.py", "train_mnist.py"}
LAUNCHERS = {"notebook_launcher": "notebook_launcher", "launch": "notebook_launcher",
             "debug_launcher": "debug_launcher"}


def page_text(page: Path) -> str:
    return page.read_text()


def named_py_files(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.py)\b(?!\w)", text))


def test_the_walks_find_py_files_and_launch_parameters():
    text = ("Run `bench/compare.py` or `python train.py`, see /tmp/x/998.py.\n"
            "```python\nxlaunch.launch(train, args=(1, {'a': 2}),\n    num_procs=2, timeout=f(x=1))\n```\n"
            "accelerate.notebook_launcher(f, num_processes=n) and torch_xla.launch(fn, args)")
    assert named_py_files(text) == {"bench/compare.py", "train.py"}
    assert launch_calls(text) == [("notebook_launcher", ["args", "num_procs", "timeout"])]


def test_every_py_file_a_page_names_exists():
    files = {path.name for path in ROOT.rglob("*.py") if ".git" not in path.parts}
    missing = []
    for page in PAGES:
        for name in sorted(named_py_files(page_text(page))):
            if name in USER_SCRIPTS:
                continue
            found = ((ROOT / name).is_file() or (page.parent / name).is_file()
                     or ("/" not in name and name in files))
            if not found:
                missing.append(f"{page.relative_to(ROOT)}: {name}")
    assert not missing, "pages name .py files this source does not have:\n" + "\n".join(missing)


def launch_calls(text: str) -> list[tuple[str, list[str]]]:
    """(launcher, keyword names) for every call of xlaunch's launchers a page shows, in code or
    prose, across lines; calls of accelerate's or torch_xla's own launchers are left out."""
    calls = []
    for match in re.finditer(r"(?:\b(\w+)\.)?\b(notebook_launcher|launch|debug_launcher)\(", text):
        if match.group(1) not in (None, "xlaunch"):
            continue  # accelerate.notebook_launcher, torch_xla.launch: not ours
        depth, outer, quote = 1, [], ""
        for char in text[match.end():match.end() + 2000]:
            if quote:
                quote = "" if char == quote else quote
            elif char in "\"'":
                quote = char
            elif char in "([{":
                depth += 1
            elif char in ")]}":
                depth -= 1
                if depth == 0:
                    break
            if depth == 1 and not quote:
                outer.append(char)
        keywords = re.findall(r"(?<![\w=!<>])(\w+)\s*=(?!=)", "".join(outer))
        calls.append((LAUNCHERS[match.group(2)], keywords))
    return calls


def test_every_launch_parameter_a_page_names_exists():
    import inspect

    import xlaunch

    parameters = {name: set(inspect.signature(getattr(xlaunch, name)).parameters)
                  for name in set(LAUNCHERS.values())}
    seen, unknown = 0, []
    for page in PAGES:
        for launcher, keywords in launch_calls(page_text(page)):
            seen += 1
            unknown += [f"{page.relative_to(ROOT)}: {launcher}({keyword}=...)"
                        for keyword in keywords if keyword not in parameters[launcher]]
    assert seen >= 20, seen
    assert not unknown, "calls naming parameters the launcher does not have:\n" + "\n".join(unknown)


def test_the_parameter_table_is_the_signature():
    import inspect

    import xlaunch

    page = (ROOT / "docs" / "api" / "launch.md").read_text()
    table = page.split("### Parameters", 1)[1].split("\n\n", 2)[1]
    documented = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert documented and len(documented) == len(set(documented)), documented
    assert set(documented) == set(inspect.signature(xlaunch.notebook_launcher).parameters)


def keyword_only() -> list[str]:
    import inspect

    import xlaunch

    return [name for name, parameter in inspect.signature(xlaunch.notebook_launcher).parameters.items()
            if parameter.kind is parameter.KEYWORD_ONLY]


@pytest.mark.parametrize("page", ["README.md", "docs/index.md", "docs/accelerate.md"])
def test_the_parameters_added_to_accelerates_signature_are_listed_the_same(page: str):
    # What xlaunch adds to accelerate's notebook_launcher: its keyword-only parameters, as help()
    # shows them. Each page that introduces the call lists them all, in one passage, in order.
    added = keyword_only()
    assert len(added) >= 5, added
    passages = [" ".join(p.split()) for p in re.split(r"\n\s*\n", (ROOT / page).read_text())
                if "keyword-only" in p]
    listing = ", ".join(f"`{name}`" for name in added[:-1]) + f" and `{added[-1]}`"
    assert any(listing in passage for passage in passages), (listing, passages)


REPORT_RULE = ("shown when it has something to say: always on the TPU paths (xla, torch_tpu), on "
               "the other paths only when it has a warning or torch.compile counters, never when no "
               "rank reported; a table in a notebook, text on stderr elsewhere; a failed launch shows "
               "none: its error carries it (error.report) and says its warnings")


@pytest.mark.parametrize("where", ["README.md", "docs/report.md", "docs/api/launch.md",
                                   "the report= docstring"])
def test_one_description_of_when_the_report_shows(where: str):
    import inspect

    import xlaunch

    if where == "the report= docstring":
        doc = inspect.getdoc(xlaunch.notebook_launcher) or ""
        text = doc.split("report:", 1)[1].split("stop_grace:", 1)[0]
    else:
        text = (ROOT / where).read_text()
    assert REPORT_RULE in normalized(text), where


def test_the_index_is_right_about_torch_tpu():
    # TorchTPU spawns its workers (the function travels pickled, by value) and its handshake
    # listens on every interface: the overview must not promise otherwise.
    page = normalized((ROOT / "docs" / "index.md").read_text()).lower()
    for untrue in ("nothing is pickled", "no socket beyond loopback"):
        assert untrue not in page, untrue
    assert "cloudpickle" in page and "every interface" in page


def test_the_readme_is_for_users():
    readme = (ROOT / "README.md").read_text()
    assert "No path has run on real TPUs or GPUs yet" in readme
    assert "`xlaunch check`" in readme and "bench/README.md" in readme
    assert "bash scripts/demo.sh" in readme and "bash scripts/test.sh" in readme
    assert "pip install build" in readme and "LICENSE" in readme
    # Benchmark notes live in bench/README.md: no times of day, no path outside this source, and
    # no "last release" (there has been none).
    assert not re.search(r"\b\d{1,2}:\d\d UTC\b", readme), "times of day belong in bench/README.md"
    assert "../" not in readme and "last release" not in readme.lower()
    assert len(readme.splitlines()) < 200
