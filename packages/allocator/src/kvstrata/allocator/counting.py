"""SlotCounter: a stand-in slot allocator for simulations and benchmarks of the tree alone.

It hands out fresh consecutive slot numbers and never runs out (a simulation enforces its
capacity by evicting before each insert), and counts the slots the tree gives back (evictions,
duplicates). No pool stands behind the numbers: nothing reads or writes KV. Used by the prefix
index's simulated instances and `kvstrata bench radix`.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch


class SlotCounter:
    """Fresh slot numbers from 0 upward (`take_numpy` / `take_torch`), `freed`: how many the
    tree has given back. Never exhausted: `available_size()` is `size` (2**62)."""

    device = torch.device("cpu")
    size = 1 << 62

    def __init__(self) -> None:
        self.next_slot = 0
        self.freed = 0

    def available_size(self) -> int:
        return self.size

    def free(self, indices: torch.Tensor, /) -> None:
        self.freed += int(indices.numel())

    def take_numpy(self, n: int) -> npt.NDArray[np.int64]:
        """The next `n` slot numbers as an int64 array."""
        start = self.next_slot
        self.next_slot = start + n
        return np.arange(start, start + n, dtype=np.int64)

    def take_torch(self, n: int) -> torch.Tensor:
        """The next `n` slot numbers as an int64 CPU tensor."""
        start = self.next_slot
        self.next_slot = start + n
        return torch.arange(start, start + n, dtype=torch.int64)
