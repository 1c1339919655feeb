"""MambaSlotAllocator: one state slot per request, copy-on-write forks."""

from __future__ import annotations

import pytest

from kvstrata.allocator import (
    DoubleFree,
    IndexOutOfRange,
    NotAllocated,
    PagedAllocator,
    PageSlotAllocator,
    ReservedIndex,
    SlotCopy,
    TokenAllocator,
)
from kvstrata.allocator.engine import Backend
from kvstrata.testkit.allocators import idx, make_mamba


def test_one_slot_per_request(backend: Backend) -> None:
    m = make_mamba(backend=backend, size=4)
    slots = m.alloc(3)
    assert slots is not None and slots.tolist() == [1, 2, 3]
    assert m.alloc(2) is None and m.available_size() == 1
    m.free(idx([2]))
    again = m.alloc(1)
    assert again is not None and again.tolist() == [2]
    with pytest.raises(DoubleFree):
        m.free(idx([4]))
    assert (m.page_size, m.size, m.usage()[0].pool) == (1, 4, "state")
    m.check_integrity()


def test_fork_pairs_new_slots_with_their_sources(backend: Backend) -> None:
    m = make_mamba(backend=backend, size=6)
    assert m.alloc(2) is not None
    copy = m.fork(idx([2, 2, 1]))
    assert isinstance(copy, SlotCopy)
    assert copy.src.tolist() == [2, 2, 1] and copy.dst.tolist() == [3, 4, 5]
    assert m.available_size() == 1
    assert m.fork(idx([1, 2])) is None  # all or nothing
    assert m.available_size() == 1 and m.counters.failed_allocs == 1
    m.check_integrity()


def test_fork_rejects_bad_sources_before_allocating(backend: Backend) -> None:
    m = make_mamba(backend=backend, size=6)
    assert m.alloc(2) is not None
    cases = ((idx([3]), NotAllocated), (idx([0]), ReservedIndex), (idx([7]), IndexOutOfRange))
    for bad, error in cases:
        with pytest.raises(error):
            m.fork(bad)
        assert m.available_size() == 4


def test_groups_state_and_clear(backend: Backend) -> None:
    m = make_mamba(backend=backend, size=4)
    slots = m.alloc(4)
    assert slots is not None
    state = m.backup_state()
    m.free_group_begin()
    m.free(slots[:2])
    assert m.available_size() == 0
    m.free_group_end()
    assert m.available_size() == 2
    m.restore_state(state)
    assert m.available_size() == 0
    m.clear()
    assert m.available_size() == 4
    m.check_integrity()


def test_state_slots_have_no_per_request_token_calls(backend: Backend) -> None:
    """`alloc_extend` / `alloc_decode` lay request tokens into pages: meaningless for one
    state slot per request, so the Mamba allocator has neither (it is a PageSlotAllocator,
    not a TokenAllocator or PagedAllocator), and keeps every slot call."""
    m = make_mamba(backend=backend, size=4)
    assert not hasattr(m, "alloc_extend") and not hasattr(m, "alloc_decode")
    assert not isinstance(m, PagedAllocator | TokenAllocator)
    assert isinstance(m, PageSlotAllocator)
    for call in ("alloc", "free", "free_pages", "check_allocated", "fork", "backup_state"):
        assert callable(getattr(m, call))
    slots = m.alloc(2)
    assert slots is not None
    m.free_pages(slots[:1])
    m.check_allocated(slots[1:])
    assert m.available_size() == 3
    m.check_integrity()
