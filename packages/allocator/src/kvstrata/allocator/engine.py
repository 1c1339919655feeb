"""The page engine: the free pages of one pool, and the index arithmetic that hands them out.

Every allocator family is a thin layer over one engine (two for SWA). The engine keeps the free
pages on a stack in a preallocated int64 array, so that taking n pages is a slice and returning
them is a slice write, and (when checked) a mark per page, free or handed out, that validates
every index a caller hands back:

```
 _stack:  [ handed out / scratch ......... | free pages, next out first ........ ]
           0                              _head                            capacity
 take(n): the n pages at _head, _head += n          push(m pages): _head -= m, write them there
```
Freed pages go back on top of the stack, so the most recently freed (warmest) pages are reused
first. In sorted-reuse mode frees go to a separate `released` list instead, and when the stack
runs short the two are merged and sorted (lazily, once per shortage), so allocations come out as
ascending, mostly contiguous pages: cheaper transfers for prefill/decode disaggregation.

Two backends do the array work: `NumpyPageEngine` (CPU: numpy's small-op overhead is ~1 us and
its fancy indexing several times faster than torch's on CPU) and `TorchPageEngine` (any device;
on CUDA the free list never leaves the GPU). This base keeps everything that is plain integers
(stack pointers, groups, snapshots, integrity checks) and the page arithmetic with its
validation (`plan_extend`, `plan_decode`, `check_last_loc`: one implementation, written against
the operators numpy and torch share), so the two subclasses hold only array primitives and the
commit / free paths.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from typing import Any, Generic, Literal, NamedTuple, NoReturn, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.allocator.base import AllocatorCounters
from kvstrata.allocator.errors import (
    DoubleFree,
    DuplicateIndex,
    IndexOutOfRange,
    IntegrityError,
    InvalidRequest,
    MisalignedIndex,
    NotAllocated,
    ReservedIndex,
)

__all__ = [
    "Backend",
    "DecodePlan",
    "ExtendPlan",
    "FreePlan",
    "HostArrays",
    "PageEngine",
    "as_index_tensor",
]

#: Which array library an engine computes with.
Backend = Literal["numpy", "torch"]

#: The engine's native array type (numpy.ndarray or torch.Tensor).
A = TypeVar("A")
#: The engine's native boolean mask type (a bool numpy.ndarray, or torch.Tensor).
M = TypeVar("M")

# Plans are NamedTuples, not dataclasses: they are built on every call of the hot path, where
# a frozen dataclass costs twice as much to construct (and 20 us when the caches are cold).

#: At most this many offending values are quoted in an error message.
SAMPLE = 4

#: Below this many slots a free skips collapsing runs of one page: a decode batch frees one slot
#: per page, and the extra pass would cost more than it saves.
RUN_COLLAPSE_MIN = 1024

#: Page marks of a checked engine's `_marks` array (both backends; `engine_numpy.py` explains
#: the array): on the free list, the padding page 0, the sentinel past the last page.
FREE, RESERVED, BEYOND = -1, -2, -3


class ExtendPlan(NamedTuple, Generic[A]):
    """A validated `alloc_extend`, ready to commit once `num_new_pages` pages are available."""

    num_tokens: int
    num_new_pages: int
    prefix_lens: A
    seq_lens: A
    #: New pages per request (None at page size 1, where every token is a new page).
    new_pages: A | None
    #: Requests that first fill the rest of their last prefix page (None when none do).
    partial: A | None
    last_loc: A | None


class DecodePlan(NamedTuple, Generic[A]):
    """A validated `alloc_decode`: `num_new_pages` requests open a page, the others continue."""

    num_requests: int
    num_new_pages: int
    #: Requests whose new token starts a page (None when every request does).
    opens_page: A | None
    #: last_loc + 1 per request (read only where no page opens; None when every request
    #: opens one). Owned by the plan: commit writes the new pages' slots into it.
    next_slot: A | None


class FreePlan(NamedTuple, Generic[A]):
    """Validated, distinct page ids to return to the free list."""

    pages: A
    num_pages: int


class HostArrays(NamedTuple):
    """Host copies of an engine's state, for integrity checks and snapshots."""

    stack_free: npt.NDArray[np.int64]
    released: npt.NDArray[np.int64]
    pending: npt.NDArray[np.int64]
    #: True = free; None when the engine runs unchecked.
    free_bitmap: npt.NDArray[np.bool_] | None


