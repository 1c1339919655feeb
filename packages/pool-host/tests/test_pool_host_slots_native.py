"""The compiled alloc / free of `HostSlotAllocator` (`slots.c`) against its NumPy path: twin
allocators, one built inside `kvstrata.pool.native.disabled()`, must hand out the same slots,
raise the same errors with the same messages and keep the same free list, on every input the C
code takes and every one it hands back."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from kvstrata.pool import native
from kvstrata.pool_host import HostSlotAllocator
from kvstrata.pool_host.slots import FALLBACK, _address, native_slots
from kvstrata.testkit.spies import ResultSpy

pytestmark = pytest.mark.skipif(native_slots() is None, reason="no compiled host slots")


def twins(num_pages: int, page_size: int) -> tuple[HostSlotAllocator, HostSlotAllocator]:
    fast = HostSlotAllocator(num_pages=num_pages, page_size=page_size)
    with native.disabled():
        slow = HostSlotAllocator(num_pages=num_pages, page_size=page_size)
    assert fast._native is not None and slow._native is None
    return fast, slow


def state(a: HostSlotAllocator) -> tuple[list[int], list[list[int]], list[bool]]:
    ids = a._pages
    return ids._fresh.tolist(), [g.tolist() for g in ids._given], ids.is_free.tolist()


def outcome(a: HostSlotAllocator, op: Callable[[HostSlotAllocator], object]) -> tuple[str, object]:
    """("ok", result as a list) or (error type, message)."""
    try:
        got = op(a)
    except Exception as exc:  # noqa: BLE001 - compared by the caller
        return type(exc).__name__, str(exc)
    return "ok", got.tolist() if isinstance(got, (torch.Tensor, np.ndarray)) else got


def both(
    fast: HostSlotAllocator, slow: HostSlotAllocator, op: Callable[[HostSlotAllocator], object]
) -> object:
    """Run `op` on both: same result or same error (type and message), same free list."""
    seen = outcome(fast, op)
    assert seen == outcome(slow, op)
    assert state(fast) == state(slow)
    for a in (fast, slow):
        a.check_integrity()
    return seen[1]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_random_allocs_and_frees_match_the_numpy_path(page_size: int) -> None:
    fast, slow = twins(64, page_size)
    rng = np.random.default_rng(page_size)
    held: list[list[int]] = []
    for _ in range(200):
        if held and rng.random() < 0.45:
            slots = torch.tensor(held.pop(int(rng.integers(len(held)))), dtype=torch.int64)
            both(fast, slow, lambda a, s=slots: a.free(s))
        else:
            n = int(rng.integers(0, 9)) * page_size
            if rng.random() < 0.5:
                got = both(fast, slow, lambda a, n=n: a.alloc(n))
            else:  # the NumPy-array form: the same slots, no tensor
                got = both(fast, slow, lambda a, n=n: a.alloc_array(n))
            if isinstance(got, list):
                held.append(got)


@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("compiled", [True, False])
def test_alloc_array_is_alloc_without_the_tensor(page_size: int, compiled: bool) -> None:
    """Two allocators of one path, one answering `alloc` and the other `alloc_array`: the same
    slots (as an int64 array), the same refusals, the same free lists."""
    pair = twins(16, page_size)[0 if compiled else 1], twins(16, page_size)[0 if compiled else 1]
    tensor, array = pair
    assert (tensor._native is not None) is compiled
    for n in (3, 0, 5, 9, 1):
        want = tensor.alloc(n * page_size)
        got = array.alloc_array(n * page_size)
        if want is None:
            assert got is None
            continue
        assert isinstance(got, np.ndarray) and got.dtype == np.int64
        assert got.tolist() == want.tolist()
        assert state(tensor) == state(array)
    for a in pair:
        with pytest.raises(Exception, match="not a whole number of pages") as caught:
            a.alloc_array(-page_size)
        assert type(caught.value).__name__ == "SizeNotPageAligned"
        a.check_integrity()


def test_frees_the_c_code_refuses_raise_what_the_numpy_path_raises() -> None:
    fast, slow = twins(16, 4)
    got = both(fast, slow, lambda a: a.alloc(4 * 6))
    assert isinstance(got, list)
    both(fast, slow, lambda a: a.free(torch.tensor(got[:4])))
    cases = [
        got[:8],  # its first page is free already
        got[4:8] + got[4:8],  # a page twice
        got[5:9],  # not aligned
        got[4:6],  # not a whole page
        [*got[4:7], got[4]],  # not in order
        [64, 65, 66, 67],  # past the end
        [-4, -3, -2, -1],  # negative
        [],
    ]
    for case in cases:
        probe = torch.tensor(case, dtype=torch.int64)
        both(fast, slow, lambda a, p=probe: a.free(p))
        both(fast, slow, lambda a, p=probe: a.free(p.to(torch.int32)))  # the NumPy path
    both(fast, slow, lambda a: a.free(torch.tensor(got[4:], dtype=torch.int64).reshape(5, 4)))
    both(fast, slow, lambda a: a.free(torch.tensor([0.0, 1.0, 2.0, 3.0])))
    both(fast, slow, lambda a: a.alloc(3))  # not whole pages
    both(fast, slow, lambda a: a.alloc(4 * 16))  # more than is free: None


def test_a_corrupt_free_list_is_refused_by_both_paths() -> None:
    fast, slow = twins(4, 2)
    for a in (fast, slow):
        assert a.alloc(2) is not None
        a._pages._fresh = np.array([0, 1, 2, 3], dtype=np.int64)  # an allocated page on it
    for a in (fast, slow):
        with pytest.raises(Exception, match="free list is corrupt") as caught:
            a.alloc(2)
        assert type(caught.value).__name__ == "IntegrityError"
        assert a._pages._fresh.tolist() == [0, 1, 2, 3] and not a._pages.is_free[0]


@pytest.mark.parametrize("page_size", [1, 4])
def test_whole_page_allocs_and_frees_are_the_c_code_s(page_size: int) -> None:
    """The twins above agree whether or not the C code answers; here it must answer (no
    fallback) allocs and frees of whole pages, also after given-back pages were merged."""
    fast, slow = twins(16, page_size)
    spy = ResultSpy(fast._native, ("give", "take"))  # the `NativeSlots`, its results kept
    fast._native = spy  # pyright: ignore[reportAttributeAccessIssue]
    got = [both(fast, slow, lambda a, n=n: a.alloc(n * page_size)) for n in (5, 6, 5)]
    for slots in got[1], got[0]:
        assert isinstance(slots, list)
        both(fast, slow, lambda a, s=slots: a.free(torch.tensor(s, dtype=torch.int64)))
    both(fast, slow, lambda a: a.alloc(8 * page_size))  # takes the merged, given-back pages
    assert len(spy.results) == 6 and FALLBACK not in spy.results


def test_the_array_address_is_numpy_s_for_every_kind_of_array() -> None:
    """`_address` (the buffer-protocol address the compiled alloc / free pass) is
    `ctypes.data` for writable views and arrays, and falls back to it for arrays without a
    writable contiguous buffer (read-only, strided, empty)."""
    base = np.arange(40, dtype=np.int64)
    readonly = np.frombuffer(base.tobytes(), dtype=np.int64)
    assert not readonly.flags.writeable
    for array in (base, base[7:], base[7:9], base[::2], np.empty(0, dtype=np.int64), readonly):
        assert _address(array) == array.ctypes.data
