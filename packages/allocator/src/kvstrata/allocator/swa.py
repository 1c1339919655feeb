"""`SWAAllocator`: full-attention and sliding-window slots allocated in step.

A hybrid model's full-attention layers keep every token; its sliding-window layers need only
the last `window` tokens, so they live in a smaller pool. Each token gets a full slot and an
SWA slot at once, and `full_to_swa[full_slot]` (int64, `[size + page_size]`, 0 = none) tells the
`SWAKVPool` where the SWA copy lives. `free_swa` releases SWA slots of tokens that slid out of
the window while their full slots stay.

Both sub-allocators see the same lengths, so a request's tokens sit at the same offset in a
full page and in its SWA page: the map is page-consistent, and freeing the SWA side of any token
of a full page frees that page's whole SWA page (and clears the page's map entries). A page is
mapped whole when it is handed out, also at the offsets its request has not reached yet:

```
 full page f:  [ f*P+0  f*P+1  ...  f*P+P-1 ]      full_to_swa[f*P+o] = s*P+o  (or 0 for all o)
 SWA page s:   [ s*P+0  s*P+1  ...  s*P+P-1 ]
```
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.allocator.base import AllocatorState, PoolUsage, SlotAllocator
from kvstrata.allocator.engine import Backend, DecodePlan, ExtendPlan, as_index_tensor, sample
from kvstrata.allocator.errors import IntegrityError, InvalidRequest, NotAllocated
from kvstrata.allocator.paged import PagedAllocator, PagedState

__all__ = ["SWAAllocator", "SWAState"]


#: An extend or a decode plan of one sub-allocator.
PlanT = TypeVar("PlanT", ExtendPlan[Any], DecodePlan[Any])


@dataclass(frozen=True, kw_only=True)
class SWAState(AllocatorState):
    """Both free lists and a copy of the full-to-SWA map."""

    full: PagedState
    swa: PagedState
    full_to_swa: torch.Tensor


class SWAAllocator(SlotAllocator):
    """Full slots (`size`) and sliding-window slots (`swa_size`) handed out together.

    Every method takes and returns FULL indices; `translate` maps them to SWA indices.
    """

    def __init__(
        self,
        *,
        size: int,
        swa_size: int,
        page_size: int,
        device: str | torch.device = "cpu",
        checked: bool = True,
        backend: Backend | None = None,
    ) -> None:
        self._full = PagedAllocator(
            size=size, page_size=page_size, device=device, checked=checked, backend=backend
        )
        self._swa = PagedAllocator(
            size=swa_size, page_size=page_size, device=device, checked=checked, backend=backend
        )
        super().__init__(size=size, page_size=page_size, device=self._full.device)
        self._map = torch.zeros(size + page_size, dtype=torch.int64, device=self.device)
        # One row per full page: clears a page's entries with one index_fill_.
        self._map_pages = self._map.view(-1, page_size)
        self._offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)

    # ---- description ----------------------------------------------------------------------

    #: Full slots, as `size`.
    full_size = SlotAllocator.size

    @property
    def swa_size(self) -> int:
        return self._swa.size

    @property
    def full_allocator(self) -> PagedAllocator:
        """The full-attention sub-allocator (read it; allocating through it breaks the map)."""
        return self._full

    @property
    def swa_allocator(self) -> PagedAllocator:
        """The sliding-window sub-allocator (read it; allocating through it breaks the map)."""
        return self._swa

    @property
    def full_to_swa(self) -> torch.Tensor:
        """The live map (updated in place, never replaced): hand it to
        `SWAKVPool.set_full_to_swa` once."""
        return self._map

    def usage(self) -> list[PoolUsage]:
        return [
            PoolUsage("full", self._full.size, self._full.available_size()),
            PoolUsage("swa", self._swa.size, self._swa.available_size()),
        ]

    def full_available_size(self) -> int:
        return self._full.available_size()

    def swa_available_size(self) -> int:
        return self._swa.available_size()

    def available_size(self) -> int:
        """Tokens that can get both slots now: the smaller of the two pools."""
        return min(self._full.available_size(), self._swa.available_size())

    # ---- allocation -----------------------------------------------------------------------

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` full slots, each with an SWA slot. See `SlotAllocator.alloc`."""
        num_pages = self._pages_for(need_size)
        if not (self._full._engine.can_take(num_pages) and self._swa._engine.can_take(num_pages)):
            return self._fail()
        full = self._full.alloc(need_size)
        swa = self._swa.alloc(need_size)
        assert full is not None and swa is not None, "can_take said both pools had room"
        return self._commit(full, swa)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor | None,
        num_extend_tokens: int | None = None,
    ) -> torch.Tensor | None:
        """As `PagedAllocator.alloc_extend`, in both pools; `last_loc` holds FULL slots.
        Raises `NotAllocated` when a request must continue a partial page whose SWA slots
        were already released by `free_swa` (its window no longer covers its own tail)."""
        full_engine, swa_engine = self._full._engine, self._swa._engine
        full_plan = full_engine.plan_extend(prefix_lens, seq_lens, last_loc, num_extend_tokens)
        swa_last = None
        if last_loc is not None and self.page_size > 1:
            prefix = as_index_tensor(prefix_lens, "prefix_lens").to(self.device)
            seq = as_index_tensor(seq_lens, "seq_lens").to(self.device)
            continues = (prefix % self.page_size != 0) & (seq > prefix)
            swa_last = self._translate_last(last_loc, continues, "alloc_extend")
        swa_plan = swa_engine.plan_extend(prefix_lens, seq_lens, swa_last, num_extend_tokens)
        return self._take_both(full_plan, swa_plan, PagedAllocator._commit_extend)

    def alloc_decode(
        self, seq_lens: torch.Tensor, last_loc: torch.Tensor | None
    ) -> torch.Tensor | None:
        """As `PagedAllocator.alloc_decode`, in both pools; `last_loc` holds FULL slots."""
        full_plan = self._full._engine.plan_decode(seq_lens, last_loc)
        swa_last = None
        if last_loc is not None and self.page_size > 1:
            seq = as_index_tensor(seq_lens, "seq_lens").to(self.device)
            continues = (seq - 1) % self.page_size != 0
            swa_last = self._translate_last(last_loc, continues, "alloc_decode")
        swa_plan = self._swa._engine.plan_decode(seq_lens, swa_last)
        return self._take_both(full_plan, swa_plan, PagedAllocator._commit_decode)

    def _take_both(
        self,
        full_plan: PlanT,
        swa_plan: PlanT,
        commit: Callable[[PagedAllocator, PlanT], torch.Tensor],
    ) -> torch.Tensor | None:
        """Commit the full pool's plan and the SWA pool's, or neither (a failed allocation,
        nothing changed) when either pool lacks the pages."""
        if not (
            self._full._engine.can_take(full_plan.num_new_pages)
            and self._swa._engine.can_take(swa_plan.num_new_pages)
        ):
            return self._fail()
        return self._commit(commit(self._full, full_plan), commit(self._swa, swa_plan))

    def _translate_last(
        self, last_loc: torch.Tensor, continues: torch.Tensor, name: str
    ) -> torch.Tensor:
        """SWA slots of the requests' last tokens. Entries of requests that do not continue
        a page are never read (and may be garbage), so they are clamped, not validated."""
        loc = as_index_tensor(last_loc, "last_loc").to(device=self.device, dtype=torch.int64)
        swa = self._map.index_select(0, loc.clamp(0, len(self._map) - 1))
        lost = continues & (swa == 0)
        if bool(lost.any()):
            raise NotAllocated(
                f"{name}: last_loc {sample(loc[lost].tolist())} continue a page whose SWA "
                "slots free_swa already released"
            )
        return swa

    def _commit(self, full: torch.Tensor, swa: torch.Tensor) -> torch.Tensor:
        # Whole pages are paired (every offset, also those not handed out yet): the pages a
        # request continues were mapped whole when first taken, so writing the rows of all
        # touched pages again rewrites equal values.
        size = self.page_size
        rows = (swa - swa % size).unsqueeze(1) + self._offsets
        self._map_pages.index_copy_(0, full // size, rows)
        self._counters.alloc_calls += 1
        self._counters.allocated_slots += len(full)
        return full

    # ---- free -----------------------------------------------------------------------------

    def free(self, indices: torch.Tensor) -> None:
        """Free the full pages `indices` touch and the SWA pages still mapped from them.
        Raises as `PagedAllocator.free` (checked against the full pool) before any change."""
        full_idx = as_index_tensor(indices, "indices").to(device=self.device, dtype=torch.int64)
        full_plan = self._full._engine.plan_free_tokens(full_idx)
        swa_idx = self._map.index_select(0, full_idx)
        swa_plan = self._swa._engine.plan_free_tokens(swa_idx[swa_idx > 0])
        self._full._commit_free(full_plan)
        self._swa._commit_free(swa_plan)
        self._map_pages.index_fill_(0, self._full._engine.pages_tensor(full_plan), 0)
        self._counters.free_calls += 1
        self._counters.freed_slots += full_plan.num_pages * self.page_size

    def check_allocated(self, indices: torch.Tensor, name: str = "indices") -> None:
        """`PagedAllocator.check_allocated` for FULL slots (against the full pool)."""
        self._full.check_allocated(indices, name)

    def free_swa(self, indices: torch.Tensor) -> None:
        """Release only the SWA pages of these FULL slots; the full slots stay allocated.
        Slots whose SWA page is already released are skipped. Raises `IndexOutOfRange` /
        `ReservedIndex` for slots outside the full pool, before any change."""
        full_idx = as_index_tensor(indices, "indices").to(device=self.device, dtype=torch.int64)
        self._full._engine.check_token_range(full_idx, "free_swa")
        swa_idx = self._map.index_select(0, full_idx)
        mapped = swa_idx > 0
        swa_plan = self._swa._engine.plan_free_tokens(swa_idx[mapped])
        self._swa._commit_free(swa_plan)
        self._map_pages.index_fill_(0, full_idx[mapped] // self.page_size, 0)

    def move_swa(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Hand the SWA pages mapped under FULL slots `src` to FULL slots `dst` (same length,
        whole pages in order, `dst` pages allocated and without SWA pages, `src` pages mapped):
        afterwards `translate(dst)` gives what `translate(src)` gave and `src` has none (its
        full slots stay). For two copies of the same tokens: the holder of `dst` keeps the KV
        the holder of `src` computed. Raises `InvalidRequest` / `NotAllocated` before any
        change."""
        size = self.page_size
        d = as_index_tensor(dst, "dst").to(device=self.device, dtype=torch.int64)
        s = as_index_tensor(src, "src").to(device=self.device, dtype=torch.int64)
        if len(d) != len(s) or len(d) % size:
            raise InvalidRequest(
                f"move_swa: {len(d)} dst and {len(s)} src slots; need equal whole pages of {size}"
            )
        if not len(d):
            return
        self._full.check_allocated(d, "dst")
        self._full.check_allocated(s, "src")
        d_rows, s_rows = d.view(-1, size), s.view(-1, size)
        for name, rows in (("dst", d_rows), ("src", s_rows)):
            if bool(((rows - rows[:, :1]) != self._offsets).any()) or bool(
                (rows[:, 0] % size).any()
            ):
                raise InvalidRequest(f"move_swa: {name} is not whole pages in order")
        d_pages, s_pages = d_rows[:, 0] // size, s_rows[:, 0] // size
        if len(torch.unique(d_pages)) != len(d_pages) or len(torch.unique(s_pages)) != len(s_pages):
            raise InvalidRequest("move_swa: a page is listed twice")
        if bool((self._map_pages[d_pages] != 0).any()):
            raise InvalidRequest("move_swa: a dst page still has SWA slots")
        if bool((self._map_pages[s_pages] == 0).any()):
            raise NotAllocated("move_swa: a src page has no SWA slots")
        rows = self._map_pages[s_pages].clone()
        self._map_pages.index_fill_(0, s_pages, 0)
        self._map_pages.index_copy_(0, d_pages, rows)

    def translate(self, indices: torch.Tensor) -> torch.Tensor:
        """SWA slots of FULL slots (0 where released), as a new tensor. Raises
        `IndexOutOfRange` / `ReservedIndex` for slots outside the full pool."""
        full_idx = as_index_tensor(indices, "indices").to(device=self.device, dtype=torch.int64)
        self._full._engine.check_token_range(full_idx, "translate")
        return self._map.index_select(0, full_idx)

    def free_group_begin(self) -> None:
        if self._full._engine.group_open:
            raise InvalidRequest("free_group_begin: a free group is already open")
        self._full.free_group_begin()
        self._swa.free_group_begin()

    def free_group_end(self) -> None:
        if not self._full._engine.group_open:
            raise InvalidRequest("free_group_end without free_group_begin")
        self._full.free_group_end()
        self._swa.free_group_end()

    # ---- state ----------------------------------------------------------------------------

    def backup_state(self) -> SWAState:
        if self._full._engine.group_open:
            raise InvalidRequest("backup_state inside a free group: end the group first")
        return SWAState(
            owner=self._owner,
            full=self._full.backup_state(),
            swa=self._swa.backup_state(),
            full_to_swa=self._map.clone(),
        )

    def restore_state(self, state: AllocatorState) -> None:
        own = self._own_state(state, SWAState)
        if self._full._engine.group_open:
            raise InvalidRequest("restore_state inside a free group: end the group first")
        self._full.restore_state(own.full)
        self._swa.restore_state(own.swa)
        self._map.copy_(own.full_to_swa)

    def clear(self) -> None:
        self._full.clear()
        self._swa.clear()
        self._map.zero_()

    def check_integrity(self) -> None:
        """Both free lists, plus the map: page 0 unmapped; every mapped slot in an allocated
        full page, pointing into an allocated SWA page at the same offset; each full page mapped
        at every offset or at none; full pages and SWA
        pages paired one to one; and no allocated SWA page left without a full page."""
        self._full.check_integrity()
        self._swa.check_integrity()
        size = self.page_size
        full_map = self._map.to("cpu").numpy()
        if full_map[:size].any():
            raise IntegrityError("page 0 of the full pool is mapped to SWA slots")
        x = np.flatnonzero(full_map)
        y = full_map[x]
        full_used = _allocated(self._full)
        swa_used = _allocated(self._swa)
        if len(x) == 0:
            if swa_used.any():
                raise IntegrityError("SWA pages allocated but nothing maps to them")
            return
        if y.min() < size or y.max() >= self._swa.num_pages * size:
            raise IntegrityError(f"map points outside the SWA pool: {sample(y.tolist())}")
        if (x % size != y % size).any():
            raise IntegrityError("a full slot maps to an SWA slot at another page offset")
        pages = full_map.reshape(-1, size)
        if not pages[pages.any(axis=1)].all():
            raise IntegrityError("a full page is partly mapped to SWA slots")
        fp, sp = x // size, y // size
        if not full_used[fp].all():
            bad = fp[~full_used[fp]].tolist()
            raise IntegrityError(f"mapped slots in free full pages {sample(bad)}")
        if not swa_used[sp].all():
            bad = sp[~swa_used[sp]].tolist()
            raise IntegrityError(f"map points into free SWA pages {sample(bad)}")
        to_swa = np.full(self._full.num_pages, -1, dtype=np.int64)
        to_swa[fp] = sp
        to_full = np.full(self._swa.num_pages, -1, dtype=np.int64)
        to_full[sp] = fp
        if (to_swa[fp] != sp).any() or (to_full[sp] != fp).any():
            raise IntegrityError("full pages and SWA pages are not paired one to one")
        unmapped = swa_used & (to_full < 0)
        if unmapped.any():
            raise IntegrityError(f"SWA pages {sample(np.flatnonzero(unmapped).tolist())} leaked")


def _allocated(allocator: PagedAllocator) -> npt.NDArray[np.bool_]:
    """Boolean per page id: handed out (page 0 counts as not)."""
    used = np.ones(allocator.num_pages, dtype=np.bool_)
    used[0] = False
    used[allocator._engine.free_page_ids()] = False
    return used
