"""Page plans and the copies between a device buffer and its host mirror.

Every buffer of a pool, on either side, is seen here as a 2-D byte matrix with one row per page:

    device buffer b  [num_rows, ...] dtype   ->  bytes [device_pages, page_size * token_bytes(b)]
    host mirror      (any layout)            ->  bytes [host_pages,   page_size * token_bytes(b)]

(rows of a page_first host view are strided: one page of every buffer sits between them.)
Copying bytes, not typed elements, makes every dtype (fp8 stored as uint8 included) bit-exact.

A transfer maps page src[k] to page dst[k]. Its plan groups the pairs into runs, maximal
stretches where both sides advance by one page:

    src  7 8 9 | 3 | 12 13      -> runs (7->40, 3 pages), (3->43, 1), (12->44, 2)
    dst 40 41 42 | 43 | 44 45      detected with one np.diff, no Python loop over pages

Strategy per buffer: one copy per run when runs are long, else a gather + scatter: on CPU
index_select straight into each destination run when those are long, else index_select into a
staging block and a NumPy scatter; with CUDA, index_select / index_copy_ on rows widened to
int64 on the GPU side and one copy of the selected rows across the bus.
Measured on the 2-core CPU box (single thread, 128 MiB of shuffled pages): a copy_ call costs
~9 us of overhead; torch's index_copy_ of uint8 rows moves ~0.15 GB/s while its index_select
and NumPy's fancy assignment move whole rows near memcpy speed. Gather vs one copy per run,
backup GB/s: 16 KiB rows 1.95 vs 1.38, 64 KiB 5.5 vs 4.4, 256 KiB 5.3 vs 6.7; so runs are
used from 128 KiB. On CUDA each run is a cudaMemcpyAsync (~5-10 us) against 20+ GB/s of
bandwidth, so runs pay from ~256 KiB (an estimate: not measured on a GPU here).
"""

from __future__ import annotations

from enum import StrEnum
from typing import NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.pool_host.errors import (
    DuplicateIndex,
    IndexLengthMismatch,
    IndexOutOfRange,
    MisalignedIndex,
    NonIntegerIndex,
    ReservedIndex,
)

PageArray = npt.NDArray[np.int64]

#: Mean bytes per run from which one copy per run beats gather + scatter (see module doc).
CPU_RUN_MIN_BYTES = 128 << 10
CUDA_RUN_MIN_BYTES = 256 << 10


class CopyStrategy(StrEnum):
    """How a transfer moved its bytes (reported on the Transfer handle)."""

    runs = "runs"  # one copy per (buffer, run)
    gather = "gather"  # one gather + one scatter per buffer
    direct = "direct"  # whole flat pages through the device pool's read_pages
    empty = "empty"  # nothing to copy


class Runs(NamedTuple):
    """Runs of a page plan: run r copies `lengths[r]` pages from src_starts[r] to dst_starts[r]."""

    src_starts: list[int]
    dst_starts: list[int]
    lengths: list[int]


class PagePlan:
    """Validated page pairs of one transfer, their joint runs, and the runs of each side
    alone: `dst_runs` has positions k into the pair arrays as its src_starts, `src_runs`
    has them as its dst_starts. The runs are found on first use: a small transfer (a gather
    whatever its runs) never needs them."""

    __slots__ = ("_dst_runs", "_runs", "_src_runs", "dst_pages", "src_pages")

    def __init__(self, src_pages: PageArray, dst_pages: PageArray) -> None:
        self.src_pages = src_pages
        self.dst_pages = dst_pages
        self._runs: Runs | None = None
        self._src_runs: Runs | None = None
        self._dst_runs: Runs | None = None

    @property
    def num_pages(self) -> int:
        return int(self.src_pages.size)

    @property
    def runs(self) -> Runs:
        if self._runs is None:
            self._runs = find_runs(self.src_pages, self.dst_pages)
        return self._runs

    @property
    def src_runs(self) -> Runs:
        if self._src_runs is None:
            self._src_runs = find_runs(self.src_pages, np.arange(self.src_pages.size))
        return self._src_runs

    @property
    def dst_runs(self) -> Runs:
        if self._dst_runs is None:
            self._dst_runs = find_runs(np.arange(self.dst_pages.size), self.dst_pages)
        return self._dst_runs


