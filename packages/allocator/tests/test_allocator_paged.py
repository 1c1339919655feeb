"""Scenario tests for PagedAllocator / TokenAllocator: exact slots, on both backends.

Pool of 16 pages of 4 slots: page p holds slots 4p .. 4p+3, page 0 (slots 0..3) is reserved,
and a fresh allocator hands pages out in order 1, 2, 3, ...
"""

from __future__ import annotations

import pytest
import torch

from kvstrata.allocator import InvalidRequest, PagedAllocator, PagedState
from kvstrata.allocator.engine import Backend
from kvstrata.testkit.allocators import idx, make_paged, make_token


def got(out: torch.Tensor | None) -> list[int]:
    assert out is not None, "allocation failed"
    return out.tolist()


def free_list(alloc: PagedAllocator) -> list[int]:
    state = alloc.backup_state()
    return state.free_pages.tolist() + state.released_pages.tolist()


def test_alloc_hands_out_whole_pages_in_order(backend: Backend) -> None:
    a = make_paged(backend=backend)
    assert got(a.alloc(8)) == [4, 5, 6, 7, 8, 9, 10, 11]
    assert got(a.alloc(4)) == [12, 13, 14, 15]
    empty = a.alloc(0)
    assert empty is not None and empty.numel() == 0 and empty.dtype == torch.int64
    assert a.available_size() == 64 - 12
    a.check_integrity()


def test_alloc_failure_changes_nothing(backend: Backend) -> None:
    a = make_paged(backend=backend, num_pages=4)
    assert a.alloc(12) is not None
    before = free_list(a)
    assert a.alloc(8) is None
    assert free_list(a) == before and a.available_size() == 4
    assert a.counters.failed_allocs == 1 and a.counters.alloc_calls == 2
    a.check_integrity()


@pytest.mark.parametrize("checked", [True, False])
def test_extend_fills_partial_page_then_new_pages(backend: Backend, checked: bool) -> None:
    a = make_paged(backend=backend, checked=checked)
    prefix = a.alloc(8)  # request 0 holds 6 tokens in pages 1, 2: token 5 is slot 9
    assert prefix is not None
    out = a.alloc_extend(idx([6, 0]), idx([13, 5]), idx([9, -1]), 12)
    # request 0: slots 10, 11 finish page 2, page 3 whole, page 4 for token 12;
    # request 1 (no prefix, last_loc ignored): page 5 whole and page 6 for token 4.
    assert out is not None
    assert out.tolist() == [10, 11, 12, 13, 14, 15, 16, 20, 21, 22, 23, 24]
    assert a.available_size() == 64 - 6 * 4
    a.check_integrity()


def test_extend_from_a_page_boundary_takes_no_partial_slot(backend: Backend) -> None:
    a = make_paged(backend=backend)
    assert a.alloc(8) is not None  # 8 tokens: pages 1, 2 full
    # last_loc is not read for a full last page, so any value passes.
    out = a.alloc_extend(idx([8]), idx([10]), idx([999]))
    assert out is not None and out.tolist() == [12, 13]


def test_extend_within_the_partial_page_needs_no_free_page(backend: Backend) -> None:
    a = make_paged(backend=backend, num_pages=2)
    assert a.alloc(8) is not None  # all pages taken; request holds 5 tokens, last at slot 8
    assert a.available_size() == 0
    out = a.alloc_extend(idx([5]), idx([8]), idx([8]))
    assert out is not None and out.tolist() == [9, 10, 11]
    assert a.alloc_extend(idx([5]), idx([9]), idx([8])) is None  # token 8 needs a new page
    a.check_integrity()


def test_extend_with_last_loc_none(backend: Backend) -> None:
    a = make_paged(backend=backend)
    out = a.alloc_extend(idx([0, 0]), idx([3, 4]), None)
    assert out is not None and out.tolist() == [4, 5, 6, 8, 9, 10, 11]
    with pytest.raises(InvalidRequest, match="last_loc"):
        a.alloc_extend(idx([3]), idx([5]), None)


def test_extend_zero_tokens_and_empty_batch(backend: Backend) -> None:
    a = make_paged(backend=backend)
    held = a.alloc(4)
    assert held is not None
    out = a.alloc_extend(idx([3]), idx([3]), idx([6]))
    assert out is not None and out.numel() == 0
    empty = a.alloc_extend(idx([]), idx([]), None)
    assert empty is not None and empty.numel() == 0
    assert a.available_size() == 60


