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
    assert "CUDA was already initialised in this process" in " | ".join(fragments)  # a concatenation


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
