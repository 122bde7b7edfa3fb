"""The chip table's torch_xla column is the installed torch_xla's own (read from its source
module: nothing here asks a TPU or its metadata server)."""

from __future__ import annotations

from xlaunch.detect.chips import CHIPS
from xlaunch.detect.runtime import NEWEST_TORCH_XLA, installed_version, release


def test_the_ids_and_cores_are_torch_xlas_own() -> None:
    from torch_xla._internal import tpu

    theirs = set(tpu._TPU_PCI_DEVICE_IDS)
    # The table follows the newest release; an older one lists fewer ids (2.8 has no 7x).
    if release(installed_version("torch_xla")) == NEWEST_TORCH_XLA:
        assert set(CHIPS) == theirs
    assert theirs <= set(CHIPS)
    # num_logical_cores_per_chip(): 2 on v2/v3 (TPU version <= 3), else 1.
    assert {pci: CHIPS[pci].torch_xla.cores for pci in theirs} == {
        pci: 2 if pci == "0x0027" else 1 for pci in theirs}
