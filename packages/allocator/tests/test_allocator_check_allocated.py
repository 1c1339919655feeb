"""`check_allocated`: is every slot handed out now? Read-only, on both backends."""

from __future__ import annotations

import pytest

from kvstrata.allocator import (
    IndexOutOfRange,
    MambaSlotAllocator,
    NotAllocated,
    ReservedIndex,
    SWAAllocator,
)
from kvstrata.allocator.engine import Backend
from kvstrata.testkit.allocators import idx, make_paged


def test_paged_slots_in_handed_out_pages_pass_and_others_raise(backend: Backend) -> None:
    alloc = make_paged(page_size=4, num_pages=8, backend=backend)
    slots = alloc.alloc(8)
    assert slots is not None
    before = (alloc.available_size(), alloc.backup_state().free_pages.tolist())
    alloc.check_allocated(slots)
    alloc.check_allocated(slots[:0])
    with pytest.raises(IndexOutOfRange, match="insert"):
        alloc.check_allocated(idx([int(slots[0]), 9 * 4]), "insert")  # page 0 + 8 pages
    with pytest.raises(ReservedIndex):
        alloc.check_allocated(idx([1]))
    free_slot = next(s for s in range(4, 36) if s // 4 not in {int(x) // 4 for x in slots})
    with pytest.raises(NotAllocated):
        alloc.check_allocated(idx([int(slots[0]), free_slot]))
    alloc.free(slots[4:])
    with pytest.raises(NotAllocated):
        alloc.check_allocated(slots)
    alloc.check_allocated(slots[:4])
    assert alloc.available_size() == before[0] + 4
    alloc.check_integrity()


def test_unchecked_allocator_checks_the_range_only(backend: Backend) -> None:
    alloc = make_paged(page_size=4, num_pages=8, backend=backend, checked=False)
    alloc.check_allocated(idx([4, 5]))  # free, but an unchecked allocator keeps no marks
    with pytest.raises(IndexOutOfRange):
        alloc.check_allocated(idx([36]))


def test_swa_and_mamba_delegate(backend: Backend) -> None:
    swa = SWAAllocator(size=16, swa_size=16, page_size=1, device="cpu", backend=backend)
    full = swa.alloc(3)
    assert full is not None
    swa.check_allocated(full)
    swa.free(full[2:])
    with pytest.raises(NotAllocated):
        swa.check_allocated(full)
    states = MambaSlotAllocator(size=4, device="cpu", backend=backend)
    slot = states.alloc(1)
    assert slot is not None
    states.check_allocated(slot)
    states.free(slot)
    with pytest.raises(NotAllocated):
        states.check_allocated(slot)
