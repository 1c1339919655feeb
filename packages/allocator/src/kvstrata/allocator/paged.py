"""`PagedAllocator`: token slots handed out in whole pages, with batch extend and decode; its
base `PageSlotAllocator`: the same pages without the per-request calls (extend, decode).

A request's tokens fill its pages in order, so a request whose length is not a multiple of the
page size owns a partially filled last page. Extending it writes into that page first:

```
 page size 4, prefix 6 tokens, extend 7 (seq_len 13), last_loc = slot of token 5 = 4*X + 1
 prefix pages:  [ X: t0 t1 t2 t3 ] [ X': t4 t5 .. .. ]   (X' is the last prefix page)
 new slots:                                 ^  ^  last_loc + 1, last_loc + 2
                then whole new pages  [ Y: t8 .. t11 ]  then one partial page  [ Z: t12 ]
 out = [4X'+2, 4X'+3, 4Y, 4Y+1, 4Y+2, 4Y+3, 4Z]
```
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypedDict

import torch

from kvstrata.allocator.base import AllocatorState, PoolUsage, SlotAllocator
from kvstrata.allocator.engine import (
    Backend,
    DecodePlan,
    ExtendPlan,
    FreePlan,
    PageEngine,
)
from kvstrata.allocator.engine_numpy import NumpyPageEngine
from kvstrata.allocator.engine_torch import TorchPageEngine
from kvstrata.allocator.errors import InvalidRequest

__all__ = ["PageSlotAllocator", "PagedAllocator", "PagedOptions", "PagedState"]


#: An engine of either backend. Its native array type (numpy or torch) is the engine's own
#: business: plans only travel from an engine's plan_* back to the same engine's commit_*.
Engine = PageEngine[Any, Any]


@dataclass(frozen=True, kw_only=True)
class PagedState(AllocatorState):
    """A paged allocator's free list at `backup_state()` time (copies, on its device)."""

    free_pages: torch.Tensor
    released_pages: torch.Tensor


class PagedOptions(TypedDict, total=False):
    """The keyword options of `PageSlotAllocator` besides the sizes, for the families built on
    it (defaults and meaning: `PageSlotAllocator`)."""

    device: str | torch.device
    sorted_reuse: bool
    checked: bool
    backend: Backend | None


def make_engine(
    *,
    num_pages: int,
    page_size: int,
    device: torch.device,
    sorted_reuse: bool,
    checked: bool,
    backend: Backend | None,
) -> Engine:
    """numpy on CPU, torch elsewhere, unless `backend` says otherwise (torch runs anywhere;
    numpy only on CPU)."""
    chosen = backend or ("numpy" if device.type == "cpu" else "torch")
    if chosen == "numpy":
        if device.type != "cpu":
            raise InvalidRequest(f"backend 'numpy' keeps its arrays on the CPU, not {device}")
    elif chosen != "torch":
        raise InvalidRequest(f"backend must be 'numpy', 'torch' or None, not {backend!r}")
    engine = NumpyPageEngine if chosen == "numpy" else TorchPageEngine
    return engine(
        num_pages=num_pages,
        page_size=page_size,
        device=device,
        sorted_reuse=sorted_reuse,
        checked=checked,
    )