def test_extend_failure_changes_nothing(backend: Backend) -> None:
    a = make_paged(backend=backend, num_pages=3)
    prefix = a.alloc(4)
    assert prefix is not None
    before = free_list(a)
    # 2 tokens fit in the partial page, 9 more need 3 pages but only 2 are free.
    assert a.alloc_extend(idx([2]), idx([13]), idx([5])) is None
    assert free_list(a) == before
    a.check_integrity()


def test_extend_on_token_allocator(backend: Backend) -> None:
    a = make_token(backend=backend, size=16)
    out = a.alloc_extend(idx([3, 0]), idx([5, 2]), idx([7, -1]))
    assert out is not None and out.tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("checked", [True, False])
def test_decode_opens_a_page_only_at_a_boundary(backend: Backend, checked: bool) -> None:
    a = make_paged(backend=backend, checked=checked)
    r0 = a.alloc(8)  # request 0 holds 6 tokens: last at slot 9
    r1 = a.alloc(4)  # request 1 holds 4 tokens: last at slot 15, page 3 full
    assert r0 is not None and r1 is not None
    # seq_lens count the new token; request 2 is new (seq_len 1, last_loc ignored).
    out = a.alloc_decode(idx([7, 5, 1]), idx([9, 15, -1]))
    assert out is not None and out.tolist() == [10, 16, 20]
    assert a.available_size() == 64 - 5 * 4
    a.check_integrity()


def test_decode_all_new_pages_needs_no_last_loc(backend: Backend) -> None:
    a = make_paged(backend=backend)
    out = a.alloc_decode(idx([1, 5, 9]), None)
    assert out is not None and out.tolist() == [4, 8, 12]
    with pytest.raises(InvalidRequest, match="last_loc"):
        a.alloc_decode(idx([2]), None)


def test_decode_failure_changes_nothing(backend: Backend) -> None:
    a = make_paged(backend=backend, num_pages=2)
    assert a.alloc(4) is not None
    before = free_list(a)
    assert a.alloc_decode(idx([1, 1]), None) is None  # two new pages, one free
    assert free_list(a) == before
    out = a.alloc_decode(idx([2, 1]), idx([4, -1]))  # one continues, one new page
    assert out is not None and out.tolist() == [5, 8]


@pytest.mark.parametrize("checked", [True, False])
def test_decode_and_free_at_a_page_size_not_a_power_of_two(backend: Backend, checked: bool) -> None:
    # Page size 3 takes the divide/remainder paths instead of shifts and masks.
    a = make_paged(backend=backend, page_size=3, checked=checked)
    r0 = a.alloc(6)  # pages 1, 2: request 0 holds 4 tokens, last at slot 6 (page 2, offset 0)
    assert r0 is not None
    out = a.alloc_decode(idx([5, 1, 4]), idx([6, -1, 6]))
    # Request 2 (seq_len 4) opens page 3 at offset 0 although last_loc says slot 6.
    assert got(out) == [7, 9, 12]
    a.free(torch.cat((r0, idx([9, 12]))))
    assert a.available_size() == a.size
    a.check_integrity()


def test_decode_batch_free_and_reuse(backend: Backend) -> None:
    # A decode round as the scheduler runs it, for a batch larger than the scratch buffers'
    # first size, twice (second round: same scratch, reused pages).
    a = make_paged(backend=backend, num_pages=1200)
    held = a.alloc(4 * 300)
    assert held is not None
    for _ in range(2):
        seq = torch.arange(300, dtype=torch.int64) % 2 * 2 + 1  # 1, 3, 1, 3, ...: half open
        last = held.view(300, 4)[:, 1]  # token 1 of each request's page
        out = a.alloc_decode(seq, last)
        assert out is not None
        opens = got(out)[0::2]
        assert got(out)[1::2] == (last[1::2] + 1).tolist()
        assert all(s % 4 == 0 for s in opens) and len(set(opens)) == 150
        assert a.available_size() == (1200 - 300 - 150) * 4
        a.free(out[0::2])  # the new pages only
        a.check_integrity()
    a.free(held)
    assert a.available_size() == a.size


def test_decode_on_token_allocator(backend: Backend) -> None:
    a = make_token(backend=backend, size=4)
    out = a.alloc_decode(idx([9, 1, 3]), idx([1, -1, 2]))
    assert out is not None and out.tolist() == [1, 2, 3]


def test_free_releases_every_page_touched(backend: Backend) -> None:
    a = make_paged(backend=backend)
    held = a.alloc(12)
    assert held is not None
    a.free(idx([5, 13]))  # one slot of page 1, one of page 3
    assert a.available_size() == 64 - 4
    assert sorted(free_list(a))[:3] == [1, 3, 4]
    a.free(idx([[8, 9], [10, 11]]))  # any shape; all of page 2
    assert a.available_size() == 64
    a.check_integrity()


