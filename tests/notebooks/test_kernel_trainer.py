"""transformers' ``Trainer`` under a launch, in a real Jupyter kernel (issue 31): its notebook
progress table (an HTML display that its ``NotebookProgressCallback`` updates in place) reaches the
launching cell and ends at the run's last step with the logged losses, one table per rank.

Before displays travelled, a forked worker's display was dropped by jupyter_client ("attempted to
send message from fork"): the cell showed no table, and ``disable_tqdm=True`` was the only way to
see the losses. A tiny GPT-2 made from a config: nothing is downloaded.
"""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.timeout(300)

TRAINER = '''
import os, tempfile
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from transformers.utils.notebook import NotebookProgressCallback
from xlaunch import ProcessState, notebook_launcher

class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 64
    def __getitem__(self, index):
        ids = torch.arange(8) * (index + 1) % 32
        return {"input_ids": ids, "labels": ids}

def train(output_dir, one_table=False):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=32, n_positions=8, n_embd=16, n_layer=1,
                                       n_head=2))
    arguments = TrainingArguments(output_dir=output_dir, max_steps=8, logging_steps=2,
                                  per_device_train_batch_size=4, learning_rate=1e-3,
                                  save_strategy="no", report_to=[], use_cpu=True,
                                  dataloader_num_workers=0)
    trainer = Trainer(model=model, args=arguments, train_dataset=Tokens())
    if one_table and not ProcessState().is_main_process:  # as docs/output.md shows
        trainer.remove_callback(NotebookProgressCallback)
    return trainer.train().global_step
'''


def loss_tables(cell):
    return [data["text/html"] for data in cell.shown
            if "text/html" in data and "Training Loss" in data["text/html"]]


def test_the_trainers_progress_table_reaches_the_cell_at_its_last_step(kernel):
    assert kernel.run(TRAINER).status == "ok"
    cell = kernel.run('notebook_launcher(train, args=(tempfile.mkdtemp(),), num_processes=2, '
                      'timeout=240)')
    assert cell.status == "ok", cell.describe()
    assert cell.results == ["8"], cell.describe()
    # NotebookProgressCallback draws on every rank (it asks nothing of the rank): one table per
    # rank, each its own display, as the same Trainer in each of two kernels would show.
    tables = loss_tables(cell)
    assert len(tables) == 2, (cell.shown, cell.describe())
    for table in tables:
        # The bar at its end (8 of 8 steps), and a row of the loss table for each logged step.
        assert re.search(r"<progress[^>]*value='8'[^>]*max='8'", table), table
        logged = re.findall(r"<td>(\d+)</td>\s*<td>([0-9.]+)</td>", table)
        assert [step for step, _ in logged] == ["2", "4", "6", "8"], table
    # Each table was updated in place: one output per rank, not one per update.
    updated = {display_id for display_id, data in cell.display_updates
               if "Training Loss" in data.get("text/html", "")}
    assert len(updated) == 2, cell.display_updates
    # The kernel published them: no worker wrote to the kernel's sockets. (Before, a worker's
    # display got through only where something had flushed the kernel's own stdout in the fork,
    # which makes ipykernel lift its fork check: by chance, and lost when the worker ended first.)
    assert cell.display_senders == {kernel.pid}, (cell.display_senders, kernel.pid)


def test_the_main_process_alone_shows_the_table_once_the_others_drop_its_callback(kernel):
    assert kernel.run(TRAINER).status == "ok"
    cell = kernel.run('notebook_launcher(train, args=(tempfile.mkdtemp(), True), num_processes=2, '
                      'timeout=240)')
    assert cell.status == "ok", cell.describe()
    tables = loss_tables(cell)
    assert len(tables) == 1 and "<td>8</td>" in tables[0], (cell.shown, cell.describe())
