"""Every TPU chip xlaunch knows, by PCI device id, and what each TPU runtime makes of it.

The one chip table. Both runtimes find TPUs the same way (PCI vendor ``0x1ae0``, a device id
from their own list) and disagree about some ids, so each column is one library's fact, named
after that library, with the file and release it copies:

- ``torch_xla``: what torch_xla spawns on the chip (``torch_xla/_internal/tpu.py``, 2.9:
  ``_TPU_PCI_DEVICE_IDS`` and ``num_logical_cores_per_chip``). torch_xla lists 0x0056 and 0x0062
  as "testing only": TPUs of unknown generation to it, one core per chip. (torch_xla 2.8, which
  Kaggle pins, does not list 0x0076 yet.)
- ``torch_tpu``: what TorchTPU knows of the chip (``torch_tpu/_internal/utils/hardware.py``,
  torch-tpu 0.2.0: ``_PCI_DEVICE_ID_TO_NAME``, ``_DEVICES_PER_CHIP``,
  ``_TOPOLOGY_BY_TPU_PCI_DEVICE_ID``); None where TorchTPU does not run (v2/v3, the test id
  0x0056). TorchTPU calls 0x0062 a v5p.

The torch_xla tier compares the first column with the installed torch_xla's lists, the
torch_tpu tier the second with the installed torch-tpu's tables (``tests/xla/test_chips_xla.py``,
``tests/torch_tpu/test_detect_torch_tpu.py``). Generations are spelled as
`Environment.tpu_generation` spells them (TorchTPU's "TPU v7" is ``7x`` here).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

TPU_PCI_VENDOR = "0x1ae0"  # Google's PCI vendor id (also its virtual NIC's: the device id decides)


@dataclass(frozen=True)
class XlaChip:
    """The chip as torch_xla sees it."""

    generation: str | None  # None: an id torch_xla lists for testing, of unknown generation
    cores: int  # XLA devices (replicas) per chip: 2 on v2/v3, else 1


@dataclass(frozen=True)
class TorchTpuChip:
    """The chip as TorchTPU sees it."""

    generation: str
    devices_per_chip: int  # devices TorchTPU runs a process on, per chip
    topologies: Mapping[int, str]  # processes per host -> TORCH_TPU_TOPOLOGY

    @property
    def counts(self) -> tuple[int, ...]:
        """The process counts per host TorchTPU has a layout for."""
        return tuple(sorted(self.topologies))


@dataclass(frozen=True)
class Chip:
    """One PCI device id: torch_xla's facts and TorchTPU's, side by side."""

    torch_xla: XlaChip
    torch_tpu: TorchTpuChip | None  # None: TorchTPU does not run on this chip


_V4_V5P = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,2,2"}
_V5E_V6E = {1: "1,1,1", 4: "2,2,1", 8: "2,4,1"}
_V7 = {2: "1,1,1,2", 4: "1,2,1,2", 8: "2,2,1,2"}

CHIPS: Mapping[str, Chip] = {
    "0x0027": Chip(XlaChip("v2/v3", 2), None),
    "0x005e": Chip(XlaChip("v4", 1), TorchTpuChip("v4", 1, _V4_V5P)),
    "0x0063": Chip(XlaChip("v5e", 1), TorchTpuChip("v5e", 1, _V5E_V6E)),
    "0x006f": Chip(XlaChip("v6e", 1), TorchTpuChip("v6e", 1, _V5E_V6E)),
    "0x0076": Chip(XlaChip("7x", 1), TorchTpuChip("7x", 2, _V7)),
    "0x0056": Chip(XlaChip(None, 1), None),
    "0x0062": Chip(XlaChip(None, 1), TorchTpuChip("v5p", 1, _V4_V5P)),
}


def torch_tpu_chip(pci_id: str | None) -> TorchTpuChip | None:
    """TorchTPU's view of the chip with this PCI id; None where TorchTPU does not run on it."""
    chip = CHIPS.get(pci_id or "")
    return chip.torch_tpu if chip else None


def torch_tpu_generation(generation: str | None) -> TorchTpuChip | None:
    """TorchTPU's view of a generation (as `Environment.tpu_generation` names it), or None."""
    for chip in CHIPS.values():
        if chip.torch_tpu and chip.torch_tpu.generation == generation:
            return chip.torch_tpu
    return None
