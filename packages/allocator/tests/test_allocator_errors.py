"""Every caller-visible error, raised before anything changes, on both backends."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvstrata.allocator import (
    AllocatorError,
    DoubleFree,
    DuplicateIndex,
    IndexOutOfRange,
    InvalidRequest,
    MisalignedIndex,
    NotAllocated,
    PagedAllocator,
    ReservedIndex,
    TokenAllocator,
)
from kvstrata.allocator.engine import Backend
from kvstrata.testkit.allocators import idx, make_paged, make_token


def snapshot(alloc: PagedAllocator) -> tuple[int, list[int], list[int]]:
    state = alloc.backup_state()
    return alloc.available_size(), state.free_pages.tolist(), state.released_pages.tolist()


def assert_raises_unchanged(
    alloc: PagedAllocator, error: type[AllocatorError], call: Callable[[], object]
) -> None:
    """`call` raises `error`, and the allocator's free list is exactly as before."""
    before = snapshot(alloc)
    with pytest.raises(error):
        call()
    assert snapshot(alloc) == before
    alloc.check_integrity()


def held_paged(backend: Backend) -> tuple[PagedAllocator, torch.Tensor]:
    """Page size 4; pages 1..3 handed out (slots 4..15), pages 4..16 free."""
    a = make_paged(backend=backend)
    held = a.alloc(12)
    assert held is not None
    return a, held


def test_double_free(backend: Backend) -> None:
    a, held = held_paged(backend)
    a.free(held[:4])
    assert_raises_unchanged(a, DoubleFree, lambda: a.free(held[:1]))
    assert_raises_unchanged(a, DoubleFree, lambda: a.free(idx([8, 40])))  # 40: never allocated
    assert_raises_unchanged(a, DoubleFree, lambda: a.free_pages(idx([1])))


def test_double_free_inside_a_group(backend: Backend) -> None:
    a, held = held_paged(backend)
    a.free_group_begin()
    a.free(held[:4])
    with pytest.raises(DoubleFree):
        a.free(held[2:6])
    a.free_group_end()
    assert a.available_size() == 64 - 8
    a.check_integrity()


def test_reserved_page(backend: Backend) -> None:
    a, _ = held_paged(backend)
    assert_raises_unchanged(a, ReservedIndex, lambda: a.free(idx([0])))
    assert_raises_unchanged(a, ReservedIndex, lambda: a.free(idx([8, 3])))
    assert_raises_unchanged(a, ReservedIndex, lambda: a.free_pages(idx([0])))
    t = make_token(backend=backend)
    assert_raises_unchanged(t, ReservedIndex, lambda: t.free(idx([0])))


def test_out_of_range(backend: Backend) -> None:
    a, _ = held_paged(backend)
    assert_raises_unchanged(a, IndexOutOfRange, lambda: a.free(idx([68])))
    assert_raises_unchanged(a, IndexOutOfRange, lambda: a.free(idx([4, -1])))
    assert_raises_unchanged(a, IndexOutOfRange, lambda: a.free(idx([-4])))
    assert_raises_unchanged(a, IndexOutOfRange, lambda: a.free_pages(idx([17])))
    assert_raises_unchanged(a, IndexOutOfRange, lambda: a.free_pages(idx([-1])))
    t = make_token(backend=backend, size=8)
    assert t.alloc(8) is not None
    assert_raises_unchanged(t, IndexOutOfRange, lambda: t.free(idx([9])))
    assert_raises_unchanged(t, IndexOutOfRange, lambda: t.free(idx([-1])))  # not slot 8


def test_duplicates_within_one_call(backend: Backend) -> None:
    a, _ = held_paged(backend)
    assert_raises_unchanged(a, DuplicateIndex, lambda: a.free(idx([4, 5, 4])))
    assert_raises_unchanged(a, DuplicateIndex, lambda: a.free_pages(idx([2, 3, 2])))
    t = make_token(backend=backend)
    assert t.alloc(4) is not None
    assert_raises_unchanged(t, DuplicateIndex, lambda: t.free(idx([2, 3, 2])))


def test_duplicates_in_a_long_free(backend: Backend) -> None:
    # Long enough for the run-collapsing pass: the duplicate is far from its twin.
    a = make_paged(backend=backend, num_pages=512)
    held = a.alloc(2048)
    assert held is not None
    doubled = torch.cat((held, held[5:6]))
    assert_raises_unchanged(a, DuplicateIndex, lambda: a.free(doubled))
    a.free(torch.cat((held[1002:], held[:1002])))  # page 251 split over two runs: fine
    assert a.available_size() == a.size
    again = a.alloc(2048)
    assert again is not None
    a.free(again.flip(0))  # runs that fall instead of rise: settled slot by slot
    assert a.available_size() == a.size
    a.check_integrity()