#: Integer dtypes an index tensor may have (converted to int64 by the engine).
INDEX_DTYPES = frozenset(
    {torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32}
)


def as_index_tensor(value: object, name: str) -> torch.Tensor:
    """`value` as a flat integer tensor (any integer dtype). Raises `InvalidRequest`.

    Deliberately cheap: on the hot path every torch call counts (see engine_numpy).
    """
    if not isinstance(value, torch.Tensor):
        raise InvalidRequest(f"{name} must be a torch.Tensor of integers, not {type(value)!r}")
    if value.dtype not in INDEX_DTYPES:
        raise InvalidRequest(f"{name} must have an integer dtype, not {value.dtype}")
    return value if value.ndim == 1 else value.reshape(-1)


def sample(values: Sequence[object]) -> str:
    """The first few values of a list, for an error message."""
    head = ", ".join(str(v) for v in values[:SAMPLE])
    return f"[{head}{', ...' if len(values) > SAMPLE else ''}] ({len(values)} in all)"


class PageEngine(ABC, Generic[A, M]):
    """Free pages 1 .. num_pages-1 of one pool plus the arithmetic that hands them out.

    Not thread-safe: an allocator belongs to one scheduler thread, as in every engine.
    """

    def __init__(
        self,
        *,
        num_pages: int,
        page_size: int,
        device: torch.device,
        sorted_reuse: bool,
        checked: bool,
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_rows = num_pages * page_size
        self.capacity = num_pages - 1
        self.device = device
        self.sorted_reuse = sorted_reuse
        self.checked = checked
        # Free stack is _stack[_head:capacity]; released (sorted mode) is _released[:_num_released].
        self._head = 0
        self._num_released = 0
        # Pages freed inside an open group: already marked free, not yet takeable.
        self._pending: list[A] | None = None
        self._num_pending = 0
        self._allocate()

    @abstractmethod
    def _allocate(self) -> None:
        """Allocate the backend's free stack, released list, marks and scratch arrays for
        the geometry set above (called once, by `__init__`)."""

    # ---- plain bookkeeping ---------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages a take could hand out now (the stack plus released pages)."""
        return self.capacity - self._head + self._num_released

    @property
    def num_pending_pages(self) -> int:
        return self._num_pending

    def _merged_head(self, num_live: int) -> int:
        """Where the stack starts once `num_live` free pages are merged onto it (sorted reuse);
        IntegrityError, before any change, when more pages are free than the pool holds (only
        an unchecked allocator, which does not see double frees, gets there)."""
        head = self.capacity - num_live
        if head < 0:
            raise IntegrityError(
                f"{num_live} free pages in a pool of {self.capacity}: a page was freed twice"
            )
        return head

    @property
    def group_open(self) -> bool:
        return self._pending is not None

    def can_take(self, num_pages: int) -> bool:
        return num_pages <= self.num_free_pages

    def take_pages(self, num_pages: int) -> A:
        """Pop `num_pages` pages (asserted available). The result is a view into the stack:
        use it before the next push, which may overwrite it."""
        on_stack = self.capacity - self._head
        assert num_pages <= on_stack + self._num_released, "take_pages without can_take"
        if on_stack < num_pages:
            self._merge_released()
        pages = self._stack_view(self._head, self._head + num_pages)
        self._head += num_pages
        if self.checked:
            self._set_free(pages, free=False)
        return pages

    def give(self, plan: FreePlan[A]) -> None:
        """Return validated pages: now, or at the end of the open group."""
        if plan.num_pages == 0:
            return
        if self.checked:
            self._set_free(plan.pages, free=True)
        if self._pending is not None:
            # A plan may alias the caller's tensor; the caller may reuse it before group end.
            self._pending.append(self._own(plan.pages))
            self._num_pending += plan.num_pages
        else:
            self._push(plan.pages, plan.num_pages)

    def _push(self, pages: A, num_pages: int) -> None:
        if num_pages == 0:
            return
        if self.sorted_reuse:
            self._write_released(self._num_released, pages)
            self._num_released += num_pages
        else:
            assert self._head >= num_pages, "free stack overflow: a page was freed twice unseen"
            self._head -= num_pages
            self._write_stack(self._head, pages)

    def group_begin(self) -> None:
        if self._pending is not None:
            raise InvalidRequest("free_group_begin: a free group is already open")
        self._pending = []
        self._num_pending = 0

    def group_end(self) -> None:
        if self._pending is None:
            raise InvalidRequest("free_group_end without free_group_begin")
        pending, count = self._pending, self._num_pending
        self._pending = None
        self._num_pending = 0
        if pending:
            self._push(self._concat(pending), count)

    def clear(self) -> None:
        self._reset_arrays()
        self._head = 0
        self._num_released = 0
        self._pending = None
        self._num_pending = 0

    def snapshot(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the free stack and the released list, as tensors on the device."""
        if self._pending is not None:
            raise InvalidRequest("backup_state inside a free group: end the group first")
        return self._snapshot_arrays()

    def restore(self, free_pages: torch.Tensor, released: torch.Tensor) -> None:
        if self._pending is not None:
            raise InvalidRequest("restore_state inside a free group: end the group first")
        num_free, num_released = int(free_pages.numel()), int(released.numel())
        assert num_free + num_released <= self.capacity, "snapshot larger than the pool"
        self._load_arrays(free_pages, released)
        self._head = self.capacity - num_free
        self._num_released = num_released

    def check_integrity(self) -> None:
        """See `SlotAllocator.check_integrity`. Raises `IntegrityError`."""
        if not 0 <= self._head <= self.capacity:
            raise IntegrityError(f"stack pointer {self._head} outside [0, {self.capacity}]")
        if self._num_released and not self.sorted_reuse:
            raise IntegrityError("released pages outside sorted-reuse mode")
        host = self._host_arrays()
        if len(host.pending) != self._num_pending:
            raise IntegrityError(f"{len(host.pending)} pending pages, counted {self._num_pending}")
        free = np.concatenate((host.stack_free, host.released, host.pending))
        if len(free) > self.capacity:
            raise IntegrityError(f"{len(free)} free pages in a pool of {self.capacity}")
        if len(free) and (free.min() < 1 or free.max() >= self.num_pages):
            bad = free[(free < 1) | (free >= self.num_pages)]
            raise IntegrityError(f"free list holds invalid page ids {sample(bad.tolist())}")
        seen = np.bincount(free, minlength=self.num_pages)
        if len(free) and seen.max() > 1:
            twice = np.flatnonzero(seen > 1)
            raise IntegrityError(f"pages listed free more than once {sample(twice.tolist())}")
        bitmap = host.free_bitmap
        if bitmap is not None:
            if bitmap[0]:
                raise IntegrityError("page 0 is marked free")
            mismatch = np.flatnonzero(bitmap != (seen > 0))
            if len(mismatch):
                raise IntegrityError(
                    f"page marks disagree with the free list at pages {sample(mismatch.tolist())}"
                )

    def free_page_ids(self) -> npt.NDArray[np.int64]:
        """Host copy of every free page id (available, released and pending), unordered."""
        host = self._host_arrays()
        return np.concatenate((host.stack_free, host.released, host.pending))

    def check_token_range(self, indices: torch.Tensor, name: str) -> None:
        """Raise unless every slot lies in `[page_size, num_rows)` (torch ops on any device:
        for callers that index their own per-slot tables with these slots)."""
        if indices.numel() and bool(
            (indices.min() < self.page_size) | (indices.max() >= self.num_rows)
        ):
            self._raise_if_outside(indices.tolist(), name)

    # ---- fused hot paths: plan + commit in one call (backends may override) ---------------

    def alloc_decode(
        self, seq_lens: torch.Tensor, last_loc: torch.Tensor | None, counters: AllocatorCounters
    ) -> torch.Tensor | None:
        """`PagedAllocator.alloc_decode`: validate, then take the pages or return None (and
        count the call in `counters` either way). Same result as `plan_decode` +
        `commit_decode`; a backend overrides it with a fused version."""
        plan = self.plan_decode(seq_lens, last_loc)
        counters.alloc_calls += 1
        if not self.can_take(plan.num_new_pages):
            counters.failed_allocs += 1
            return None
        counters.allocated_slots += plan.num_requests
        return self.commit_decode(plan)

    def free_tokens(self, indices: torch.Tensor, counters: AllocatorCounters) -> None:
        """`PagedAllocator.free`: validate, then return the pages the slots touch (now, or at
        the end of the open group) and count the call. Same effect as `plan_free_tokens` +
        `give`; a backend overrides it with a fused version."""
        plan = self.plan_free_tokens(indices)
        self.give(plan)
        counters.free_calls += 1
        counters.freed_slots += plan.num_pages * self.page_size

    # ---- error reports: called on the failure path only, so plain Python is fine ----------

    def _raise_if_outside(self, values: list[int], name: str) -> None:
        """Raise `IndexOutOfRange` / `ReservedIndex` if any slot is outside the pool or in
        page 0; return otherwise."""
        outside = [v for v in values if v < 0 or v >= self.num_rows]
        if outside:
            raise IndexOutOfRange(f"{name}: slots {sample(outside)} outside [0, {self.num_rows})")
        reserved = [v for v in values if v < self.page_size]
        if reserved:
            raise ReservedIndex(f"{name}: slots {sample(reserved)} lie in page 0 (padding target)")

    def _raise_bad_slots(self, values: list[int], name: str, *, freeing: bool) -> NoReturn:
        """Slots that failed the page check: out of range, in page 0, or in a free page
        (`DoubleFree` when `freeing`, else `NotAllocated`)."""
        self._raise_if_outside(values, name)
        size, free_pages = self.page_size, self._free_page_set()
        bad = [v for v in values if v // size in free_pages]
        assert bad, f"{name}: _raise_bad_slots called with valid slots"
        if freeing:
            raise DoubleFree(f"{name}: slots {sample(bad)} lie in pages that are already free")
        raise NotAllocated(f"{name}: slots {sample(bad)} lie in free pages")

    def _raise_bad_pages(self, values: list[int], name: str) -> NoReturn:
        outside = [v for v in values if v < 0 or v >= self.num_pages]
        if outside:
            raise IndexOutOfRange(f"{name}: pages {sample(outside)} outside [0, {self.num_pages})")
        if 0 in values:
            raise ReservedIndex(f"{name}: page 0 is the padding target and is never handed out")
        free_pages = self._free_page_set()
        bad = [v for v in values if v in free_pages]
        assert bad, f"{name}: _raise_bad_pages called with valid pages"
        raise DoubleFree(f"{name}: pages {sample(bad)} are already free")

    @staticmethod
    def _raise_duplicates(values: list[int], name: str) -> NoReturn:
        twice = sorted(v for v, n in Counter(values).items() if n > 1)
        raise DuplicateIndex(f"{name}: indices given more than once {sample(twice)}")

    def _raise_misaligned(self, slots: list[int], lengths: list[int], name: str) -> NoReturn:
        pairs = [f"{s} for length {n}" for s, n in zip(slots, lengths, strict=True)]
        raise MisalignedIndex(
            f"{name}: slot offsets in their page disagree with the lengths "
            f"(page size {self.page_size}): {sample(pairs)}"
        )

    # ---- page arithmetic and its validation (one implementation, both backends) ----------
    #
    # Written once against the operators numpy arrays and torch tensors share (`+ - < | & !=`,
    # boolean-mask indexing, `len`, `.sum()`); the backends supply only the array primitives
    # below (`_as_array`, `_any`, `_positions`, `_page_of`, `_offset_of`, `_marks_of`). The
    # arrays are typed `Any` here because the two libraries' operator stubs share no protocol.

    def plan_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor | None,
        num_tokens: int | None,
    ) -> ExtendPlan[A]:
        """Validate an extend batch (see `PagedAllocator.alloc_extend`); mutates nothing.

        Per request, with P = page_size, the new pages are `ceil(s / P) - ceil(p / P)`; a
        request whose prefix ends inside a page (`p % P != 0`) and that extends at all first
        fills that page from `last_loc + 1` (it is `partial`)."""
        p: Any = self._as_array(prefix_lens, "prefix_lens")
        s: Any = self._as_array(seq_lens, "seq_lens")
        batch = len(p)
        if len(s) != batch:
            raise InvalidRequest(f"alloc_extend: {batch} prefix_lens but {len(s)} seq_lens")
        ext = s - p
        # int64 sign bits: p | ext is negative iff p or ext is (one test, one sync on CUDA).
        if batch and self._any((p | ext) < 0):
            bad = self._positions((p < 0) | (ext < 0))
            raise InvalidRequest(f"alloc_extend: need 0 <= prefix_len <= seq_len; requests {bad}")
        total = int(ext.sum())
        if num_tokens is not None and num_tokens != total:
            raise InvalidRequest(
                f"alloc_extend: num_extend_tokens={num_tokens} but the lengths add up to {total}"
            )
        size = self.page_size
        if size == 1:
            return ExtendPlan(
                num_tokens=total,
                num_new_pages=total,
                prefix_lens=p,
                seq_lens=s,
                new_pages=None,
                partial=None,
                last_loc=None,
            )
        # The shared arithmetic is duck-typed over both backends' arrays (hence Any).
        last_page: Any = self._page_of(s + (size - 1))
        new = last_page - self._page_of(p + (size - 1))
        offset_p: Any = self._offset_of(p)
        partial = (offset_p != 0) & (ext > 0)
        loc: Any = None
        if self._any(partial):
            if last_loc is None:
                bad = self._positions(partial)
                raise InvalidRequest(
                    f"alloc_extend: last_loc is None but requests {sample(bad)} continue a "
                    "partially filled page"
                )
            loc = self._as_array(last_loc, "last_loc")
            if len(loc) != batch:
                raise InvalidRequest(f"alloc_extend: {batch} requests but {len(loc)} last_loc")
            if self.checked:
                self.check_last_loc(loc[partial], p[partial] - 1, "alloc_extend last_loc")
        return ExtendPlan(
            num_tokens=total,
            num_new_pages=int(new.sum()),
            prefix_lens=p,
            seq_lens=s,
            new_pages=new,
            partial=partial if loc is not None else None,
            last_loc=loc,
        )

    def plan_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor | None) -> DecodePlan[A]:
        """Validate a decode batch (see `PagedAllocator.alloc_decode`); mutates nothing. A
        request opens a page iff its new token (position `s - 1`) sits at offset 0."""
        s: Any = self._as_array(seq_lens, "seq_lens")
        batch = len(s)
        if batch and self._any(s < 1):
            self.raise_seq_lens()
        if self.page_size == 1:
            return DecodePlan(
                num_requests=batch, num_new_pages=batch, opens_page=None, next_slot=None
            )
        offset: Any = self._offset_of(s - 1)  # of each new token in its page
        opens = offset == 0
        num_new = int(opens.sum())
        if num_new == batch:
            return DecodePlan(
                num_requests=batch, num_new_pages=num_new, opens_page=None, next_slot=None
            )
        if last_loc is None:
            raise InvalidRequest("alloc_decode: last_loc is None but requests continue a page")
        loc: Any = self._as_array(last_loc, "last_loc")
        if len(loc) != batch:
            raise InvalidRequest(f"alloc_decode: {batch} requests but {len(loc)} last_loc")
        nxt = loc + 1
        if self.checked:
            # A continuing request's new slot last_loc + 1 must sit at the new token's offset
            # in an allocated page; that one test covers range, page 0, allocation and
            # alignment of last_loc. Openers' entries are garbage and masked out.
            marks: Any = self._marks_of(self._page_of(nxt))
            bad = (marks < 0) | (self._offset_of(nxt) != offset)
            cont = ~opens
            if self._any(bad & cont):
                self.check_last_loc(loc[cont], s[cont] - 2, "alloc_decode last_loc")
                raise AssertionError("decode check and check_last_loc disagree")
        return DecodePlan(
            num_requests=batch, num_new_pages=num_new, opens_page=opens, next_slot=nxt
        )

    def check_last_loc(self, loc: A, last_pos: A, name: str) -> None:
        """`loc[i]` must be the slot of token `last_pos[i]`: in range, in an allocated page,
        at the same offset in its page. Raises IndexOutOfRange / ReservedIndex / NotAllocated /
        MisalignedIndex; mutates nothing."""
        slots: Any = loc
        last: Any = last_pos
        marks: Any = self._marks_of(self._page_of(slots))
        if self._any(marks < 0):
            self._raise_bad_slots(slots.tolist(), name, freeing=False)
        offset: Any = self._offset_of(slots - last)
        off = offset != 0
        if self._any(off):
            self._raise_misaligned(slots[off].tolist(), (last[off] + 1).tolist(), name)

    @staticmethod
    def raise_seq_lens() -> NoReturn:
        raise InvalidRequest("alloc_decode: every seq_len counts the new token, so is >= 1")

    def plan_free_tokens(self, indices: torch.Tensor) -> FreePlan[A]:
        """Validate token slots and reduce them to the distinct pages they touch."""
        return self._plan_free_slots(self._as_array(indices, "indices"))

    def _plan_free_slots(self, slots: A) -> FreePlan[A]:
        x: Any = slots
        m = len(x)
        if m == 0:
            return FreePlan(pages=slots, num_pages=0)
        if self.page_size == 1:
            if not self.checked:
                return FreePlan(pages=slots, num_pages=m)
            if self._any(self._marks_of(slots) < 0):
                self._raise_bad_slots(x.tolist(), "free", freeing=True)
            unique: Any = self._distinct(slots)
            if len(unique) != m:
                self._raise_duplicates(x.tolist(), "free")
            return FreePlan(pages=slots, num_pages=m)
        pages: Any = self._page_of(slots)
        heads, rising = pages, True
        if m >= RUN_COLLAPSE_MIN:
            # A batch's slots of one page are adjacent: collapse runs to one entry (every
            # slot of a run lies in its head's page, so checking heads checks them all).
            starts: Any = self._run_starts(pages)
            heads = pages[starts]
            if self.checked:
                rising = not self._any(~((x[1:] > x[:-1]) | starts[1:]))
        if self.checked and self._any(self._marks_of(heads) < 0):
            self._raise_bad_slots(x.tolist(), "free", freeing=True)
        # Duplicate slots: a run of slots in one page that strictly rises holds none, so
        # slot-level stamping is needed only if a page turns up in two places.
        distinct: Any = self._distinct(heads)
        if self.checked and (len(distinct) != len(heads) or not rising):
            self._check_distinct_slots(slots)
        return FreePlan(pages=distinct, num_pages=len(distinct))

    # ---- array primitives (one implementation per backend) ------------------------------

    @abstractmethod
    def _as_array(self, value: torch.Tensor, name: str) -> A:
        """A flat int64 array of the caller's tensor on the engine's device (InvalidRequest for
        a non-integer one); a view where no conversion is needed."""

    @abstractmethod
    def _any(self, mask: M) -> bool:
        """Whether any entry of a boolean array is True."""

    @abstractmethod
    def _positions(self, mask: M) -> list[int]:
        """The positions of the True entries of a boolean array, ascending."""

    @abstractmethod
    def _page_of(self, slots: A) -> A:
        """`slots // page_size`."""

    @abstractmethod
    def _offset_of(self, slots: A) -> A:
        """`slots % page_size`."""

    @abstractmethod
    def _run_starts(self, pages: A) -> M:
        """True where a run of equal pages starts (the first entry always). Mutates nothing."""

    @abstractmethod
    def _distinct(self, pages: A) -> A:
        """One entry per distinct page (order otherwise unspecified). Stamps the marks of
        `pages` (handed-out pages only: they stay >= 0, so a later refusal has changed
        nothing; see `engine_numpy`)."""

    @abstractmethod
    def _check_distinct_slots(self, slots: A) -> None:
        """Raise `DuplicateIndex` if a slot repeats: one pass over the per-slot stamps (checked
        engines with pages of more than one slot); only those scratch stamps change."""

    @abstractmethod
    def _marks_of(self, pages: A) -> Any:
        """The marks of `pages` (clipped: a page id past the end or below 0 reads a negative
        mark), so `< 0` means out of range, page 0 or free. Any: the marks' dtype is the
        backend's own (int32 in numpy), not necessarily the engine's array type."""

    # ---- native array work (one implementation per backend) ------------------------------

    @abstractmethod
    def tokens_of_pages(self, num_pages: int) -> torch.Tensor:
        """Take `num_pages` pages and return all their slots, page by page, as a new tensor."""

    @abstractmethod
    def commit_extend(self, plan: ExtendPlan[A]) -> torch.Tensor:
        """Take the plan's pages (asserted available) and return its slots."""

    @abstractmethod
    def commit_decode(self, plan: DecodePlan[A]) -> torch.Tensor: ...

    @abstractmethod
    def plan_free_pages(self, page_ids: torch.Tensor) -> FreePlan[A]:
        """Validate page ids (distinct, in range, not page 0, allocated)."""

    @abstractmethod
    def check_allocated(self, indices: torch.Tensor, name: str) -> None:
        """Raise unless every token slot is in range, outside page 0 and in an allocated page
        (the last check only when the engine runs checked)."""

    @abstractmethod
    def pages_tensor(self, plan: FreePlan[A]) -> torch.Tensor:
        """The plan's page ids as a tensor on the device (may share memory with the plan)."""

    @abstractmethod
    def _stack_view(self, lo: int, hi: int) -> A: ...

    @abstractmethod
    def _write_stack(self, lo: int, pages: A) -> None: ...

    @abstractmethod
    def _write_released(self, lo: int, pages: A) -> None: ...

    @abstractmethod
    def _merge_released(self) -> None:
        """Sorted mode: merge the released pages into the stack, all free pages ascending."""

    @abstractmethod
    def _set_free(self, pages: A, *, free: bool) -> None:
        """Checked engines only: mark handed-out pages free, or free pages handed out."""

    @abstractmethod
    def _concat(self, parts: list[A]) -> A: ...

    @abstractmethod
    def _own(self, pages: A) -> A:
        """A copy of `pages` that shares no memory with anyone."""

    @abstractmethod
    def _reset_arrays(self) -> None:
        """Stack = 1 .. num_pages-1 in order, every page marked free."""

    @abstractmethod
    def _snapshot_arrays(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    @abstractmethod
    def _load_arrays(self, free_pages: torch.Tensor, released: torch.Tensor) -> None:
        """Write a snapshot back (and rebuild the page marks from it when checked)."""

    @abstractmethod
    def _host_arrays(self) -> HostArrays: ...

    def _free_page_set(self) -> set[int]:
        """Pages marked free (available, released or pending); for error messages."""
        return set(self.free_page_ids().tolist())
