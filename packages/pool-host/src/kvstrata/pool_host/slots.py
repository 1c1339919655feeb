"""HostSlotAllocator: which pages of a host pool are free.

Host pages are numbered 0 .. num_pages-1 and every one is usable: unlike a device pool, a host
pool has no dummy page for padded tokens (nothing ever writes to a host slot by index 0).

Free pages live in two places so that allocations stay contiguous (a transfer between a
contiguous host run and the device is one large copy per buffer, not one per page):

    _free      sorted ascending; alloc takes from its front, so fresh pages come in runs
    _released  pages freed since the last merge; merged (and sorted) into _free only when
               _free alone cannot satisfy an allocation, which keeps alloc O(n) almost always

    _is_free[p]  True iff page p is in _free or _released: the bitmap that makes a double free
                 or a double allocation an O(n) vectorised check instead of silent corruption

Thread-safe: one lock guards every method, since the tier controller's workers share the
allocator (a write worker allocates while a load worker frees).
"""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.pool_host.errors import (
    DoubleAllocation,
    DoubleFree,
    IndexOutOfRange,
    SizeNotPageAligned,
)
from kvstrata.pool_host.transfer import first_misaligned_page, integer_array

PageArray = npt.NDArray[np.int64]


class HostSlotAllocator:
    """Page allocator of one host pool. Indices are int64 CPU tensors.

    Token indices of host page p are p*page_size .. p*page_size + page_size - 1.
    Returned indices stay valid (owned by the caller) until freed; `clear()` frees everything.
    """

    def __init__(self, *, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise SizeNotPageAligned(f"a host allocator needs at least one page, got {num_pages}")
        if page_size < 1:
            raise SizeNotPageAligned(f"page_size must be positive, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._lock = threading.Lock()
        self._free: PageArray = np.arange(num_pages, dtype=np.int64)
        self._released: list[PageArray] = []
        self._num_released = 0
        self._is_free = np.ones(num_pages, dtype=np.bool_)

    @property
    def size(self) -> int:
        """Capacity in tokens."""
        return self.num_pages * self.page_size

    # --- queries (never mutate) ------------------------------------------------------------------

    def num_free_pages(self) -> int:
        with self._lock:
            return self._free.size + self._num_released

    def available_size(self) -> int:
        """Free capacity in tokens."""
        return self.num_free_pages() * self.page_size

    def can_alloc_pages(self, num_pages: int) -> bool:
        return num_pages <= self.num_free_pages()

    # --- allocation ------------------------------------------------------------------------------

    def alloc_pages(self, num_pages: int) -> torch.Tensor | None:
        """Allocate `num_pages` pages: their ids (ascending within what was free), or None when
        fewer are free (nothing changes then). `alloc_pages(0)` returns an empty tensor."""
        if num_pages < 0:
            raise SizeNotPageAligned(f"cannot allocate {num_pages} pages")
        with self._lock:
            if num_pages > self._free.size + self._num_released:
                return None
            if num_pages > self._free.size:
                self._merge_released()
            pages = self._free[:num_pages]
            if not self._is_free[pages].all():
                bad = pages[~self._is_free[pages]]
                raise DoubleAllocation(
                    f"host pages {bad[:8].tolist()} are on the free list but already allocated: "
                    "the allocator state is corrupt (a free of pages this allocator never gave?)"
                )
            self._free = self._free[num_pages:]
            self._is_free[pages] = False
            return torch.from_numpy(pages.copy())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Allocate `need_size` token slots (a multiple of page_size): token indices of whole
        pages, or None when not enough pages are free (nothing changes then)."""
        if need_size < 0 or need_size % self.page_size:
            raise SizeNotPageAligned(
                f"need_size {need_size} is not a whole number of pages of {self.page_size}"
            )
        pages = self.alloc_pages(need_size // self.page_size)
        if pages is None:
            return None
        return pages_to_tokens(pages, self.page_size)

    # --- release ---------------------------------------------------------------------------------

    def free_pages(self, page_ids: torch.Tensor) -> None:
        """Return pages to the free pool. Raises (changing nothing) NonIntegerIndex for a
        float / bool tensor, IndexOutOfRange, DoubleFree when a page is already free or listed
        twice. Any integer dtype and device. An empty tensor is a no-op."""
        pages = integer_array(page_ids, what="host page ids")
        if pages.size == 0:
            return
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 0 or hi >= self.num_pages:
            raise IndexOutOfRange(
                f"host pages must lie in [0, {self.num_pages}), got range [{lo}, {hi}]"
            )
        if np.unique(pages).size != pages.size:
            raise DoubleFree("the same host page is listed twice in one free")
        with self._lock:
            already = self._is_free[pages]
            if already.any():
                raise DoubleFree(f"host pages {pages[already][:8].tolist()} are already free")
            self._is_free[pages] = True
            self._released.append(pages.copy())
            self._num_released += pages.size

    def free(self, indices: torch.Tensor) -> None:
        """Free token indices; they must be whole, aligned pages (as `alloc` returned them)."""
        self.free_pages(tokens_to_pages(indices, self.page_size))

    def clear(self) -> None:
        """Free every page (ids handed out before become invalid)."""
        with self._lock:
            self._free = np.arange(self.num_pages, dtype=np.int64)
            self._released = []
            self._num_released = 0
            self._is_free[:] = True

    # --- integrity -------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert the invariants: free pages are unique, in range, exactly the bitmap's True
        entries; _free is sorted; free + allocated == num_pages."""
        with self._lock:
            parts = [self._free, *self._released]
            free = np.concatenate(parts) if parts else np.empty(0, np.int64)
            assert self._num_released == sum(r.size for r in self._released), (
                "released page count drifted from the released lists"
            )
            assert free.size == np.unique(free).size, "a host page is on the free lists twice"
            assert free.size == 0 or (free.min() >= 0 and free.max() < self.num_pages), (
                "a free host page id is out of range"
            )
            assert np.all(np.diff(self._free) > 0), "the primary free list must stay sorted"
            expected = np.zeros(self.num_pages, dtype=np.bool_)
            expected[free] = True
            assert np.array_equal(expected, self._is_free), (
                "the free bitmap disagrees with the free lists"
            )

    def _merge_released(self) -> None:
        # Caller holds the lock. Sorting here (not on every free) keeps free O(n) and still
        # hands out low, contiguous pages once the fresh ones run out.
        self._free = np.sort(np.concatenate([self._free, *self._released]))
        self._released = []
        self._num_released = 0


def pages_to_tokens(page_ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token indices of whole pages, in page order."""
    offsets = torch.arange(page_size, dtype=torch.int64, device=page_ids.device)
    return (page_ids.to(torch.int64)[:, None] * page_size + offsets).reshape(-1)


def tokens_to_pages(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page ids of token indices that form whole aligned pages; SizeNotPageAligned otherwise
    (NonIntegerIndex for a float / bool tensor)."""
    flat = integer_array(indices, what="host token indices")
    if flat.size % page_size:
        raise SizeNotPageAligned(f"{flat.size} indices are not whole pages of {page_size}")
    if first_misaligned_page(flat, page_size) is not None:
        raise SizeNotPageAligned(f"indices are not whole aligned pages of {page_size}")
    return torch.from_numpy(flat[::page_size] // page_size)
