"""`PageEngine` on numpy arrays: the CPU backend.

Why numpy on CPU: with one torch thread on the 2-core benchmark machine a small numpy call
costs ~1-2 us against ~3-5 us for torch, and numpy's gathers and scatters of 16k int64 run
2-5x faster than torch's CPU advanced indexing. Tensors cross the boundary without copies
(`Tensor.numpy()` in, `torch.from_numpy` out). Each call below is written to spend as few
numpy calls as possible: they, not the bytes, are the cost at these sizes. The decode round
(`alloc_decode`, and `free_tokens` of a decode batch's output) goes further: straight-line
code with every temporary in a preallocated `Scratch` and the output cut from an `OutputSlab`
(see `scratch.py`), because there each call typically runs with cold caches (3-10 us a call,
tens of us for the first `malloc`).

One int32 array, `_marks`, does two jobs:

```
 _marks[page]:  FREE (-1)   page is on the free list (or released, or pending in a group)
                >= 0        page is handed out (the value is scratch, see below)
 _marks[0]         = RESERVED (-2)  the padding page
 _marks[num_pages] = BEYOND (-3)    sentinel: `take(mode="clip")` maps every page id past the
                                    end (and a negative one, via page 0) onto a negative mark
```
so one clipped gather plus one count validates range, page 0 and allocation at once. The
scratch values of handed-out pages serve as stamps for duplicate detection: write
`marks[p] = 0 .. k-1`, read back; position i survived iff `marks[p[i]] == i`, so all survive iff
the pages are distinct, and the survivors are one position per distinct page. O(k), no sort,
and the pages stay ">= 0" (handed out) throughout, so a check that raises has changed nothing.
Unchecked engines keep no FREE marks and use `_marks` only as stamps.
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.allocator.base import AllocatorCounters
from kvstrata.allocator.engine import (
    BEYOND,
    FREE,
    RESERVED,
    RUN_COLLAPSE_MIN,
    DecodePlan,
    ExtendPlan,
    FreePlan,
    HostArrays,
    PageEngine,
    as_index_tensor,
)
from kvstrata.allocator.errors import IntegrityError, InvalidRequest
from kvstrata.allocator.native import FALLBACK, NativeDecode, native_decode
from kvstrata.allocator.scratch import OutputSlab, Scratch
from kvstrata.pool.base import is_plain_index

__all__ = ["NumpyPageEngine"]

Ints = npt.NDArray[np.int64]
Bools = npt.NDArray[np.bool_]


_INT64 = np.dtype(np.int64)


def _native(value: torch.Tensor, name: str) -> Ints:
    """A flat int64 numpy view of the caller's tensor (a copy only if it must convert).

    The common case (a 1-D int64 CPU tensor) costs one torch call: `numpy()` itself, whose
    result is checked with numpy's cheap attribute reads. It raises for a CUDA tensor, one that
    requires grad or one with a lazy conjugate/negation bit; those take the converting path.
    """
    if type(value) is torch.Tensor:
        try:
            view = value.numpy()
        except (TypeError, RuntimeError):
            pass
        else:
            if view.dtype is _INT64 and view.ndim == 1:
                return view
    return as_index_tensor(value, name).to(device="cpu", dtype=torch.int64).numpy()


class NumpyPageEngine(PageEngine[Ints, Bools]):
    """Page engine whose free list, marks and arithmetic are numpy arrays in host memory."""

    def _allocate(self) -> None:
        num_pages, page_size, checked = self.num_pages, self.page_size, self.checked
        self._stack: Ints = np.arange(1, num_pages, dtype=np.int64)
        self._released: Ints = np.empty(self.capacity if self.sorted_reuse else 0, dtype=np.int64)
        self._marks = np.zeros(num_pages + 1, dtype=np.int32)
        self._reset_marks()
        # Power-of-two pages (the usual case): shifts and masks instead of // and %, which
        # numpy runs 2-3x slower on int64.
        self._shift = page_size.bit_length() - 1 if page_size & (page_size - 1) == 0 else None
        self._token_stamp: npt.NDArray[np.int32] | None = None
        if checked and page_size > 1:
            # np.zeros maps lazily zeroed memory: untouched stamp pages cost nothing.
            self._token_stamp = np.zeros(self.num_rows, dtype=np.int32)
        self._offsets: Ints = np.arange(page_size, dtype=np.int64)
        self._i32 = np.arange(4096, dtype=np.int32)
        self._i64: Ints = np.arange(4096, dtype=np.int64)
        self._scratch = Scratch()
        self._outputs = OutputSlab()
        # The compiled decode round (None without a C compiler): it works on these arrays in
        # place, so their addresses are fixed for the engine's life (nothing rebinds them).
        self._native = native_decode() if self._shift else None
        self._stack_address = self._stack.ctypes.data
        self._marks_address = self._marks.ctypes.data
        # page_size - 1 plus the sign bit (power-of-two pages only; see alloc_decode).
        self._signed_mask = np.int64((page_size - 1) - (1 << 63))

    def _reset_marks(self) -> None:
        marks = self._marks
        marks.fill(FREE if self.checked else 0)
        marks[0], marks[self.num_pages] = RESERVED, BEYOND

    # ---- array primitives of the shared page arithmetic (PageEngine.plan_extend, ...) ------

    def _as_array(self, value: torch.Tensor, name: str) -> Ints:
        return _native(value, name)

    def _any(self, mask: Bools) -> bool:
        return bool(np.count_nonzero(mask))

    def _positions(self, mask: Bools) -> list[int]:
        return np.flatnonzero(mask).tolist()

    def _marks_of(self, pages: Ints) -> npt.NDArray[np.int32]:
        return self._marks.take(pages, mode="clip")

    def _page_of(self, slots: Ints) -> Ints:
        return slots >> self._shift if self._shift is not None else slots // self.page_size

    def _offset_of(self, slots: Ints) -> Ints:
        size = self.page_size
        return slots & (size - 1) if self._shift is not None else slots % size

    def _iota32(self, n: int) -> npt.NDArray[np.int32]:
        if len(self._i32) < n:
            self._i32 = np.arange(max(n, 2 * len(self._i32)), dtype=np.int32)
        return self._i32[:n]

    def _iota64(self, n: int) -> Ints:
        if len(self._i64) < n:
            self._i64 = np.arange(max(n, 2 * len(self._i64)), dtype=np.int64)
        return self._i64[:n]

    # ---- allocation -----------------------------------------------------------------------

    def tokens_of_pages(self, num_pages: int) -> torch.Tensor:
        pages = self.take_pages(num_pages)
        if self.page_size == 1:
            out = self._outputs.take(num_pages)
            out[:] = pages
            return torch.from_numpy(out)
        return torch.from_numpy((pages[:, None] * self.page_size + self._offsets).reshape(-1))

    def commit_extend(self, plan: ExtendPlan[Ints]) -> torch.Tensor:
        # Output = segments in request order; a segment is a run of consecutive slots:
        #   request i: [rest of its last prefix page] [new page] .. [last new page, maybe partial]
        # Each segment is (base slot, count); out = repeat(base - first_out_pos, count) + iota.
        pages = self.take_pages(plan.num_new_pages)
        new = plan.new_pages
        if new is None:
            return torch.from_numpy(pages.copy())
        total = plan.num_tokens
        if total == 0:
            return torch.from_numpy(np.empty(0, dtype=np.int64))
        size, s = self.page_size, plan.seq_lens
        per_req = new if plan.partial is None else new + plan.partial
        seg_end = np.cumsum(per_req)
        counts = np.full(int(seg_end[-1]), size, dtype=np.int64)
        if plan.partial is None or plan.last_loc is None:
            base = pages * size
        else:
            part, p = plan.partial, plan.prefix_lens
            first = (seg_end - per_req)[part]
            is_part = np.zeros(len(counts), dtype=np.bool_)
            is_part[first] = True
            base = np.empty(len(counts), dtype=np.int64)
            base[~is_part] = pages * size
            base[first] = plan.last_loc[part] + 1
            counts[first] = np.minimum(s[part] - p[part], size - self._offset_of(p[part]))
        has_new = new > 0
        counts[seg_end[has_new] - 1] = self._offset_of(s[has_new] - 1) + 1
        out = np.repeat(base - (np.cumsum(counts) - counts), counts)
        out += self._iota64(total)
        return torch.from_numpy(out)

    def commit_decode(self, plan: DecodePlan[Ints]) -> torch.Tensor:
        pages = self.take_pages(plan.num_new_pages)
        if plan.opens_page is None or plan.next_slot is None:
            return torch.from_numpy(pages * self.page_size)
        out = plan.next_slot  # the plan's own array: this commit is its only use
        out[plan.opens_page] = pages * self.page_size
        return torch.from_numpy(out)

    def alloc_decode(
        self, seq_lens: torch.Tensor, last_loc: torch.Tensor | None, counters: AllocatorCounters
    ) -> torch.Tensor | None:
        """`plan_decode` + `commit_decode` fused for power-of-two pages (other sizes take the
        plan): straight-line code, every temporary in `Scratch`, about 17 numpy calls, two
        `numpy()` views and one `from_numpy` per round, nothing allocated (the output is cut
        from an `OutputSlab`).

        Why so spare: in a serving loop (and in `kvstrata bench alloc`) this call follows
        work that evicts the caches, and each numpy call, Python call and `malloc` then costs
        3-10 us instead of ~1. Same results and errors as the plan path (a failing check
        re-runs the full checks for the message) and, as there, nothing changes before a
        check passes.
        """
        shift = self._shift
        if not shift:  # page size 1 (shift 0) or not a power of two
            return super().alloc_decode(seq_lens, last_loc, counters)
        if self._native is not None:
            done = self._compiled_decode(self._native, seq_lens, last_loc, counters)
            if done is not None:
                return done
        s = _native(seq_lens, "seq_lens")
        n = len(s)
        sc = self._scratch
        if sc.n != n:
            sc.fit(n)
        a, off, opens = sc.a, sc.b, sc.opens
        np.subtract(s, 1, out=a)  # position of each new token
        # Its offset in its page with the sign bit kept: a negative position (seq_len < 1)
        # gets a negative "offset", so it never opens a page and always fails the alignment
        # test below (unchecked: the sign test here). No reduction needed for that check.
        np.bitwise_and(a, self._signed_mask, out=off)
        np.equal(off, 0, out=opens)
        num_new = int(np.count_nonzero(opens))
        out: Ints | None = None
        if num_new < n:
            if last_loc is None:
                raise InvalidRequest("alloc_decode: last_loc is None but requests continue a page")
            loc = _native(last_loc, "last_loc")
            if len(loc) != n:
                raise InvalidRequest(f"alloc_decode: {n} requests but {len(loc)} last_loc")
            # The caller's array (openers' entries are overwritten below), from the slab.
            out = np.add(loc, 1, out=self._outputs.take(n))
            marks = self._marks
            if self.checked:
                # A continuing request's new slot last_loc + 1 must sit at the new token's
                # offset in an allocated page: one test for range, page 0, allocation and
                # alignment of last_loc. Openers' entries are garbage and masked out.
                np.right_shift(out, shift, out=a)
                bad = np.less(marks.take(a, mode="clip", out=sc.m32), 0, out=sc.bad)
                np.bitwise_and(out, self.page_size - 1, out=a)
                np.logical_or(bad, np.not_equal(a, off, out=sc.mis), out=bad)
                np.greater(bad, opens, out=bad)  # bad and not an opener
                if np.count_nonzero(bad):
                    self._raise_decode(s, loc, opens)
            elif np.count_nonzero(np.less(off, 0, out=sc.bad)):
                self.raise_seq_lens()
        counters.alloc_calls += 1
        head = self._head
        if num_new > self.capacity - head:  # short on the stack: maybe released pages help
            if num_new > self.num_free_pages:
                counters.failed_allocs += 1
                return None
            pages = self.take_pages(num_new)
        else:  # take_pages(), inlined
            pages = self._stack[head : head + num_new]
            self._head = head + num_new
            if self.checked:
                self._marks[pages] = 0
        counters.allocated_slots += n
        if out is None:
            return torch.from_numpy(np.left_shift(pages, shift, out=self._outputs.take(n)))
        if num_new:
            out[opens] = np.left_shift(pages, shift, out=a[:num_new])
        return torch.from_numpy(out)

    def _compiled_decode(
        self,
        native: NativeDecode,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor | None,
        counters: AllocatorCounters,
    ) -> torch.Tensor | None:
        """The decode round in one C call (`decode.c`) for plain inputs (1-D contiguous int64
        CPU tensors); None, with nothing changed, when the inputs or the round need the NumPy
        path (a check fails, the stack runs short): it then raises or copes as it always did."""
        if not is_plain_index(seq_lens) or (last_loc is not None and not is_plain_index(last_loc)):
            return None
        n = seq_lens.shape[0]
        if last_loc is not None and last_loc.shape[0] != n:
            return None
        out, address = self._outputs.take_with_address(n)
        taken = native.alloc_decode(
            seq_lens.data_ptr(),
            None if last_loc is None else last_loc.data_ptr(),
            n,
            self._shift,
            self._marks_address if self.checked else None,
            self.num_pages,
            self._stack_address,
            self._head,
            self.capacity,
            address,
        )
        if taken == FALLBACK:
            return None
        self._head += taken
        counters.alloc_calls += 1
        counters.allocated_slots += n
        return torch.from_numpy(out)

    def _compiled_free(
        self, native: NativeDecode, indices: torch.Tensor, counters: AllocatorCounters
    ) -> bool:
        """A free in one C call (`decode.c`): each page's slots in one strictly rising run
        (one slot per page, or whole pages), plain input, no free group, no sorted reuse.
        False, with nothing changed, when the NumPy path must run (a check fails, a page
        repeats apart, the input or the state is not the plain case)."""
        if self._pending is not None or self.sorted_reuse or not is_plain_index(indices):
            return False
        m = indices.shape[0]
        if m < 2:
            return False
        head = native.free_slots(
            indices.data_ptr(),
            m,
            self._shift,
            self._marks_address,
            self.num_pages,
            self.checked,
            self._stack_address,
            self._head,
        )
        if head == FALLBACK:
            return False
        counters.free_calls += 1
        counters.freed_slots += (self._head - head) * self.page_size
        self._head = head
        return True

    def _raise_decode(self, s: Ints, loc: Ints, opens: Bools) -> NoReturn:
        """The fused decode check failed: raise what the plan path raises."""
        if np.count_nonzero(s < 1):
            self.raise_seq_lens()
        cont = ~opens
        self.check_last_loc(loc[cont], s[cont] - 2, "alloc_decode last_loc")
        raise AssertionError("decode check and check_last_loc disagree")

    # ---- free -----------------------------------------------------------------------------

    def free_tokens(self, indices: torch.Tensor, counters: AllocatorCounters) -> None:
        """`plan_free_tokens` + `give` fused for small frees at power-of-two pages (a decode
        batch's output: one slot per page): straight-line code, every temporary in `Scratch`,
        about 9 numpy calls and one `numpy()`. Same checks, errors and effect, all checks
        before any change; other frees take the plan (with run collapsing when large)."""
        native = self._native
        if native is not None and self._compiled_free(native, indices, counters):
            return
        x = _native(indices, "indices")
        m = len(x)
        shift = self._shift
        if not shift or m < 2 or m >= RUN_COLLAPSE_MIN:
            plan = self._plan_free_slots(x)
            self.give(plan)
            counters.free_calls += 1
            counters.freed_slots += plan.num_pages * self.page_size
            return
        sc = self._scratch
        if sc.n != m:
            sc.fit(m)
        pages = np.right_shift(x, shift, out=sc.a)
        marks, checked = self._marks, self.checked
        if checked and np.count_nonzero(
            np.less(marks.take(pages, mode="clip", out=sc.m32), 0, out=sc.bad)
        ):
            self._raise_bad_slots(x.tolist(), "free", freeing=True)
        # Stamps (see the module docstring): marks[pages[i]] = i, read back.
        iota = self._iota32(m)
        marks[pages] = iota
        lost = np.not_equal(marks.take(pages, mode="clip", out=sc.m32), iota, out=sc.bad)
        if np.count_nonzero(lost):  # a page twice: keep one of each; slots may repeat
            pages = pages[~lost]
            if checked:
                self._check_distinct_slots(x)
        num_pages = len(pages)
        if self._pending is None and not self.sorted_reuse:
            # give(), inlined.
            if checked:
                marks[pages] = FREE
            head = self._head - num_pages
            assert head >= 0, "free stack overflow: a page was freed twice unseen"
            self._stack[head : self._head] = pages
            self._head = head
        else:
            self.give(FreePlan(pages=pages, num_pages=num_pages))  # copies what it keeps
        counters.free_calls += 1
        counters.freed_slots += num_pages * self.page_size

    def _run_starts(self, pages: Ints) -> Bools:
        starts = np.empty(len(pages), dtype=np.bool_)
        starts[0] = True
        np.not_equal(pages[1:], pages[:-1], out=starts[1:])
        return starts

    def _check_distinct_slots(self, slots: Ints) -> None:
        assert self._token_stamp is not None, "slot stamps exist on checked paged engines"
        iota = self._iota32(len(slots))
        self._token_stamp[slots] = iota
        if np.count_nonzero(self._token_stamp[slots] != iota):
            self._raise_duplicates(slots.tolist(), "free")

    def _distinct(self, pages: Ints) -> Ints:
        k = len(pages)
        if k < 2:
            return pages
        iota = self._iota32(k)
        marks = self._marks
        marks[pages] = iota
        keep = marks[pages] == iota
        return pages if np.count_nonzero(keep) == k else pages[keep]

    def plan_free_pages(self, page_ids: torch.Tensor) -> FreePlan[Ints]:
        q = _native(page_ids, "page_ids")
        m = len(q)
        if m and self.checked:
            if np.count_nonzero(self._marks.take(q, mode="clip") < 0):
                self._raise_bad_pages(q.tolist(), "free_pages")
            if len(self._distinct(q)) != m:
                self._raise_duplicates(q.tolist(), "free_pages")
        return FreePlan(pages=q, num_pages=m)

    def check_allocated(self, indices: torch.Tensor, name: str) -> None:
        native = self._native
        if (
            native is not None
            and is_plain_index(indices)
            and native.check_slots(
                indices.data_ptr(),
                indices.shape[0],
                self._shift,
                self._marks_address,
                self.num_pages,
                self.checked,
            )
            == 0
        ):
            return  # one C call; on any fault the NumPy path below raises the specific error
        x = _native(indices, "indices")
        if len(x) == 0:
            return
        if self.checked:
            if np.count_nonzero(self._marks.take(self._page_of(x), mode="clip") < 0):
                self._raise_bad_slots(x.tolist(), name, freeing=False)
        elif np.count_nonzero((x < self.page_size) | (x >= self.num_rows)):
            self._raise_if_outside(x.tolist(), name)

    def pages_tensor(self, plan: FreePlan[Ints]) -> torch.Tensor:
        return torch.from_numpy(plan.pages)

    # ---- stack primitives -----------------------------------------------------------------

    def _stack_view(self, lo: int, hi: int) -> Ints:
        return self._stack[lo:hi]

    def _write_stack(self, lo: int, pages: Ints) -> None:
        self._stack[lo : lo + len(pages)] = pages

    def _write_released(self, lo: int, pages: Ints) -> None:
        self._released[lo : lo + len(pages)] = pages

    def _merge_released(self) -> None:
        live = np.concatenate((self._stack[self._head :], self._released[: self._num_released]))
        live.sort()
        head = self._merged_head(len(live))
        self._stack[head:] = live
        self._head = head
        self._num_released = 0

    def _set_free(self, pages: Ints, *, free: bool) -> None:
        self._marks[pages] = FREE if free else 0

    def _concat(self, parts: list[Ints]) -> Ints:
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _own(self, pages: Ints) -> Ints:
        return pages.copy()

    def _reset_arrays(self) -> None:
        self._stack[:] = np.arange(1, self.num_pages, dtype=np.int64)
        self._reset_marks()

    def _snapshot_arrays(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            torch.from_numpy(self._stack[self._head :].copy()),
            torch.from_numpy(self._released[: self._num_released].copy()),
        )

    def _load_arrays(self, free_pages: torch.Tensor, released: torch.Tensor) -> None:
        f, r = _native(free_pages, "free_pages"), _native(released, "released")
        self._stack[self.capacity - len(f) :] = f
        self._released[: len(r)] = r
        if self.checked:
            marks = self._marks
            marks.fill(0)
            marks[0], marks[self.num_pages] = RESERVED, BEYOND
            marks[f] = FREE
            marks[r] = FREE

    def check_integrity(self) -> None:
        super().check_integrity()
        if self._marks[0] != RESERVED or self._marks[self.num_pages] != BEYOND:
            raise IntegrityError("the sentinel marks of page 0 / past the end were overwritten")

    def _host_arrays(self) -> HostArrays:
        pending = self._pending or []
        marks = self._marks
        return HostArrays(
            stack_free=self._stack[self._head :].copy(),
            released=self._released[: self._num_released].copy(),
            pending=np.concatenate(pending) if pending else np.empty(0, dtype=np.int64),
            free_bitmap=(marks[: self.num_pages] == FREE) if self.checked else None,
        )
