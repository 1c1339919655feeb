"""`PageEngine` on torch tensors: the backend for every device other than the CPU.

Same structure, step for step, as `engine_numpy.py` (read that module's notes on the `_marks`
array and its stamps); the free list and marks live on the engine's device, so on CUDA no index
ever crosses to the host. What does cross: the number of pages a call needs (to decide between
indices and None, as SGLang's allocator also does) and, when checked, one boolean per check.
Each is a device synchronisation; `checked=False` leaves only the first.

A clipped gather is `index_select(clamp(pages, 0, num_pages))`. Gathers use `index_select` and
scatters `index_put_`/`index_fill_`: on CPU these are 2-4x faster than advanced indexing, and
they are what advanced indexing lowers to on CUDA anyway. On CPU this backend is correct but
slower than `NumpyPageEngine` (`kvstrata bench alloc` measures both).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.allocator.engine import (
    BEYOND,
    FREE,
    RESERVED,
    DecodePlan,
    ExtendPlan,
    FreePlan,
    HostArrays,
    PageEngine,
    as_index_tensor,
)
from kvstrata.allocator.errors import IntegrityError

__all__ = ["TorchPageEngine"]

I64 = torch.int64


class TorchPageEngine(PageEngine[torch.Tensor, torch.Tensor]):
    """Page engine whose free list, marks and arithmetic are tensors on `device`."""

    def _allocate(self) -> None:
        num_pages, page_size, device = self.num_pages, self.page_size, self.device
        self._stack = torch.arange(1, num_pages, dtype=I64, device=device)
        self._released = torch.empty(
            self.capacity if self.sorted_reuse else 0, dtype=I64, device=device
        )
        self._marks = torch.zeros(num_pages + 1, dtype=torch.int32, device=device)
        self._reset_marks()
        self._token_stamp: torch.Tensor | None = None
        if self.checked and page_size > 1:
            self._token_stamp = torch.zeros(self.num_rows, dtype=torch.int32, device=device)
        self._offsets = torch.arange(page_size, dtype=I64, device=device)
        self._i32 = torch.arange(4096, dtype=torch.int32, device=device)
        self._i64 = torch.arange(4096, dtype=I64, device=device)

    def _reset_marks(self) -> None:
        self._marks.fill_(FREE if self.checked else 0)
        self._marks[0] = RESERVED
        self._marks[self.num_pages] = BEYOND

    def _native(self, value: torch.Tensor, name: str) -> torch.Tensor:
        return as_index_tensor(value, name).to(device=self.device, dtype=I64)

    # ---- array primitives of the shared page arithmetic (PageEngine.plan_extend, ...) ------

    def _as_array(self, value: torch.Tensor, name: str) -> torch.Tensor:
        return self._native(value, name)

    def _any(self, mask: torch.Tensor) -> bool:
        return bool(mask.any())

    def _positions(self, mask: torch.Tensor) -> list[int]:
        return torch.nonzero(mask).reshape(-1).tolist()

    def _page_of(self, slots: torch.Tensor) -> torch.Tensor:
        return slots // self.page_size

    def _offset_of(self, slots: torch.Tensor) -> torch.Tensor:
        return slots % self.page_size

    def _marks_of(self, pages: torch.Tensor) -> torch.Tensor:
        return self._marks.index_select(0, pages.clamp(0, self.num_pages))

    def _iota32(self, n: int) -> torch.Tensor:
        if len(self._i32) < n:
            self._i32 = torch.arange(
                max(n, 2 * len(self._i32)), dtype=torch.int32, device=self.device
            )
        return self._i32[:n]

    def _iota64(self, n: int) -> torch.Tensor:
        if len(self._i64) < n:
            self._i64 = torch.arange(max(n, 2 * len(self._i64)), dtype=I64, device=self.device)
        return self._i64[:n]

    # ---- allocation -----------------------------------------------------------------------

    def tokens_of_pages(self, num_pages: int) -> torch.Tensor:
        pages = self.take_pages(num_pages)
        if self.page_size == 1:
            return pages.clone()
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)

    def commit_extend(self, plan: ExtendPlan[torch.Tensor]) -> torch.Tensor:
        # Segments as in NumpyPageEngine.commit_extend.
        pages = self.take_pages(plan.num_new_pages)
        new = plan.new_pages
        if new is None:
            return pages.clone()
        total = plan.num_tokens
        if total == 0:
            return torch.empty(0, dtype=I64, device=self.device)
        size, s = self.page_size, plan.seq_lens
        per_req = new if plan.partial is None else new + plan.partial
        seg_end = torch.cumsum(per_req, 0)
        num_segments = plan.num_new_pages + (0 if plan.partial is None else int(plan.partial.sum()))
        counts = torch.full((num_segments,), size, dtype=I64, device=self.device)
        if plan.partial is None or plan.last_loc is None:
            base = pages * size
        else:
            part, p = plan.partial, plan.prefix_lens
            first = (seg_end - per_req)[part]
            is_part = torch.zeros(num_segments, dtype=torch.bool, device=self.device)
            is_part[first] = True
            base = torch.empty(num_segments, dtype=I64, device=self.device)
            base[~is_part] = pages * size
            base[first] = plan.last_loc[part] + 1
            counts[first] = torch.minimum(s[part] - p[part], size - p[part] % size)
        has_new = new > 0
        counts[seg_end[has_new] - 1] = (s[has_new] - 1) % size + 1
        out = torch.repeat_interleave(
            base - (torch.cumsum(counts, 0) - counts), counts, output_size=total
        )
        out += self._iota64(total)
        return out

    def commit_decode(self, plan: DecodePlan[torch.Tensor]) -> torch.Tensor:
        pages = self.take_pages(plan.num_new_pages)
        if plan.opens_page is None or plan.next_slot is None:
            return pages * self.page_size
        out = plan.next_slot
        out[plan.opens_page] = pages * self.page_size
        return out

    # ---- free -----------------------------------------------------------------------------

    def _run_starts(self, pages: torch.Tensor) -> torch.Tensor:
        starts = torch.empty(len(pages), dtype=torch.bool, device=self.device)
        starts[0] = True
        torch.ne(pages[1:], pages[:-1], out=starts[1:])
        return starts

    def _check_distinct_slots(self, slots: torch.Tensor) -> None:
        assert self._token_stamp is not None, "slot stamps exist on checked paged engines"
        iota = self._iota32(len(slots))
        self._token_stamp.index_put_((slots,), iota)
        if bool((self._token_stamp.index_select(0, slots) != iota).any()):
            self._raise_duplicates(slots.tolist(), "free")

    def _distinct(self, pages: torch.Tensor) -> torch.Tensor:
        k = len(pages)
        if k < 2:
            return pages
        iota = self._iota32(k)
        self._marks.index_put_((pages,), iota)
        keep = self._marks.index_select(0, pages) == iota
        return pages if bool(keep.all()) else pages[keep]

    def plan_free_pages(self, page_ids: torch.Tensor) -> FreePlan[torch.Tensor]:
        q = self._native(page_ids, "page_ids")
        m = len(q)
        if m and self.checked:
            if bool((self._marks_of(q) < 0).any()):
                self._raise_bad_pages(q.tolist(), "free_pages")
            if len(self._distinct(q)) != m:
                self._raise_duplicates(q.tolist(), "free_pages")
        return FreePlan(pages=q, num_pages=m)

    def check_allocated(self, indices: torch.Tensor, name: str) -> None:
        x = self._native(indices, "indices")
        if len(x) == 0:
            return
        if self.checked:
            if bool((self._marks_of(x // self.page_size) < 0).any()):
                self._raise_bad_slots(x.tolist(), name, freeing=False)
        else:
            self.check_token_range(x, name)

    def pages_tensor(self, plan: FreePlan[torch.Tensor]) -> torch.Tensor:
        return plan.pages

    # ---- stack primitives -----------------------------------------------------------------

    def _stack_view(self, lo: int, hi: int) -> torch.Tensor:
        return self._stack[lo:hi]

    def _write_stack(self, lo: int, pages: torch.Tensor) -> None:
        self._stack[lo : lo + len(pages)] = pages

    def _write_released(self, lo: int, pages: torch.Tensor) -> None:
        self._released[lo : lo + len(pages)] = pages

    def _merge_released(self) -> None:
        live = torch.cat((self._stack[self._head :], self._released[: self._num_released]))
        live = torch.sort(live).values
        head = self._merged_head(len(live))
        self._stack[head:] = live
        self._head = head
        self._num_released = 0

    def _set_free(self, pages: torch.Tensor, *, free: bool) -> None:
        self._marks.index_fill_(0, pages, FREE if free else 0)

    def _concat(self, parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _own(self, pages: torch.Tensor) -> torch.Tensor:
        return pages.clone()

    def _reset_arrays(self) -> None:
        self._stack.copy_(torch.arange(1, self.num_pages, dtype=I64, device=self.device))
        self._reset_marks()

    def _snapshot_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self._stack[self._head :].clone(),
            self._released[: self._num_released].clone(),
        )

    def _load_arrays(self, free_pages: torch.Tensor, released: torch.Tensor) -> None:
        f = self._native(free_pages, "free_pages")
        r = self._native(released, "released")
        self._stack[self.capacity - len(f) :] = f
        self._released[: len(r)] = r
        if self.checked:
            self._marks.fill_(0)
            self._marks[0] = RESERVED
            self._marks[self.num_pages] = BEYOND
            self._marks.index_fill_(0, f, FREE)
            self._marks.index_fill_(0, r, FREE)

    def check_integrity(self) -> None:
        super().check_integrity()
        if int(self._marks[0]) != RESERVED or int(self._marks[self.num_pages]) != BEYOND:
            raise IntegrityError("the sentinel marks of page 0 / past the end were overwritten")

    def _host_arrays(self) -> HostArrays:
        pending = self._pending or []

        def host(t: torch.Tensor) -> npt.NDArray[np.int64]:
            return t.detach().to(device="cpu", dtype=I64).numpy().copy()

        marks = host(self._marks[: self.num_pages])
        return HostArrays(
            stack_free=host(self._stack[self._head :]),
            released=host(self._released[: self._num_released]),
            pending=host(torch.cat(pending)) if pending else np.empty(0, dtype=np.int64),
            free_bitmap=(marks == FREE) if self.checked else None,
        )
