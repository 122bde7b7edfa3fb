"""Each `_compat` helper on the releases installed here: its private detail is where it was, so
no loud fallback fires. The core tier runs this on every torch release the suite has (2.8, 2.13,
2.15); the xla and torch_tpu tiers check their own helpers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

from xlaunch import _compat


def fallbacks_fired(code: str) -> str:
    """Run ``code`` in a fresh interpreter with xlaunch's warnings as errors; its stderr."""
    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c",
                           textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_dynamo_counts_read_what_torch_compile_did():
    out = fallbacks_fired("""
        import torch
        from xlaunch import _compat
        before = _compat.dynamo_counts()
        compiled = torch.compile(lambda x: x * 2 + 1, backend="eager")
        compiled(torch.ones(3))
        compiled(torch.ones(3, 4))  # another shape: a recompilation of the same frame
        now = _compat.dynamo_counts()
        print(before is None or before["frames"] == 0, now["frames"] >= 2,
              max(now["per_frame"].values()) >= 2)
    """)
    assert out.split() == ["True", "True", "True"]


def test_raise_in_thread_reaches_a_thread_at_its_next_instruction():
    class Stop(Exception):
        pass

    caught: list[BaseException] = []
    ready = threading.Event()

    def spin() -> None:
        ready.set()
        try:
            while True:
                time.sleep(0.01)
        except Stop as stop:
            caught.append(stop)

    thread = threading.Thread(target=spin)
    thread.start()
    ready.wait()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert _compat.raise_in_thread(thread.ident, Stop)
    thread.join(10)
    assert caught and isinstance(caught[0], Stop)


def test_lightning_told_a_worker_is_not_interactive():
    pytest.importorskip("pytorch_lightning")
    out = fallbacks_fired("""
        import sys
        sys.ps1 = ">>> "  # a kernel's prompt, there when Lightning is imported
        import pytorch_lightning
        import lightning_fabric.utilities.imports as imports
        from pytorch_lightning.trainer.connectors import accelerator_connector
        from xlaunch import _compat
        assert imports._IS_INTERACTIVE and accelerator_connector._IS_INTERACTIVE
        _compat.lightning_in_a_worker()
        print(imports._IS_INTERACTIVE, accelerator_connector._IS_INTERACTIVE)
    """)
    assert out.split() == ["False", "False"]


COMPILED_THEN_LAUNCHED = """
    import torch, xlaunch
    from xlaunch.detect.machine import Machine

    model = torch.compile(torch.nn.Linear(4, 4))
    model(torch.randn(2, 4)).sum().backward()  # a notebook that tried one compiled step first
    print("autograd threads", Machine.here().autograd_threads)

    def backward():
        x = torch.ones(3, requires_grad=True)
        (x * 2).sum().backward()
        return float(x.grad.sum())

    if __name__ == "__main__":
        print("result", xlaunch.notebook_launcher(backward, num_processes=2))
"""


def test_a_launch_after_a_compiled_backward_runs_its_workers_backward(tmp_path):
    """On torch's CUDA builds a compiled backward starts autograd's device threads, and a forked
    worker's backward then fails in every rank; the launch spawns them instead, saying so. On the
    CPU build no such thread starts, and the workers fork as ever."""
    script = tmp_path / "compiled_first.py"
    script.write_text(textwrap.dedent(COMPILED_THEN_LAUNCHED))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=600, env={**__import__("os").environ, "XLAUNCH_ACCELERATOR": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "result 6.0" in done.stdout, done.stdout + done.stderr[-2000:]
    threads = "autograd threads True" in done.stdout
    assert ("spawned, not forked" in done.stderr) == threads, done.stderr[-2000:]
    assert ("(gloo, spawn)" if threads else "(gloo, fork)") in done.stderr


def test_a_stand_in_is_put_back_even_when_the_code_inside_raises() -> None:
    import types

    owner = types.SimpleNamespace(spawn="original")
    with pytest.raises(KeyError):
        with _compat.standing_in(owner, "spawn", "stand-in"):
            assert owner.spawn == "stand-in"
            raise KeyError("the script failed")
    assert owner.spawn == "original"


def test_a_stand_in_for_a_name_that_is_gone_is_said_loudly() -> None:
    import types

    owner = types.SimpleNamespace(__name__="torch_xla")
    with pytest.warns(RuntimeWarning, match=r"torch_xla.launch is gone in this release"):
        with _compat.standing_in(owner, "launch", "stand-in"):
            assert not hasattr(owner, "launch")
    assert not hasattr(owner, "launch")
