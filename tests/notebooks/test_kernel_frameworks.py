"""Other frameworks inside a launch, in a real Jupyter kernel: Lightning's ``ddp`` on the launch's
processes gives Lightning's own result; a launcher started inside a worker (Lightning's
``ddp_notebook``, a nested ``notebook_launcher``) is refused at once, saying what serves."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("pytorch_lightning")
pytestmark = pytest.mark.timeout(300)

LIGHTNING = '''
import torch, torch.nn as nn
import pytorch_lightning as pl
from xlaunch import LaunchError, notebook_launcher

class Regression(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 1)
    def training_step(self, batch, index):
        x, y = batch
        return ((self.layer(x) - y) ** 2).mean()
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

def fit(strategy):
    torch.manual_seed(0)
    model = Regression()
    data = torch.randn(64, 4, generator=torch.Generator().manual_seed(1))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(data, data.sum(1, keepdim=True)), batch_size=8)
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(model, loader)
    return {name: value.detach().clone() for name, value in model.state_dict().items()}
'''


def test_lightning_ddp_on_the_launchs_processes_gives_lightnings_own_result(kernel):
    assert kernel.run(LIGHTNING).status == "ok"
    own = kernel.run('own = fit("ddp_notebook")')  # Lightning launching its own processes
    assert own.status == "ok", own.describe()
    cell = kernel.run('ours = notebook_launcher(fit, args=("ddp",), num_processes=2)\n'
                      'print("same", all(torch.allclose(own[k], ours[k], atol=1e-6) for k in own))')
    assert cell.status == "ok", cell.describe()
    assert "same True" in cell.stdout, cell.describe()


def test_lightnings_ddp_notebook_inside_a_launch_is_refused_within_seconds(kernel):
    assert kernel.run(LIGHTNING).status == "ok"
    started = time.monotonic()
    cell = kernel.run('notebook_launcher(fit, args=("ddp_notebook",), num_processes=2, timeout=120)')
    assert time.monotonic() - started < 60, "it waited instead of being refused"
    assert cell.status == "error" and cell.error["ename"] == "LaunchError", cell.describe()
    assert 'strategy="ddp"' in cell.error["evalue"] and "inside a worker" in cell.error["evalue"]


def test_a_nested_notebook_launcher_is_refused_at_once(kernel):
    cell = kernel.run(
        'from xlaunch import notebook_launcher\n'
        'def inner():\n    return 1\n'
        'def outer():\n    return notebook_launcher(inner, num_processes=2)\n'
        'notebook_launcher(outer, num_processes=2, timeout=120)')
    assert cell.status == "error" and cell.error["ename"] == "LaunchError", cell.describe()
    assert "called inside a launched function" in cell.error["evalue"]


def test_input_in_a_worker_fails_at_once_though_the_frontend_offers_stdin(kernel):
    """A forked worker kept the kernel's input(), which asks the frontend over the kernel's own
    socket: nobody answers a worker, and the launch waited in silence."""
    asked: list[dict] = []
    started = time.monotonic()
    cell = kernel.run(
        'from xlaunch import notebook_launcher\n'
        'def asks():\n    return input("your name? ")\n'
        'notebook_launcher(asks, num_processes=2, timeout=120)', stdin_hook=asked.append)
    assert time.monotonic() - started < 60 and asked == [], "a worker asked the frontend"
    assert cell.status == "error" and "workers have no stdin" in cell.error["evalue"]
