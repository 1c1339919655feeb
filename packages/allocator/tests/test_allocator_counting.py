"""SlotCounter: fresh consecutive numbers across both output kinds, frees counted, and a tree
frees into it (the way the prefix index's simulation and `kvstrata bench radix` use it)."""

from __future__ import annotations

import numpy as np
import torch

from kvstrata.allocator import SlotCounter


def test_numbers_are_fresh_and_consecutive_across_kinds() -> None:
    sink = SlotCounter()
    assert np.array_equal(sink.take_numpy(3), [0, 1, 2])
    got = sink.take_torch(2)
    assert got.dtype == torch.int64 and got.tolist() == [3, 4]
    assert sink.take_numpy(0).size == 0 and sink.next_slot == 5
    assert sink.available_size() == sink.size == 1 << 62


def test_free_counts_slots() -> None:
    sink = SlotCounter()
    sink.free(torch.arange(4))
    sink.free(torch.tensor([], dtype=torch.int64))
    assert sink.freed == 4
