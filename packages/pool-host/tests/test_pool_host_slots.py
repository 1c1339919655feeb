"""HostSlotAllocator: scenarios, a Hypothesis state machine, and concurrent use."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)

from kvstrata.pool_host import HostSlotAllocator
from kvstrata.pool_host.errors import (
    DoubleAllocation,
    DoubleFree,
    IndexOutOfRange,
    NonIntegerIndex,
    SizeNotPageAligned,
)


def _taken(alloc: HostSlotAllocator, num_pages: int) -> torch.Tensor:
    """`alloc.alloc_pages(num_pages)`, which must succeed."""
    pages = alloc.alloc_pages(num_pages)
    assert pages is not None, f"{num_pages} pages refused"
    return pages


def test_fresh_allocations_are_contiguous_and_ascending() -> None:
    alloc = HostSlotAllocator(num_pages=8, page_size=4)
    first = _taken(alloc, 3)
    second = _taken(alloc, 2)
    assert first.tolist() == [0, 1, 2]
    assert second.tolist() == [3, 4]
    assert alloc.available_size() == 3 * 4
    alloc.check_integrity()


def test_alloc_tokens_returns_whole_pages() -> None:
    alloc = HostSlotAllocator(num_pages=4, page_size=4)
    idx = alloc.alloc(8)
    assert idx is not None
    assert idx.dtype == torch.int64
    assert idx.tolist() == list(range(8))
    alloc.free(idx)
    assert alloc.available_size() == 16
    alloc.check_integrity()


def test_alloc_too_many_returns_none_and_changes_nothing() -> None:
    alloc = HostSlotAllocator(num_pages=4, page_size=2)
    assert alloc.alloc_pages(3) is not None
    assert alloc.can_alloc_pages(1) and not alloc.can_alloc_pages(2)
    assert alloc.alloc_pages(2) is None
    assert alloc.num_free_pages() == 1
    alloc.check_integrity()


def test_freed_pages_are_reused_lowest_first_once_fresh_pages_run_out() -> None:
    alloc = HostSlotAllocator(num_pages=6, page_size=1)
    _taken(alloc, 6)
    alloc.free_pages(torch.tensor([4, 1, 2]))
    assert _taken(alloc, 3).tolist() == [1, 2, 4]
    alloc.check_integrity()


def test_double_free_is_refused_without_change() -> None:
    alloc = HostSlotAllocator(num_pages=4, page_size=1)
    pages = _taken(alloc, 2)
    alloc.free_pages(pages[:1])
    with pytest.raises(DoubleFree):
        alloc.free_pages(pages)  # page 0 already free: page 1 must stay allocated
    assert alloc.num_free_pages() == 3
    with pytest.raises(DoubleFree):
        alloc.free_pages(torch.tensor([1, 1]))
    assert alloc.num_free_pages() == 3
    alloc.check_integrity()


def test_out_of_range_and_misaligned_frees_are_refused() -> None:
    alloc = HostSlotAllocator(num_pages=4, page_size=4)
    assert alloc.alloc(16) is not None
    with pytest.raises(IndexOutOfRange):
        alloc.free_pages(torch.tensor([4]))
    with pytest.raises(IndexOutOfRange):
        alloc.free_pages(torch.tensor([-1]))
    with pytest.raises(SizeNotPageAligned):
        alloc.free(torch.tensor([1, 2, 3, 4]))
    with pytest.raises(SizeNotPageAligned):
        alloc.alloc(3)
    assert alloc.num_free_pages() == 0
    alloc.check_integrity()


def test_non_integer_ids_are_refused_not_truncated() -> None:
    alloc = HostSlotAllocator(num_pages=4, page_size=2)
    assert alloc.alloc_pages(4) is not None
    for bad in (torch.tensor([1.7]), torch.tensor([True]), torch.tensor([0.0, 1.0])):
        with pytest.raises(NonIntegerIndex):
            alloc.free_pages(bad)
        with pytest.raises(NonIntegerIndex):
            alloc.free(bad)
    assert alloc.num_free_pages() == 0, "a refused free released a page"
    # any integer dtype is a page id
    alloc.free_pages(torch.tensor([1], dtype=torch.uint8))
    alloc.free_pages(torch.tensor([3], dtype=torch.int32))
    alloc.free(torch.tensor([4, 5], dtype=torch.int16))
    assert alloc.num_free_pages() == 3
    alloc.check_integrity()


def test_free_does_not_alias_the_callers_tensor() -> None:
    alloc = HostSlotAllocator(num_pages=4, page_size=1)
    pages = _taken(alloc, 2)
    alloc.free_pages(pages)
    pages.fill_(3)  # the caller reuses its tensor: the allocator must have kept a copy
    alloc.check_integrity()
    assert sorted(_taken(alloc, 4).tolist()) == [0, 1, 2, 3]


def test_corrupt_free_list_is_detected_as_double_allocation() -> None:
    alloc = HostSlotAllocator(num_pages=4, page_size=1)
    assert alloc.alloc_pages(1) is not None
    # Simulate a bug that put an allocated page back on the free list behind the bitmap.
    alloc._pages._fresh = torch.tensor([0, 1, 2, 3]).numpy()
    with pytest.raises(DoubleAllocation):
        alloc.alloc_pages(1)


def test_clear_frees_everything() -> None:
    alloc = HostSlotAllocator(num_pages=5, page_size=2)
    assert alloc.alloc_pages(4) is not None
    alloc.clear()
    assert alloc.num_free_pages() == 5
    alloc.check_integrity()


class HostSlotMachine(RuleBasedStateMachine):
    """Random alloc/free sequences against a model: a set of allocated pages."""

    held = Bundle("held")

    def __init__(self) -> None:
        super().__init__()
        self.alloc = HostSlotAllocator(num_pages=24, page_size=4)
        self.allocated: set[int] = set()

    @rule(target=held, n=st.integers(0, 10))
    def alloc_pages(self, n: int) -> list[int]:
        pages = self.alloc.alloc_pages(n)
        if n > 24 - len(self.allocated):
            assert pages is None
            return []
        assert pages is not None
        got = pages.tolist()
        assert len(got) == n and not (set(got) & self.allocated), "page handed out twice"
        self.allocated |= set(got)
        return got

    @rule(target=held, n=st.integers(0, 3))
    def alloc_tokens(self, n: int) -> list[int]:
        idx = self.alloc.alloc(n * 4)
        if n > 24 - len(self.allocated):
            assert idx is None
            return []
        assert idx is not None
        got = sorted({i // 4 for i in idx.tolist()})
        assert not (set(got) & self.allocated)
        self.allocated |= set(got)
        return got

    @rule(pages=consumes(held))
    def free(self, pages: list[int]) -> None:
        self.alloc.free_pages(torch.tensor(pages, dtype=torch.int64))
        self.allocated -= set(pages)

    @rule(pages=consumes(held))
    def free_tokens(self, pages: list[int]) -> None:
        # Token indices of whole pages: the compiled free where there is one.
        tokens = [p * 4 + j for p in pages for j in range(4)]
        self.alloc.free(torch.tensor(tokens, dtype=torch.int64))
        self.allocated -= set(pages)

    @precondition(lambda self: len(self.allocated) < 24)
    @rule(data=st.data())
    def double_free_is_refused(self, data: st.DataObject) -> None:
        free_pages = sorted(set(range(24)) - self.allocated)
        page = data.draw(st.sampled_from(free_pages))
        with pytest.raises(DoubleFree):
            self.alloc.free_pages(torch.tensor([page]))

    @precondition(lambda self: len(self.allocated) < 24)
    @rule(data=st.data())
    def double_free_of_tokens_is_refused(self, data: st.DataObject) -> None:
        # The compiled free refuses (changing nothing) and the NumPy path raises.
        free_pages = sorted(set(range(24)) - self.allocated)
        page = data.draw(st.sampled_from(free_pages))
        held = sorted(self.allocated)[:2]
        tokens = [p * 4 + j for p in [*held, page] for j in range(4)]
        with pytest.raises(DoubleFree):
            self.alloc.free(torch.tensor(tokens, dtype=torch.int64))

    @invariant()
    def consistent(self) -> None:
        self.alloc.check_integrity()
        assert self.alloc.num_free_pages() == 24 - len(self.allocated)


TestHostSlotMachine = HostSlotMachine.TestCase


def test_threads_never_share_a_page() -> None:
    """Four workers allocate and free while a fifth checks the invariants under the lock:
    no page is ever held by two workers, and no check sees a half-applied call."""
    alloc = HostSlotAllocator(num_pages=64, page_size=2)
    owner: dict[int, int] = {}
    owner_lock = threading.Lock()
    errors: list[str] = []
    done = threading.Event()

    def worker(tid: int) -> None:
        for step in range(300):
            pages = alloc.alloc_pages(1 + (tid + step) % 5)
            if pages is None:
                continue
            with owner_lock:
                for p in pages.tolist():
                    if p in owner:
                        errors.append(f"page {p} held by {owner[p]} and {tid}")
                    owner[p] = tid
            with owner_lock:
                for p in pages.tolist():
                    del owner[p]
            alloc.free_pages(pages)

    def checker() -> None:
        while not done.is_set():
            try:
                alloc.check_integrity()
            except AssertionError as exc:
                errors.append(f"check_integrity during the run: {exc}")
                return

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    watch = threading.Thread(target=checker)
    watch.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watch.join()
    assert errors == []
    assert alloc.num_free_pages() == 64
    alloc.check_integrity()