def test_misaligned_last_loc(backend: Backend) -> None:
    a, _ = held_paged(backend)
    # 6 prefix tokens put the last one at offset 1 of its page: slot 9, not slot 10.
    assert_raises_unchanged(
        a, MisalignedIndex, lambda: a.alloc_extend(idx([6]), idx([8]), idx([10]))
    )
    # seq_len 7: the last held token (number 5) sits at offset 1, so 11 is misaligned.
    assert_raises_unchanged(a, MisalignedIndex, lambda: a.alloc_decode(idx([7]), idx([11])))


def test_last_loc_in_a_free_page(backend: Backend) -> None:
    a, _ = held_paged(backend)
    assert_raises_unchanged(a, NotAllocated, lambda: a.alloc_extend(idx([6]), idx([8]), idx([41])))
    assert_raises_unchanged(a, NotAllocated, lambda: a.alloc_decode(idx([7]), idx([41])))


def test_last_loc_out_of_range_or_reserved(backend: Backend) -> None:
    a, _ = held_paged(backend)
    assert_raises_unchanged(
        a, IndexOutOfRange, lambda: a.alloc_extend(idx([6]), idx([8]), idx([69]))
    )
    assert_raises_unchanged(a, IndexOutOfRange, lambda: a.alloc_decode(idx([7]), idx([-3])))
    assert_raises_unchanged(a, ReservedIndex, lambda: a.alloc_extend(idx([2]), idx([3]), idx([1])))


def test_invalid_requests(backend: Backend) -> None:
    a, _ = held_paged(backend)
    cases: list[Callable[[], object]] = [
        lambda: a.alloc(-4),
        lambda: a.alloc(6),  # not whole pages
        lambda: a.alloc_extend(idx([0, 1]), idx([3]), None),
        lambda: a.alloc_extend(idx([5]), idx([4]), idx([8])),  # seq_len < prefix_len
        lambda: a.alloc_extend(idx([-1]), idx([4]), None),
        lambda: a.alloc_extend(idx([0]), idx([4]), None, 5),  # wrong num_extend_tokens
        lambda: a.alloc_extend(idx([2, 1]), idx([4, 2]), idx([5])),  # last_loc too short
        lambda: a.alloc_decode(idx([0]), None),  # seq_len counts the new token
        lambda: a.alloc_decode(idx([2, 3]), idx([4])),
        lambda: a.free(torch.tensor([4.0])),
        lambda: a.free(torch.tensor([True])),
        lambda: a.free([4, 5]),  # a list, not a tensor
    ]
    for case in cases:
        assert_raises_unchanged(a, InvalidRequest, case)


@pytest.mark.parametrize("checked", [True, False])
@pytest.mark.parametrize("page_size", [4, 3])
def test_decode_rejects_seq_len_below_one_next_to_valid_requests(
    backend: Backend, checked: bool, page_size: int
) -> None:
    # Slots 4 .. 15 (3 pages of 4) or 3 .. 11 (3 pages of 3) are held. Each bad seq_len
    # is paired with a last_loc whose next slot would pass the page and alignment checks
    # under Python's modulo (seq 0: offset -1 % P; seq -3 at P = 4: offset 0, "opens").
    a = make_paged(backend=backend, checked=checked, page_size=page_size)
    assert a.alloc(3 * page_size) is not None
    ok_seq, ok_loc = 2, page_size  # token 1 of page 1 follows slot P
    for seq, loc in ((0, 2 * page_size - 2), (-3, 2 * page_size), (-page_size + 1, 8)):
        assert_raises_unchanged(
            a,
            InvalidRequest,
            lambda s=seq, lc=loc: a.alloc_decode(idx([ok_seq, s]), idx([ok_loc, lc])),
        )
    assert_raises_unchanged(a, InvalidRequest, lambda: a.alloc_decode(idx([-3]), None))


def test_constructor_arguments(backend: Backend) -> None:
    with pytest.raises(InvalidRequest):
        PagedAllocator(size=10, page_size=4, backend=backend)
    with pytest.raises(InvalidRequest):
        PagedAllocator(size=8, page_size=0, backend=backend)
    with pytest.raises(InvalidRequest):
        TokenAllocator(size=-1, backend=backend)
    with pytest.raises(InvalidRequest):
        PagedAllocator(size=8, page_size=4, device="cuda", backend="numpy")


def test_unchecked_still_rejects_malformed_requests(backend: Backend) -> None:
    a = make_paged(backend=backend, checked=False)
    with pytest.raises(InvalidRequest):
        a.alloc(3)
    with pytest.raises(InvalidRequest):
        a.alloc_extend(idx([5]), idx([4]), idx([8]))
    assert a.alloc(8) is not None
    a.check_integrity()