def integer_array(indices: object, *, what: str) -> PageArray:
    """`indices` (an integer tensor of any dtype and shape, on any device) flattened into a
    host int64 array: a copy to the host when it lives on a device, else possibly a view of the
    caller's memory (never mutate it). NonIntegerIndex for a float, complex or bool tensor."""
    if not isinstance(indices, torch.Tensor):
        raise NonIntegerIndex(f"{what} must be a torch.Tensor, got {type(indices).__name__}")
    dtype = indices.dtype
    if dtype == torch.int64 and indices.dim() == 1 and indices.device.type == "cpu":
        return indices.numpy()  # what the allocators hand out: a view, no torch op
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise NonIntegerIndex(f"{what} must have an integer dtype, got {dtype}")
    return indices.detach().reshape(-1).to("cpu", torch.int64).numpy()


def aligned_pages(flat: PageArray, page_size: int) -> PageArray | None:
    """Page ids of `flat` when every group of `page_size` indices is one whole page in order
    (p*P, p*P+1, ..., p*P+P-1), else None. `flat.size` must be a multiple of `page_size`.
    A handful of array calls whatever the length (no per-page Python)."""
    if page_size == 1:
        return flat
    rows = flat.reshape(-1, page_size)
    firsts = rows[:, 0]
    if (firsts % page_size).any():
        return None
    if not (rows == firsts[:, None] + _offsets(page_size)).all():
        return None
    return firsts // page_size


_OFFSETS: dict[int, PageArray] = {}


def _offsets(page_size: int) -> PageArray:
    """0 .. page_size-1 (cached per page size; never mutated)."""
    offsets = _OFFSETS.get(page_size)
    if offsets is None:
        offsets = _OFFSETS.setdefault(page_size, np.arange(page_size, dtype=np.int64))
    return offsets


def pages_to_token_array(pages: PageArray, page_size: int) -> PageArray:
    """Token indices of whole pages, in page order (a new array)."""
    return (pages[:, None] * page_size + _offsets(page_size)).reshape(-1)


def first_misaligned_page(flat: PageArray, page_size: int) -> int | None:
    """Position of the first group of `page_size` indices that is not one whole page in order
    (p*P, p*P+1, ..., p*P+P-1), or None when every group is. `flat.size` must be a multiple
    of `page_size`."""
    rows = flat.reshape(-1, page_size)
    firsts = rows[:, 0]
    bad = (firsts % page_size != 0) | (rows - firsts[:, None] != np.arange(page_size)).any(1)
    return int(np.flatnonzero(bad)[0]) if bad.any() else None


def indices_to_pages(indices: torch.Tensor, page_size: int, *, side: str) -> PageArray:
    """Page ids of token indices forming whole, aligned pages in order; NonIntegerIndex,
    MisalignedIndex or IndexLengthMismatch otherwise. Any integer dtype, on any device (copied
    to the host)."""
    flat = integer_array(indices, what=f"{side} indices")
    if flat.size % page_size:
        raise IndexLengthMismatch(
            f"{flat.size} {side} indices are not a whole number of pages of {page_size}"
        )
    pages = aligned_pages(flat, page_size)
    if pages is not None:
        return pages
    bad = first_misaligned_page(flat, page_size)
    if bad is not None:
        raise MisalignedIndex(
            f"{side} indices {flat[bad * page_size : (bad + 1) * page_size].tolist()[:8]} do not "
            f"form one aligned page of {page_size} slots (page p must be p*{page_size} .. "
            f"p*{page_size}+{page_size - 1})"
        )
    return flat[::page_size] // page_size


