"""HostSlotAllocator: which pages of a host pool are free.

Host pages are numbered 0 .. num_pages-1 and every one is usable: unlike a device pool, a host
pool has no dummy page for padded tokens (nothing ever writes to a host slot by index 0).

The free pages are a `kvstrata.core.free_ids.FreeIds` (the one host free-id list, shared with the
device pools' request rows): allocations come out in ascending runs (a transfer between a
contiguous host run and the device is one large copy per buffer, not one per page), and a
bitmap turns a double free or a corrupt free list into an error instead of silent corruption.

Thread-safe: one lock guards every method, since the tier controller's workers share the
allocator (a write worker allocates while a load worker frees).
"""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.core.free_ids import FreeIds
from kvstrata.pool.base import is_plain_index
from kvstrata.pool.native import native_library
from kvstrata.pool_host.errors import SizeNotPageAligned
from kvstrata.pool_host.transfer import aligned_pages, integer_array, pages_to_token_array

PageArray = npt.NDArray[np.int64]

SOURCE = Path(__file__).with_name("slots.c")
#: What the C functions return when they changed nothing and the NumPy path must run.
FALLBACK = -1
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
_BYTE = ctypes.c_char


def _address(array: npt.NDArray[np.generic]) -> int:
    """The address of a non-empty C-contiguous array's first byte: `array.ctypes.data`, which
    makes a ctypes helper object per call (a third of a small alloc's cost), taken instead
    through the buffer protocol; an array that cannot export a writable contiguous buffer
    (read-only, strided, empty) takes `array.ctypes.data`."""
    try:
        # NumPy arrays export the buffer protocol (its stubs lack `__buffer__` before 3.12).
        return ctypes.addressof(_BYTE.from_buffer(array))  # pyright: ignore[reportArgumentType]
    except (TypeError, ValueError, BufferError):
        return array.ctypes.data


class NativeSlots:
    """`hs_give_tokens` and `hs_take_tokens` of `slots.c` (raw addresses of live int64 / bool
    arrays; see the C file)."""

    def __init__(self, library: ctypes.CDLL) -> None:
        args = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR]
        self.give, self.take = library.hs_give_tokens, library.hs_take_tokens
        for function in (self.give, self.take):
            function.argtypes, function.restype = args, _I64