def test_freed_pages_are_reused_first(backend: Backend) -> None:
    a = make_paged(backend=backend)
    assert a.alloc(24) is not None  # pages 1..6
    a.free_pages(idx([2, 5]))
    out = a.alloc(8)
    assert out is not None and out.tolist() == [8, 9, 10, 11, 20, 21, 22, 23]
    assert got(a.alloc(4)) == [28, 29, 30, 31]


def test_sorted_reuse_merges_lazily(backend: Backend) -> None:
    a = make_paged(backend=backend, num_pages=4, sorted_reuse=True)
    assert a.alloc(16) is not None
    a.free_pages(idx([4, 1, 3]))
    assert a.available_size() == 12  # released pages count as available
    assert got(a.alloc(8)) == [4, 5, 6, 7, 12, 13, 14, 15]
    a.free_pages(idx([2]))
    # page 4 is still on the merged stack: taken before the released page 2 is merged.
    assert got(a.alloc(4)) == [16, 17, 18, 19]
    assert got(a.alloc(4)) == [8, 9, 10, 11]
    a.check_integrity()


def test_sorted_reuse_hands_out_ascending_pages(backend: Backend) -> None:
    a = make_paged(backend=backend, num_pages=8, sorted_reuse=True)
    held = a.alloc(32)
    assert held is not None
    a.free_pages(idx([7, 2, 5]))
    a.free_pages(idx([3]))
    out = a.alloc(16)
    assert out is not None and (out // 4)[::4].tolist() == [2, 3, 5, 7]


def test_free_group_applies_at_the_end(backend: Backend) -> None:
    a = make_paged(backend=backend)
    first, second = a.alloc(8), a.alloc(4)
    assert first is not None and second is not None
    a.free_group_begin()
    a.free(first)
    a.free(second)
    assert a.available_size() == 64 - 12  # nothing available until the group ends
    a.check_integrity()
    a.free_group_end()
    assert a.available_size() == 64
    a.check_integrity()


def test_free_group_does_not_alias_the_callers_tensor(backend: Backend) -> None:
    a = make_token(backend=backend, size=8)
    held = a.alloc(2)
    assert held is not None
    a.free_group_begin()
    a.free(held)
    held.fill_(7)  # the caller reuses its buffer before the group ends
    a.free_group_end()
    assert sorted(free_list(a)) == list(range(1, 9))
    a.check_integrity()


def test_free_group_misuse(backend: Backend) -> None:
    a = make_paged(backend=backend)
    with pytest.raises(InvalidRequest):
        a.free_group_end()
    a.free_group_begin()
    with pytest.raises(InvalidRequest):
        a.free_group_begin()
    with pytest.raises(InvalidRequest):
        a.backup_state()
    a.free_group_end()


def test_backup_and_restore_roll_back(backend: Backend) -> None:
    a = make_paged(backend=backend, sorted_reuse=True)
    kept = a.alloc(8)
    assert kept is not None
    state = a.backup_state()
    assert isinstance(state, PagedState)
    first = a.alloc(12)
    a.free(kept)
    a.restore_state(state)
    assert a.available_size() == 64 - 8
    again = a.alloc(12)
    assert first is not None and again is not None and again.tolist() == first.tolist()
    a.free(kept)  # still allocated after the rollback
    a.check_integrity()


def test_restore_rejects_a_foreign_state(backend: Backend) -> None:
    a, b = make_paged(backend=backend), make_paged(backend=backend)
    with pytest.raises(InvalidRequest, match="not made by this allocator"):
        a.restore_state(b.backup_state())


def test_clear_frees_everything(backend: Backend) -> None:
    a = make_paged(backend=backend)
    assert a.alloc(20) is not None
    a.free_group_begin()
    a.clear()
    assert a.available_size() == 64
    assert got(a.alloc(4)) == [4, 5, 6, 7]
    a.check_integrity()


def test_counters(backend: Backend) -> None:
    a = make_paged(backend=backend)
    held = a.alloc(8)
    assert held is not None
    assert a.alloc_decode(idx([9]), idx([11])) is not None  # token 8 opens page 3
    a.free(held)
    c = a.counters
    assert (c.alloc_calls, c.allocated_slots, c.free_calls, c.freed_slots) == (2, 9, 1, 8)
    assert a.usage()[0].used_slots == 4


def test_describes_itself(backend: Backend) -> None:
    a = make_paged(backend=backend, page_size=16, num_pages=3)
    assert (a.size, a.page_size, a.num_pages, a.backend) == (48, 16, 4, backend)
    assert a.device == torch.device("cpu") and a.checked and not a.sorted_reuse