def vouched_pages(indices: torch.Tensor, page_size: int) -> PageArray:
    """Page ids of token indices the caller vouches are whole aligned pages in order (what
    `indices_to_pages` accepts): the first index of each page over `page_size`, with no check
    (the trusted path of callers whose indices come from their own allocators). A copy to the
    host when `indices` lives on a device."""
    flat = indices.numpy() if indices.device.type == "cpu" else indices.cpu().numpy()
    if flat.dtype != np.int64:
        flat = flat.astype(np.int64)
    return flat if page_size == 1 else flat[::page_size] // page_size


def check_page_range(
    pages: PageArray, *, num_pages: int, reserve_page_zero: bool, side: str
) -> None:
    """IndexOutOfRange / ReservedIndex unless every page is a usable page of its pool."""
    if pages.size == 0:
        return
    lo, hi = int(pages.min()), int(pages.max())
    if lo < 0 or hi >= num_pages:
        raise IndexOutOfRange(
            f"{side} pages must lie in [0, {num_pages}), got pages in [{lo}, {hi}]"
        )
    if reserve_page_zero and lo == 0:
        raise ReservedIndex(f"{side} page 0 is the dummy page of padded tokens; it never moves")


def check_unique(pages: PageArray, *, side: str) -> None:
    """DuplicateIndex when a destination page appears twice."""
    # Ascending pages (what the allocators hand out) are distinct without a sort.
    if pages.size < 2 or (pages[1:] > pages[:-1]).all():
        return
    # A sort and one comparison: np.unique costs several times more on a few hundred pages.
    ordered = np.sort(pages)
    if bool((ordered[1:] == ordered[:-1]).any()):
        raise DuplicateIndex(f"a {side} page appears twice as a copy destination")


def find_runs(src: PageArray, dst: PageArray) -> Runs:
    """Maximal runs where src and dst both advance by one page (vectorised)."""
    n = src.size
    if n == 0:
        return Runs([], [], [])
    starts = np.empty(n, dtype=np.bool_)
    starts[0] = True
    np.not_equal(src[1:] - src[:-1], 1, out=starts[1:])
    starts[1:] |= dst[1:] - dst[:-1] != 1
    first = np.flatnonzero(starts)
    bounds = np.append(first, n)
    return Runs(src[first].tolist(), dst[first].tolist(), (bounds[1:] - bounds[:-1]).tolist())


def make_plan(src: PageArray, dst: PageArray) -> PagePlan:
    if src.size != dst.size:
        raise IndexLengthMismatch(
            f"source and destination hold {src.size} and {dst.size} pages; they must match"
        )
    return PagePlan(src, dst)