def native_slots() -> NativeSlots | None:
    """The compiled alloc / free, or None (no compiler, turned off, inside `disabled()`)."""
    library = native_library(SOURCE).library
    return None if library is None else NativeSlots(library)


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
        self._pages = FreeIds(num_pages, what="host pages")
        # The compiled alloc / free of whole pages (None: the NumPy path, same answers).
        self._native = native_slots()
        self._free_address = self._pages.is_free.ctypes.data

    @property
    def compiled(self) -> bool:
        """Whether `alloc` and `free` of whole pages run in C (`slots.c`; False without a
        compiler, with `KVSTRATA_NATIVE=0`, or when built inside `native.disabled()`)."""
        return self._native is not None

    @property
    def size(self) -> int:
        """Capacity in tokens."""
        return self.num_pages * self.page_size

    # --- queries (never mutate) ------------------------------------------------------------------

    def num_free_pages(self) -> int:
        with self._lock:
            return self._pages.num_free

    def available_size(self) -> int:
        """Free capacity in tokens (asked before every host write: one call, one lock)."""
        with self._lock:
            return self._pages.num_free * self.page_size

    def can_alloc_pages(self, num_pages: int) -> bool:
        return num_pages <= self.num_free_pages()

    # --- allocation ------------------------------------------------------------------------------

    def alloc_pages(self, num_pages: int) -> torch.Tensor | None:
        """Allocate `num_pages` pages: their ids (ascending within what was free), or None when
        fewer are free (nothing changes then). `alloc_pages(0)` returns an empty tensor."""
        if num_pages < 0:
            raise SizeNotPageAligned(f"cannot allocate {num_pages} pages")
        with self._lock:
            pages = self._pages.take(num_pages)
        return None if pages is None else torch.from_numpy(pages)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Allocate `need_size` token slots (a multiple of page_size): token indices of whole
        pages, or None when not enough pages are free (nothing changes then)."""
        slots = self.alloc_array(need_size)
        return None if slots is None else torch.from_numpy(slots)

    def alloc_array(self, need_size: int) -> PageArray | None:
        """`alloc` as a NumPy int64 array (the caller's; no tensor made): for callers that read
        the slots as NumPy (the host tier keeps its node values as arrays)."""
        if need_size < 0 or need_size % self.page_size:
            raise SizeNotPageAligned(
                f"need_size {need_size} is not a whole number of pages of {self.page_size}"
            )
        num_pages = need_size // self.page_size
        native = self._native
        with self._lock:
            if native is not None:
                front = self._pages.fresh_front(num_pages)
                if front is None:
                    return None
                out = np.empty(need_size, dtype=np.int64)
                if num_pages == 0 or (
                    native.take(
                        _address(front),
                        num_pages,
                        self.page_size,
                        0,
                        self._free_address,
                        self.num_pages,
                        _address(out),
                    )
                    == num_pages
                ):
                    self._pages.cut_front(num_pages)
                    return out
            pages = self._pages.take(num_pages)  # raises what the C code refused
        if pages is None:
            return None
        return pages_to_token_array(pages, self.page_size)

    # --- release ---------------------------------------------------------------------------------

    def free_pages(self, page_ids: torch.Tensor) -> None:
        """Return pages to the free pool. Raises (changing nothing) NonIntegerIndex for a
        float / bool tensor, IndexOutOfRange, DoubleFree when a page is already free or listed
        twice. Any integer dtype and device. An empty tensor is a no-op."""
        pages = integer_array(page_ids, what="host page ids")
        with self._lock:
            self._pages.give(pages)

    def free(self, indices: torch.Tensor) -> None:
        """Free token indices; they must be whole, aligned pages (as `alloc` returned them).
        Raises as `free_pages` (SizeNotPageAligned for indices that are not whole pages)."""
        native = self._native
        if native is not None and is_plain_index(indices):
            n = indices.shape[0]
            page = self.page_size
            if n == 0:
                return
            if n % page == 0:
                out = np.empty(n // page, dtype=np.int64)
                with self._lock:
                    got = native.give(
                        indices.data_ptr(),
                        n,
                        page,
                        0,
                        self._free_address,
                        self.num_pages,
                        _address(out),
                    )
                    if got == len(out):
                        self._pages.given_marked(out)
                        return
        pages = _page_array(indices, self.page_size)
        with self._lock:
            self._pages.give(pages)

    def clear(self) -> None:
        """Free every page (ids handed out before become invalid)."""
        with self._lock:
            self._pages.clear()

    # --- integrity -------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise IntegrityError unless the free pages are unique, in range and exactly the
        bitmap's free entries, and free + allocated == num_pages."""
        with self._lock:
            self._pages.check_integrity()


def pages_to_tokens(page_ids: torch.Tensor, page_size: int) -> torch.Tensor:
    """Token indices of whole pages, in page order."""
    if page_ids.device.type == "cpu":
        pages = integer_array(page_ids, what="host page ids")
        return torch.from_numpy(pages_to_token_array(pages, page_size))
    offsets = torch.arange(page_size, dtype=torch.int64, device=page_ids.device)
    return (page_ids.to(torch.int64)[:, None] * page_size + offsets).reshape(-1)


def tokens_to_pages(indices: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page ids of token indices that form whole aligned pages; SizeNotPageAligned otherwise
    (NonIntegerIndex for a float / bool tensor)."""
    return torch.from_numpy(_page_array(indices, page_size))


def _page_array(indices: torch.Tensor, page_size: int) -> PageArray:
    flat = integer_array(indices, what="host token indices")
    if flat.size % page_size:
        raise SizeNotPageAligned(f"{flat.size} indices are not whole pages of {page_size}")
    pages = aligned_pages(flat, page_size)
    if pages is None:
        raise SizeNotPageAligned(f"indices are not whole aligned pages of {page_size}")
    return pages
