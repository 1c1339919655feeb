"""The compiled decode round (`decode.c` via `kvstrata.allocator.native`) against the fused NumPy
path it replaces: twin allocators, one built inside `kvstrata.pool.native.disabled()`, must
return the same slots, raise the same errors with the same messages, and keep the same free
list, on every input the C code takes and every one it hands back."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kvstrata.allocator import PagedAllocator
from kvstrata.allocator.errors import IntegrityError
from kvstrata.allocator.native import FALLBACK, native_decode
from kvstrata.pool import native
from kvstrata.testkit.allocators import idx, make_paged
from kvstrata.testkit.spies import ResultSpy

pytestmark = pytest.mark.skipif(native_decode() is None, reason="no compiled decode round")

INT64_MAX = (1 << 63) - 1


def twins(**kwargs: object) -> tuple[PagedAllocator, PagedAllocator]:
    fast = make_paged(backend="numpy", **kwargs)  # type: ignore[arg-type]
    with native.disabled():
        slow = make_paged(backend="numpy", **kwargs)  # type: ignore[arg-type]
    assert fast._engine._native is not None and slow._engine._native is None  # type: ignore[attr-defined]
    return fast, slow


def free_list(a: PagedAllocator) -> tuple[list[int], list[int]] | int:
    if a._engine.group_open:  # type: ignore[attr-defined]  # no backup inside a group
        return a.available_size()
    state = a.backup_state()
    return state.free_pages.tolist(), state.released_pages.tolist()


def both(
    fast: PagedAllocator, slow: PagedAllocator, op: Callable[[PagedAllocator], object]
) -> object:
    """Run `op` on both; same result or same error (type and message), same free list."""
    outcomes = []
    for a in (fast, slow):
        try:
            got = op(a)
            outcomes.append(("ok", got.tolist() if isinstance(got, torch.Tensor) else got))
        except Exception as exc:  # noqa: BLE001 - compared, then re-raised below if unequal
            outcomes.append((type(exc).__name__, str(exc)))
    assert outcomes[0] == outcomes[1]
    assert free_list(fast) == free_list(slow)
    assert fast.counters == slow.counters
    fast.check_integrity()
    slow.check_integrity()
    return outcomes[0][1]


def hold(
    fast: PagedAllocator, slow: PagedAllocator, lengths: list[int], page: int
) -> tuple[list[int], list[list[int]]]:
    """Each request holds `lengths[i]` tokens (whole pages allocated); returns last_loc (-1 for
    an empty request) and each request's slots."""
    last, slots = [], []
    for n in lengths:
        got = both(fast, slow, lambda a, n=n: a.alloc(-(-n // page) * page)) if n else []
        assert isinstance(got, list)
        last.append(got[n - 1] if n else -1)
        slots.append(got)
    return last, slots


@pytest.mark.parametrize("checked", [True, False])
@pytest.mark.parametrize("page_size", [2, 16])
def test_decode_rounds_match_the_numpy_path(page_size: int, checked: bool) -> None:
    fast, slow = twins(page_size=page_size, num_pages=64, checked=checked)
    gen = torch.Generator().manual_seed(page_size)
    for _ in range(6):
        lengths = torch.randint(0, 3 * page_size, (12,), generator=gen).tolist()
        last, slots = hold(fast, slow, lengths, page_size)
        seq = torch.tensor(lengths) + 1
        loc = idx(last)
        out = both(fast, slow, lambda a, s=seq, lo=loc: a.alloc_decode(s, lo))
        assert isinstance(out, list)
        new = idx(out)
        both(fast, slow, lambda a, o=new: a.free(o))  # one slot per page: the C free
        gone = {s // page_size for s in out}
        rest = idx([s for mine in slots for s in mine if s // page_size not in gone])
        if len(rest):  # several slots per page: the NumPy free
            both(fast, slow, lambda a, r=rest: a.free(r))
        assert fast.available_size() == fast.size


def test_every_refused_input_raises_what_the_numpy_path_raises() -> None:
    fast, slow = twins(page_size=4, num_pages=16)
    last, _ = hold(fast, slow, [3, 6], 4)  # slots 1..3 in page 1 (3 used), pages 2-3 (6 used)
    cases: list[tuple[torch.Tensor, torch.Tensor | None]] = [
        (idx([0, 7]), idx(last)),  # seq_len 0
        (idx([4, 7]), None),  # continuing requests without last_loc
        (idx([4, 7]), idx([last[0], 40])),  # a slot in a free page
        (idx([4, 7]), idx([last[0] + 1, last[1]])),  # misaligned
        (idx([4, 7]), idx([2, last[1]])),  # page 0
        (idx([4, 7]), idx([-5, last[1]])),  # negative
        (idx([4, 7]), idx([10_000, last[1]])),  # past the end
        (idx([4, 7]), idx([INT64_MAX, last[1]])),  # would overflow
        (idx([4, 7, 5]), idx(last)),  # lengths differ
    ]
    for seq, loc in cases:
        both(fast, slow, lambda a, s=seq, lo=loc: a.alloc_decode(s, lo))


def test_frees_the_c_code_hands_back_behave_as_before() -> None:
    fast, slow = twins(page_size=4, num_pages=16)
    last, _ = hold(fast, slow, [3, 6, 2], 4)
    both(fast, slow, lambda a: a.free(idx([last[0], 14])))  # 14: a free page
    both(fast, slow, lambda a: a.free(idx([2, last[0]])))  # page 0
    both(fast, slow, lambda a: a.free(idx([last[0], 1000])))  # past the end
    both(fast, slow, lambda a: a.free(idx([last[1], last[1] - 1])))  # one page twice: fine
    both(fast, slow, lambda a: a.free(idx([last[0], last[0]])))  # a slot twice
    both(fast, slow, lambda a: a.free(idx([last[2], last[0]])))
    both(fast, slow, lambda a: a.free(idx([last[2], last[0]])))  # a double free


def test_plain_inputs_only_and_every_engine_state() -> None:
    fast, slow = twins(page_size=4, num_pages=32)
    last, _ = hold(fast, slow, [2, 5, 7], 4)
    seq = idx([3, 6, 8])
    # int32, strided and 2-D inputs take the NumPy path; results are the same.
    both(fast, slow, lambda a: a.alloc_decode(seq.to(torch.int32), idx(last)))
    last = [s + 1 for s in last]
    strided = torch.stack([torch.tensor(last), torch.zeros(3, dtype=torch.int64)], 1)[:, 0]
    assert not strided.is_contiguous()
    both(fast, slow, lambda a: a.alloc_decode(seq + 1, strided))
    # A free inside a group is queued, not pushed: the NumPy path's job.
    both(fast, slow, lambda a: a.free_group_begin())
    both(fast, slow, lambda a: a.free(idx([s + 1 for s in last])))
    both(fast, slow, lambda a: a.free_group_end())


def test_a_short_stack_with_released_pages_and_exhaustion() -> None:
    fast, slow = twins(page_size=4, num_pages=8, sorted_reuse=True)
    held = both(fast, slow, lambda a: a.alloc(4 * 7))  # every page
    assert isinstance(held, list)
    both(fast, slow, lambda a: a.free(idx(held[::4][:3])))  # 3 pages released, not stacked
    both(fast, slow, lambda a: a.alloc_decode(idx([1, 5, 9]), None))  # needs the released ones
    both(fast, slow, lambda a: a.alloc_decode(idx([1]), None))  # none left: None


def test_an_unchecked_double_free_never_drives_the_c_round_off_the_stack() -> None:
    # Unchecked + sorted reuse does not see a double free; the merge of released pages used to
    # set a negative head before failing, and the C round then read before the stack array.
    fast, slow = twins(page_size=2, num_pages=4, checked=False, sorted_reuse=True)
    both(fast, slow, lambda a: a.alloc(6))
    both(fast, slow, lambda a: a.free(idx([2, 4])))
    for a in (fast, slow):
        a.free(idx([2, 4]))  # the caller's bug, unseen (check_integrity would now fail)
    for _ in range(2):
        for a in (fast, slow):
            with pytest.raises(IntegrityError, match="freed twice"):
                a.alloc_decode(idx([1, 1, 1]), None)
            assert a._engine._head >= 0  # type: ignore[attr-defined]


@pytest.mark.parametrize("checked", [True, False])
def test_whole_page_frees_in_one_call_match_the_numpy_path(checked: bool) -> None:
    # A tree's eviction frees whole pages (runs of one page's slots, rising); more than
    # RUN_COLLAPSE_MIN slots used to take the plan path, fewer the stamping path.
    fast, slow = twins(page_size=16, num_pages=1024, checked=checked)
    gen = torch.Generator().manual_seed(3)
    held: list[list[int]] = []
    for n in torch.randint(1, 90, (12,), generator=gen).tolist():
        got = both(fast, slow, lambda a, n=n: a.alloc(16 * n))
        assert isinstance(got, list)
        held.append(got)
    for k, slots in enumerate(held):
        if k % 3 == 0:
            slots = slots[: len(slots) - 16 * (len(slots) // 32)]  # part of the pages
            part = idx(slots)
        elif k % 3 == 1:
            part = idx(slots[5:] + slots[:5])  # the head page split into two runs: NumPy path
        else:
            part = idx([s for i, s in enumerate(slots) if i % 16 < 9])  # partial pages
        before = fast.counters.freed_slots
        both(fast, slow, lambda a, p=part: a.free(p))
        assert fast.counters.freed_slots > before


def test_whole_page_frees_refused_as_the_numpy_path_refuses() -> None:
    fast, slow = twins(page_size=4, num_pages=16)
    got = both(fast, slow, lambda a: a.alloc(4 * 6))
    assert isinstance(got, list)
    both(fast, slow, lambda a: a.free(idx(got[:4])))
    both(fast, slow, lambda a: a.free(idx(got[:8])))  # its first page is free already
    both(fast, slow, lambda a: a.free(idx([*got[4:8], got[4]])))  # a slot twice, apart
    both(fast, slow, lambda a: a.free(idx([got[5], got[5], got[6]])))  # a slot twice, adjacent
    both(fast, slow, lambda a: a.free(idx([got[7], got[6]])))  # one page, falling: fine
    both(fast, slow, lambda a: a.free(idx([0, 1, 2, 3, *got[8:12]])))  # page 0
    both(fast, slow, lambda a: a.free(idx([*got[12:16], 64, 65])))  # past the end
    both(fast, slow, lambda a: a.free(idx([-4, -3, *got[12:16]])))  # negative
    both(fast, slow, lambda a: a.free(idx(got[12:])))


@pytest.mark.parametrize("checked", [True, False])
def test_check_allocated_in_one_call_raises_what_the_numpy_path_raises(checked: bool) -> None:
    fast, slow = twins(page_size=4, num_pages=16, checked=checked)
    got = both(fast, slow, lambda a: a.alloc(4 * 5))
    assert isinstance(got, list)
    both(fast, slow, lambda a: a.free(idx(got[4:8])))
    cases = [
        got[:4] + got[8:],  # all handed out
        got[8:12] + got[8:12],  # repeats are the caller's business here
        got[:8],  # a free page (NotAllocated when checked)
        [1, 2, *got[:4]],  # page 0
        [-1, *got[:4]],  # negative
        [*got[:4], 64],  # past the end
        [],
    ]
    for case in cases:
        probe = idx(case)
        both(fast, slow, lambda a, c=probe: a.check_allocated(c, "probe"))
        both(fast, slow, lambda a, c=probe: a.check_allocated(c.to(torch.int32), "probe"))


@pytest.mark.parametrize("checked", [True, False])
def test_whole_page_frees_and_checks_are_the_c_code_s(checked: bool) -> None:
    """The twins above agree whether or not the C code answers; here it must answer (no
    fallback) a tree's whole-page free, of any length, and a check of handed-out slots."""
    fast, slow = twins(page_size=8, num_pages=512, checked=checked)
    # The engine's `NativeDecode` with every result of `free_slots` / `check_slots` kept.
    spy = ResultSpy(fast._engine._native, ("free_slots", "check_slots"))  # type: ignore[attr-defined]
    fast._engine._native = spy  # type: ignore[attr-defined]
    held = both(fast, slow, lambda a: a.alloc(8 * 300))  # over RUN_COLLAPSE_MIN slots
    assert isinstance(held, list)
    for part in (held[:24], held[24:40] + held[:-8], held[-8:]):
        both(fast, slow, lambda a, p=part: a.check_allocated(idx(p), "probe"))
    both(fast, slow, lambda a: a.free(idx(held[8:])))
    both(fast, slow, lambda a: a.free(idx(held[:3])))  # part of a page, rising
    assert len(spy.results) == 5 and FALLBACK not in spy.results