class PageSlotAllocator(SlotAllocator):
    """Slots in pages of `page_size`; page 0 is never handed out. `alloc`, `free`,
    `free_pages`, `check_allocated` and the state calls, without the per-request calls of
    `PagedAllocator` (`MambaSlotAllocator`'s state slots are this, with page size 1).

    `checked=True` (the default) keeps a mark per page (free or handed out) and validates every
    index a caller hands back (range, page 0, duplicates, double free, `last_loc` alignment).
    `checked=False` skips both the marks and the checks; bad input then corrupts the free list
    silently. `kvstrata bench alloc` measures what the checks cost.

    `sorted_reuse=True` hands pages out in ascending order (see `kvstrata.allocator.engine`).
    `backend` picks the array library (None: numpy on CPU, torch elsewhere).
    """

    def __init__(
        self,
        *,
        size: int,
        page_size: int,
        device: str | torch.device = "cpu",
        sorted_reuse: bool = False,
        checked: bool = True,
        backend: Backend | None = None,
    ) -> None:
        if page_size < 1:
            raise InvalidRequest(f"page_size must be >= 1, not {page_size}")
        if size < 0 or size % page_size:
            raise InvalidRequest(f"size {size} must be a non-negative multiple of {page_size}")
        super().__init__(size=size, page_size=page_size, device=device)
        self._engine: Engine = make_engine(
            num_pages=size // page_size + 1,
            page_size=page_size,
            device=self._device,
            sorted_reuse=sorted_reuse,
            checked=checked,
            backend=backend,
        )

    # ---- description ----------------------------------------------------------------------

    @property
    def num_pages(self) -> int:
        """Pages including page 0; usable page ids are 1 .. num_pages-1."""
        return self._engine.num_pages

    @property
    def checked(self) -> bool:
        return self._engine.checked

    @property
    def sorted_reuse(self) -> bool:
        return self._engine.sorted_reuse

    @property
    def backend(self) -> Backend:
        return "numpy" if isinstance(self._engine, NumpyPageEngine) else "torch"

    def usage(self) -> list[PoolUsage]:
        return [PoolUsage("kv", self._size, self.available_size())]

    def available_size(self) -> int:
        return self._engine.num_free_pages * self._page_size

    # ---- allocation -----------------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` slots in whole pages, page by page (slots of one page consecutive).
        See `SlotAllocator.alloc`. Cost: one slice of the free stack plus the expansion."""
        num_pages = self._pages_for(need_size)
        if not self._engine.can_take(num_pages):
            return self._fail()
        self._counters.alloc_calls += 1
        self._counters.allocated_slots += need_size
        return self._engine.tokens_of_pages(num_pages)

    # ---- queries --------------------------------------------------------------------------

    def check_allocated(self, indices: torch.Tensor, name: str = "indices") -> None:
        """Raise unless every slot in `indices` lies in a page handed out now, changing
        nothing: `IndexOutOfRange` outside the pool, `ReservedIndex` in page 0 and, when
        checked, `NotAllocated` in a free page (an unchecked allocator keeps no page marks,
        so it checks the range only). `name` starts the message. Cost: O(len(indices))."""
        self._engine.check_allocated(indices, name)

    # ---- free -----------------------------------------------------------------------------

    def free(self, indices: torch.Tensor) -> None:
        """Free every page that a slot in `indices` lies in (a page is freed once however
        many of its slots are listed, and whether or not all of them are). See
        `SlotAllocator.free`. Cost: O(len(indices)) array ops (no sort)."""
        self._engine.free_tokens(indices, self._counters)

    def free_pages(self, page_ids: torch.Tensor) -> None:
        """Free whole pages by page id (distinct, 1 .. num_pages-1, allocated). Raises as
        `free`."""
        self._commit_free(self._engine.plan_free_pages(page_ids))

    def _commit_free(self, plan: FreePlan[Any]) -> None:
        self._engine.give(plan)
        self._counters.free_calls += 1
        self._counters.freed_slots += plan.num_pages * self._page_size

    def free_group_begin(self) -> None:
        self._engine.group_begin()

    def free_group_end(self) -> None:
        self._engine.group_end()

    # ---- state ----------------------------------------------------------------------------

    def backup_state(self) -> PagedState:
        free_pages, released = self._engine.snapshot()
        return PagedState(owner=self._owner, free_pages=free_pages, released_pages=released)

    def restore_state(self, state: AllocatorState) -> None:
        own = self._own_state(state, PagedState)
        self._engine.restore(own.free_pages, own.released_pages)

    def clear(self) -> None:
        self._engine.clear()

    def check_integrity(self) -> None:
        self._engine.check_integrity()


class PagedAllocator(PageSlotAllocator):
    """A `PageSlotAllocator` of the KV tokens of requests: `alloc_extend` / `alloc_decode` lay
    a batch's new tokens into the requests' pages (the picture at the top of this module).
    Takes the options of `PageSlotAllocator`."""

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor | None,
        num_extend_tokens: int | None = None,
    ) -> torch.Tensor | None:
        """Slots for tokens `prefix_lens[i] .. seq_lens[i]-1` of each request, concatenated in
        request order, or None (nothing changed) when the free pages do not suffice.

        Each request first fills the rest of its last prefix page (`last_loc[i] + 1, ...`),
        then takes whole new pages, the last of which may stay partially filled.
        `last_loc[i]` is the slot of request i's last prefix token; it is read only when that
        page is partial (`prefix_lens[i] % page_size != 0`) and the request extends, so other
        entries are ignored (SGLang passes -1 for an empty prefix; that works). `last_loc=None`
        is allowed when no request continues a partial page. `num_extend_tokens`, when given,
        must equal `sum(seq_lens - prefix_lens)`.

        All three tensors are 1-D of the batch length, any integer dtype, any device.
        Mutates: the free list (one pop of all new pages). Cost: O(batch + new pages) array ops
        plus one O(tokens) expansion; no Python loop per request.
        Raises `InvalidRequest` for inconsistent lengths and, when checked, `IndexOutOfRange`,
        `ReservedIndex`, `MisalignedIndex` or `NotAllocated` for a bad `last_loc`.
        """
        plan = self._engine.plan_extend(prefix_lens, seq_lens, last_loc, num_extend_tokens)
        if not self._engine.can_take(plan.num_new_pages):
            return self._fail()
        return self._commit_extend(plan)

    def alloc_decode(
        self, seq_lens: torch.Tensor, last_loc: torch.Tensor | None
    ) -> torch.Tensor | None:
        """One slot per request for its token number `seq_lens[i] - 1` (seq_lens counts the new
        token), or None (nothing changed) when pages run out.

        A request whose new token starts a page (`(seq_lens[i] - 1) % page_size == 0`) gets a
        new page; every other request gets `last_loc[i] + 1`, so `last_loc` is read only for
        those (and may be None when there are none). Mutates: the free list. Raises as
        `alloc_extend`.
        """
        return self._engine.alloc_decode(seq_lens, last_loc, self._counters)

    def _commit_extend(self, plan: ExtendPlan[Any]) -> torch.Tensor:
        self._counters.alloc_calls += 1
        self._counters.allocated_slots += plan.num_tokens
        return self._engine.commit_extend(plan)

    def _commit_decode(self, plan: DecodePlan[Any]) -> torch.Tensor:
        self._counters.alloc_calls += 1
        self._counters.allocated_slots += plan.num_requests
        return self._engine.commit_decode(plan)
