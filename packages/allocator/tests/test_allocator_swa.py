"""SWAAllocator: full and sliding-window slots in step, the full-to-SWA map, free_swa."""

from __future__ import annotations

import pytest
import torch

from kvstrata.allocator import (
    DoubleFree,
    IndexOutOfRange,
    IntegrityError,
    InvalidRequest,
    NotAllocated,
    SWAAllocator,
)
from kvstrata.allocator.engine import Backend
from kvstrata.testkit.allocators import idx, make_swa


def staggered(backend: Backend) -> tuple[SWAAllocator, torch.Tensor]:
    """Full page 1 held without SWA slots; then 8 tokens in full pages 2, 3 mapped to SWA
    pages 1, 2 (page size 4, 16 full pages, 8 SWA pages)."""
    a = make_swa(backend=backend)
    first = a.alloc(4)
    assert first is not None and first.tolist() == [4, 5, 6, 7]
    a.free_swa(idx([5]))
    second = a.alloc(8)
    assert second is not None and second.tolist() == list(range(8, 16))
    return a, second


def test_alloc_maps_every_full_slot(backend: Backend) -> None:
    a, _ = staggered(backend)
    assert a.translate(idx([8, 13, 4])).tolist() == [4, 9, 0]
    assert a.full_to_swa[8:16].tolist() == list(range(4, 12))
    assert a.full_to_swa[:8].tolist() == [0] * 8
    assert (a.full_available_size(), a.swa_available_size()) == (64 - 12, 32 - 8)
    a.check_integrity()


def test_free_swa_keeps_the_full_slots(backend: Backend) -> None:
    a, second = staggered(backend)
    a.free_swa(idx([9]))  # one token: its SWA page (slots 4..7) goes, with its map row
    assert a.translate(second).tolist() == [0, 0, 0, 0, 8, 9, 10, 11]
    assert a.swa_available_size() == 32 - 4 and a.full_available_size() == 64 - 12
    a.free_swa(idx([8, 10]))  # already released: skipped
    a.check_integrity()
    a.free(second)  # frees full pages 2, 3 and the SWA page still mapped
    assert (a.full_available_size(), a.swa_available_size()) == (64 - 4, 32)
    assert not a.full_to_swa.any()
    a.check_integrity()


def test_available_size_is_the_smaller_pool(backend: Backend) -> None:
    a = make_swa(backend=backend)
    held = a.alloc(32)  # every SWA page
    assert held is not None and a.available_size() == 0
    assert a.alloc(4) is None
    assert a.full_available_size() == 32 and a.counters.failed_allocs == 1
    a.free_swa(held[:4])
    assert a.available_size() == 4
    a.check_integrity()


def test_extend_and_decode_run_in_step(backend: Backend) -> None:
    a, _ = staggered(backend)
    # The request holds 6 tokens: full slots 8..13 (last 13), SWA slots 4..9 (last 9).
    out = a.alloc_extend(idx([6]), idx([11]), idx([13]))
    assert out is not None and out.tolist() == [14, 15, 16, 17, 18]
    assert a.translate(out).tolist() == [10, 11, 12, 13, 14]
    step = a.alloc_decode(idx([12]), idx([18]))
    assert step is not None and step.tolist() == [19]
    assert a.translate(step).tolist() == [15]
    a.check_integrity()


def test_extend_after_the_tail_left_the_window(backend: Backend) -> None:
    a, _ = staggered(backend)
    a.free_swa(idx([13]))
    before = (a.full_available_size(), a.swa_available_size(), a.full_to_swa.clone())
    with pytest.raises(NotAllocated, match="free_swa"):
        a.alloc_extend(idx([6]), idx([8]), idx([13]))
    with pytest.raises(NotAllocated):
        a.alloc_decode(idx([7]), idx([13]))
    after = (a.full_available_size(), a.swa_available_size(), a.full_to_swa)
    assert after[:2] == before[:2] and torch.equal(after[2], before[2])
    # Starting a new page needs no SWA tail.
    out = a.alloc_extend(idx([8]), idx([9]), idx([15]))
    assert out is not None and out.tolist() == [16]
    a.check_integrity()


def test_failure_in_either_pool_changes_nothing(backend: Backend) -> None:
    a = make_swa(backend=backend, num_pages=4, num_swa_pages=2)
    assert a.alloc(8) is not None
    state = a.backup_state()
    assert a.alloc_extend(idx([0]), idx([4]), None) is None  # full has room, SWA has not
    assert a.alloc_decode(idx([1]), None) is None
    assert torch.equal(a.backup_state().full.free_pages, state.full.free_pages)
    assert torch.equal(a.backup_state().swa.free_pages, state.swa.free_pages)
    a.check_integrity()


def test_free_errors_leave_both_pools(backend: Backend) -> None:
    a, second = staggered(backend)
    a.free(second[:4])
    before = (a.full_available_size(), a.swa_available_size())
    with pytest.raises(DoubleFree):
        a.free(second)
    with pytest.raises(IndexOutOfRange):
        a.free_swa(idx([68]))
    with pytest.raises(IndexOutOfRange):
        a.translate(idx([-1]))
    assert (a.full_available_size(), a.swa_available_size()) == before
    a.check_integrity()