def as_page_rows(buffer: torch.Tensor, page_size: int) -> torch.Tensor:
    """A contiguous device buffer [num_rows, ...] as bytes [num_rows // page_size, page bytes]."""
    assert buffer.is_contiguous(), "device pool buffers must be contiguous (one row per slot)"
    assert buffer.shape[0] % page_size == 0, "num_rows must be a whole number of pages"
    return buffer.view(buffer.shape[0], -1).view(torch.uint8).view(buffer.shape[0] // page_size, -1)


def widen(rows: torch.Tensor) -> torch.Tensor:
    """The same bytes viewed with the widest element (int64/int32/int16) that the row length,
    row stride and offset allow: index_select moves elements, so wider is several times faster."""
    assert rows.dtype == torch.uint8 and rows.dim() == 2 and rows.stride(1) == 1
    for dtype, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if (
            rows.shape[1] % width == 0
            and rows.stride(0) % width == 0
            and rows.storage_offset() % width == 0
        ):
            return rows.view(dtype)
    return rows


def choose_strategy(plan: PagePlan, row_bytes: int, *, cuda: bool) -> CopyStrategy:
    if plan.num_pages == 0:
        return CopyStrategy.empty
    threshold = CUDA_RUN_MIN_BYTES if cuda else CPU_RUN_MIN_BYTES
    if plan.num_pages * row_bytes < threshold:
        return CopyStrategy.gather  # no run can average the threshold: skip finding them
    mean_run_bytes = plan.num_pages * row_bytes / len(plan.runs.lengths)
    return CopyStrategy.runs if mean_run_bytes >= threshold else CopyStrategy.gather


def copy_rows(
    src: torch.Tensor,
    dst: torch.Tensor,
    plan: PagePlan,
    strategy: CopyStrategy,
    *,
    index_cache: dict[str, torch.Tensor],
) -> int:
    """Copy page rows src[plan.src_pages[k]] -> dst[plan.dst_pages[k]]; returns the number of
    copy calls issued. Across devices the copies are non-blocking (async from/to pinned host
    memory on the current stream). `index_cache` keeps the index tensors per device between
    the buffers of one transfer, so they are built once."""
    if strategy is CopyStrategy.empty:
        return 0
    non_blocking = src.device.type == "cuda" or dst.device.type == "cuda"
    if strategy is CopyStrategy.runs:
        for s, d, n in zip(*plan.runs, strict=True):
            dst[d : d + n].copy_(src[s : s + n], non_blocking=non_blocking)
        return len(plan.runs.lengths)
    assert strategy is CopyStrategy.gather, f"copy_rows cannot run strategy {strategy}"
    if src.device.type == "cpu" and dst.device.type == "cpu":
        return _gather_cpu(src, dst, plan, index_cache)
    # CUDA on one side: gather where the source lives, move exactly the selected rows across
    # the bus in one copy, scatter where the destination lives.
    src_idx = _index(index_cache, "src", plan.src_pages, src.device)
    gathered = widen(src).index_select(0, src_idx)
    if dst.device.type == "cuda":
        gathered = gathered.to(dst.device, non_blocking=True)  # pageable: staged by the driver
        wide_dst = widen(dst)
        rows = gathered.view(torch.uint8).view(plan.num_pages, -1).view(wide_dst.dtype)
        wide_dst.index_copy_(0, _index(index_cache, "dst", plan.dst_pages, dst.device), rows)
    else:
        # D2H into pageable memory completes before .cpu() returns, so the scatter is safe.
        rows = gathered.cpu().view(torch.uint8).view(plan.num_pages, -1)
        dst.numpy()[plan.dst_pages] = rows.numpy()
    return 3


def _gather_cpu(
    src: torch.Tensor, dst: torch.Tensor, plan: PagePlan, cache: dict[str, torch.Tensor]
) -> int:
    # torch's index_select copies whole rows (~memcpy speed, strided `out` included); its
    # index_copy_ walks elements (~0.15 GB/s on uint8), so scatters go through NumPy's fancy
    # assignment instead (a strided memcpy per row). One pass when either side is in long
    # runs (what the host allocator hands out), a staged gather + scatter otherwise.
    row_bytes = plan.num_pages * src.shape[1]
    if row_bytes < CPU_RUN_MIN_BYTES:
        # Small (no run can reach the threshold): one NumPy gather and scatter, no runs found.
        dst.numpy()[plan.dst_pages] = src.numpy()[plan.src_pages]
        return 2
    if row_bytes / len(plan.dst_runs.lengths) >= CPU_RUN_MIN_BYTES:
        src_idx = _index(cache, "src", plan.src_pages, src.device)
        for k, d, n in zip(*plan.dst_runs, strict=True):
            torch.index_select(src, 0, src_idx[k : k + n], out=dst[d : d + n])
        return len(plan.dst_runs.lengths)
    dst_np = dst.numpy()
    if row_bytes / len(plan.src_runs.lengths) >= CPU_RUN_MIN_BYTES:
        src_np = src.numpy()
        for s, k, n in zip(*plan.src_runs, strict=True):
            dst_np[plan.dst_pages[k : k + n]] = src_np[s : s + n]
        return len(plan.src_runs.lengths)
    staged = src.index_select(0, _index(cache, "src", plan.src_pages, src.device))
    dst_np[plan.dst_pages] = staged.numpy()
    return 2


def _index(
    cache: dict[str, torch.Tensor], side: str, pages: PageArray, device: torch.device
) -> torch.Tensor:
    key = f"{side}@{device}"
    cached = cache.get(key)
    if cached is None:
        cached = torch.from_numpy(pages).to(device)
        cache[key] = cached
    return cached