def test_groups_backup_restore_and_clear(backend: Backend) -> None:
    a, second = staggered(backend)
    state = a.backup_state()
    a.free_group_begin()
    a.free(second)
    with pytest.raises(InvalidRequest):
        a.free_group_begin()
    assert a.swa_available_size() == 32 - 8
    a.free_group_end()
    assert a.swa_available_size() == 32
    a.restore_state(state)
    assert a.translate(second).tolist() == list(range(4, 12))
    a.check_integrity()
    with pytest.raises(InvalidRequest):
        a.restore_state(make_swa(backend=backend).backup_state())
    live = a.full_to_swa
    a.clear()
    assert a.full_to_swa is live and not live.any()
    assert a.available_size() == 32
    a.check_integrity()


def test_integrity_catches_a_corrupt_map(backend: Backend) -> None:
    a, _ = staggered(backend)
    a.full_to_swa[9] = 20  # another SWA page than the rest of full page 2
    with pytest.raises(IntegrityError):
        a.check_integrity()
    a.full_to_swa[9] = 6  # right page, wrong offset
    with pytest.raises(IntegrityError):
        a.check_integrity()
    a.full_to_swa[9] = 5
    a.check_integrity()
    a.full_to_swa[20] = 16  # a free full page mapped
    with pytest.raises(IntegrityError):
        a.check_integrity()


def test_usage_and_description(backend: Backend) -> None:
    a = make_swa(backend=backend, page_size=2, num_pages=8, num_swa_pages=4)
    assert (a.size, a.full_size, a.swa_size, a.page_size) == (16, 16, 8, 2)
    assert a.full_to_swa.shape == (18,) and a.full_to_swa.dtype == torch.int64
    assert [u.pool for u in a.usage()] == ["full", "swa"]
    assert a.full_allocator.size == 16 and a.swa_allocator.size == 8


def test_a_partly_used_page_is_mapped_whole(backend: Backend) -> None:
    """The map pairs whole pages (what `SWAKVPool.check_integrity` checks): a page the
    request fills only partly, by extend or by a decode starting it, is mapped at every
    offset, so later decode slots in it are already translated."""
    a = make_swa(backend=backend)
    out = a.alloc_extend(idx([0]), idx([3]), idx([-1]))
    assert out is not None and out.tolist() == [4, 5, 6]
    assert a.full_to_swa[4:8].tolist() == [4, 5, 6, 7]
    a.check_integrity()
    step = a.alloc_decode(idx([4]), idx([6]))
    assert step is not None and step.tolist() == [7]
    step = a.alloc_decode(idx([5]), idx([7]))
    assert step is not None and step.tolist() == [8]
    assert a.full_to_swa[8:12].tolist() == [8, 9, 10, 11]
    assert a.translate(idx([7, 8])).tolist() == [7, 8]
    a.check_integrity()
    a.free_swa(idx([8]))
    assert a.full_to_swa[8:12].tolist() == [0, 0, 0, 0]
    a.check_integrity()
    a.free(idx([4, 5, 6, 7, 8]))
    assert not a.full_to_swa.any() and a.swa_available_size() == 32
    a.check_integrity()


def test_integrity_catches_a_partly_mapped_page(backend: Backend) -> None:
    a = make_swa(backend=backend)
    assert a.alloc_extend(idx([0]), idx([3]), idx([-1])) is not None
    a.full_to_swa[7] = 0
    with pytest.raises(IntegrityError, match="partly"):
        a.check_integrity()


def test_move_swa_hands_the_swa_pages_to_other_full_slots(backend: Backend) -> None:
    a, second = staggered(backend)  # full page 1 (slots 4..7) has no SWA page
    a.move_swa(idx([4, 5, 6, 7]), second[:4])
    assert a.translate(idx([4, 5, 6, 7])).tolist() == [4, 5, 6, 7]
    assert a.translate(second[:4]).tolist() == [0, 0, 0, 0]
    a.check_integrity()
    a.free(second[:4])  # full only: its SWA page went with the move
    assert a.swa_available_size() == 32 - 8
    a.free(idx([4, 5, 6, 7]))  # the moved SWA page goes with its new full page
    assert a.swa_available_size() == 32 - 4
    a.move_swa(idx([]), idx([]))
    a.check_integrity()


@pytest.mark.parametrize(
    ("dst", "src", "error"),
    [
        ([4, 5, 6], [8, 9, 10], InvalidRequest),  # not whole pages
        ([4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15], InvalidRequest),  # lengths differ
        ([5, 4, 6, 7], [8, 9, 10, 11], InvalidRequest),  # not in page order
        ([4, 5, 6, 7], [9, 10, 11, 12], InvalidRequest),  # src straddles pages
        ([12, 13, 14, 15], [8, 9, 10, 11], InvalidRequest),  # dst page still mapped
        ([4, 5, 6, 7], [4, 5, 6, 7], NotAllocated),  # src page has no SWA page
        ([20, 21, 22, 23], [8, 9, 10, 11], NotAllocated),  # dst page free
        ([4, 5, 6, 7, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15], InvalidRequest),  # twice
    ],
)
def test_move_swa_rejects_bad_pages_before_any_change(
    backend: Backend, dst: list[int], src: list[int], error: type[Exception]
) -> None:
    a, _ = staggered(backend)
    before = a.full_to_swa.clone()
    with pytest.raises(error):
        a.move_swa(idx(dst), idx(src))
    assert torch.equal(a.full_to_swa, before)
    a.check_integrity()
