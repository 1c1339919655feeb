"""HostPool: the host-memory mirror (L2) of one device pool, and its layouts.

A host pool mirrors exactly the buffers of its device pool's `layer_buffers()` (same order,
same per-token bytes) for `num_pages` host pages of `page_size` tokens. Host pages are numbered
0 .. num_pages-1, all usable. Indices handed to backup/load are token indices of whole, aligned
pages on both sides (what the device PagedAllocator and HostSlotAllocator return).

Layouts (bytes in `kvstrata.pool_host.layout`; B buffers, P = page_size):

    layer_first        per buffer a contiguous [host_tokens, ...]: a layer's pages are
                       contiguous, so a layer load is one copy per run; a page is B pieces.
    page_first         [host_pages, page_size_bytes] in the device pool's flat page format
                       (read_pages/write_pages): a page is one contiguous range, which L3
                       reads and writes zero-copy. Backup copies each buffer's runs into the
                       (strided) page rows.
    page_first_direct  the same bytes (the flat page format is already (pages, L, P, ...)),
                       but a backup moves whole flat pages through the device pool's
                       read_pages (see _backup_direct).

The family subclasses (mha, mla, mamba) say which buffers form one layer. SWA models build one
host pool per sub-pool (`SWAKVPool.full_pool`, `.swa_pool`): the two have different sizes and
slot spaces, so one mirror could not serve both.
"""

from __future__ import annotations

import math
import operator
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar, Generic, NamedTuple, Protocol, TypeVar

import numpy as np
import torch

from kvstrata.core.histogram import LatencyHistogram
from kvstrata.pool import KVPool
from kvstrata.pool_host.completion import Direction, LayerCompletion, LayerLoad, Transfer
from kvstrata.pool_host.copy_pages import row_copy
from kvstrata.pool_host.errors import (
    BufferSizeMismatch,
    HostPoolTooSmall,
    IndexOutOfRange,
    InvalidHostPoolSize,
    LayerIdOutOfRange,
    PageNotContiguous,
    PoolMismatch,
)
from kvstrata.pool_host.layout import HostLayout, buffer_geometry, lay_out
from kvstrata.pool_host.memory import HostTensorAllocator, PinnedHostAllocator, PlainHostAllocator
from kvstrata.pool_host.slots import HostSlotAllocator
from kvstrata.pool_host.stats import LATENCY_BOUNDS, HostPoolStats, TransferCounters
from kvstrata.pool_host.transfer import (
    CopyStrategy,
    PagePlan,
    as_page_rows,
    check_page_range,
    check_unique,
    choose_strategy,
    copy_rows,
    find_runs,
    indices_to_pages,
    integer_array,
    make_plan,
)

__all__ = ["DEFAULT_RATIO", "DevicePagePool", "HostLayout", "HostPool"]

DEFAULT_RATIO = 2.0


class DevicePagePool(Protocol):
    """What a host pool needs of a device pool (kvstrata.pool's KVPool and MambaPool)."""

    @property
    def size(self) -> int: ...
    @property
    def page_size(self) -> int: ...
    @property
    def num_rows(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    def layer_buffers(self) -> list[torch.Tensor]: ...
    def read_pages(self, page_ids: torch.Tensor, out: torch.Tensor) -> None: ...


PoolT = TypeVar("PoolT", bound=DevicePagePool)


def _check_pending(completion: LayerCompletion | None, layer_ids: Sequence[int]) -> None:
    # Only a real LayerCompletion can be asked before the copy; an object that merely has
    # mark_loaded / fail (a forwarding test double) is trusted, as it always was.
    if isinstance(completion, LayerCompletion):
        completion.check_pending(layer_ids)


#: Per layer loaded: (layer id, its buffer positions, the device pool's rows of those).
_Resolved = list[tuple[int, tuple[int, ...], list[torch.Tensor]]]


class _Executed(NamedTuple):
    num_copies: int
    event: torch.cuda.Event | None


class HostPool(ABC, Generic[PoolT]):
    """Host mirror of one device pool. Size: at most one of `size` (tokens), `ratio` (of the
    device pool's usable size) or `size_bytes` (InvalidHostPoolSize for several, a negative or
    a non-finite one); ratio 2.0 when none is given. Rounded down to whole pages;
    HostPoolTooSmall below one page, InsufficientHostMemory above what the host holds (all
    before allocating). Memory comes from `allocator`: pinned for CUDA device
    pools, plain otherwise, or e.g. SharedHostAllocator to share pages with another process.
    """

    family: ClassVar[str]

    def __init__(
        self,
        device_pool: PoolT,
        *,
        layout: HostLayout = HostLayout.page_first,
        size: int | None = None,
        ratio: float | None = None,
        size_bytes: int | None = None,
        allocator: HostTensorAllocator | None = None,
    ) -> None:
        self.device_pool = device_pool
        self.layout = HostLayout(layout)
        self.page_size = device_pool.page_size
        self.device = torch.device(device_pool.device)
        buffers = device_pool.layer_buffers()
        self.geometry = buffer_geometry(buffers, self.page_size)
        # Device buffers live as long as their pool, so their byte views are made once.
        self._device_page_rows = [as_page_rows(b, self.page_size) for b in buffers]
        self.page_size_bytes = sum(g.page_bytes for g in self.geometry)
        self.num_pages = self._size_in_pages(size, ratio, size_bytes)
        if allocator is None:
            cuda = self.device.type == "cuda"
            allocator = PinnedHostAllocator() if cuda else PlainHostAllocator()
        self.allocator = allocator
        laid_out = lay_out(self.layout, self.geometry, self.num_pages, allocator)
        self._region = laid_out.region
        self._host_rows = laid_out.rows  # per buffer, bytes [num_pages, page bytes of it]
        self._host_rows_np = [rows.numpy() for rows in self._host_rows]
        self._pages = laid_out.pages  # [num_pages, page_size_bytes]; None for layer_first
        # The same rows seen by NumPy: a page view is then one NumPy index (no torch call).
        self._pages_np = None if self._pages is None else self._pages.numpy()
        self._copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        # The compiled CPU copies of page rows (copy_pages.c), every buffer of a backup or of a
        # load's layers in one call; None: the NumPy / torch copy (transfer.py), same bytes.
        cpu = self._copy_stream is None
        self._d2h_rows = row_copy(self._device_page_rows, self._host_rows) if cpu else None
        self._h2d_rows = row_copy(self._host_rows, self._device_page_rows) if cpu else None
        self._stats_lock = threading.Lock()
        self._calls: dict[Direction, int] = {"d2h": 0, "h2d": 0}
        self._pages_moved: dict[Direction, int] = {"d2h": 0, "h2d": 0}
        self._bytes: dict[Direction, int] = {"d2h": 0, "h2d": 0}
        self._latency: dict[Direction, LatencyHistogram] = {
            "d2h": LatencyHistogram(LATENCY_BOUNDS),
            "h2d": LatencyHistogram(LATENCY_BOUNDS),
        }
        # CUDA copies whose end event has not been seen firing yet: (direction, begin, end).
        self._pending: list[tuple[Direction, torch.cuda.Event, torch.cuda.Event]] = []

    # --- family hooks ----------------------------------------------------------------------------

    @property
    @abstractmethod
    def layer_ids(self) -> range:
        """Layer ids accepted by load (the device pool's convention)."""

    @abstractmethod
    def layer_buffer_ids(self, layer_id: int) -> tuple[int, ...]:
        """Positions in layer_buffers() of the buffers of layer_id; LayerIdOutOfRange else."""

    def _local_layer(self, layer_id: int) -> int:
        """Position of `layer_id` in `layer_ids` (0 for the first held layer, whatever the
        pipeline stage's start_layer); LayerIdOutOfRange for a layer not held."""
        ids = self.layer_ids
        if isinstance(layer_id, bool) or not isinstance(layer_id, int) or layer_id not in ids:
            raise LayerIdOutOfRange(f"layer {layer_id!r} not in {ids}")
        return layer_id - ids.start

    # --- sizes -----------------------------------------------------------------------------------

    @property
    def size(self) -> int:
        """Capacity in tokens."""
        return self.num_pages * self.page_size

    @property
    def bytes_per_token(self) -> int:
        return self.page_size_bytes // self.page_size

    @property
    def size_bytes(self) -> int:
        """Bytes of host memory the pool holds."""
        return self._region.num_bytes

    @property
    def shared_name(self) -> str | None:
        """Name of the shared-memory region (SharedHostAllocator), for `attach_shared`."""
        return self._region.shared_name

    def make_allocator(self) -> HostSlotAllocator:
        """A fresh HostSlotAllocator over this pool's pages (all free)."""
        return HostSlotAllocator(num_pages=self.num_pages, page_size=self.page_size)

    # --- transfers -------------------------------------------------------------------------------

    def backup(
        self, device_pool: PoolT, device_indices: torch.Tensor, host_indices: torch.Tensor
    ) -> Transfer:
        """Copy all layers of the given device pages into the given host pages (D2H).

        Mutates only the host pages named. Indices: whole aligned pages, same length; device
        page 0 and repeated host pages are refused; every check runs before any byte moves.
        On CUDA the copies run on the pool's copy stream after the work already queued on the
        current stream; call `.wait()` on the result before reading the host pages on the host.
        """
        device_rows = self._device_rows(device_pool, range(len(self.geometry)))
        plan = self.plan_d2h(device_indices, host_indices)
        return self._backup_rows(device_pool, device_rows, plan)

    def backup_planned(self, device_pool: PoolT, plan: PagePlan) -> Transfer:
        """`backup` of a plan the caller vouches for (the trusted path of the tier controller,
        whose pages come from its own allocators): device page `plan.src_pages[k]` to host page
        `plan.dst_pages[k]`. Only the device pool's identity is checked (PoolMismatch); the
        pages are taken as `plan_d2h` would have returned them: int64, in range, no device page
        0, no host page twice. A plan from `plan_d2h` is always such a plan."""
        device_rows = self._device_rows(device_pool, range(len(self.geometry)))
        return self._backup_rows(device_pool, device_rows, plan)

    def _backup_rows(
        self, device_pool: PoolT, device_rows: list[torch.Tensor], plan: PagePlan
    ) -> Transfer:
        strategy = choose_strategy(
            plan, self.page_size_bytes // len(self.geometry), cuda=self._cuda
        )
        if strategy is not CopyStrategy.empty and self.layout is HostLayout.page_first_direct:
            strategy = CopyStrategy.direct

        compiled = self._d2h_rows if strategy is CopyStrategy.gather else None

        def body() -> int:
            if strategy is CopyStrategy.direct:
                return self._backup_direct(device_pool, plan)
            # Every buffer's rows in one C call; one it refuses (a page id out of range,
            # nothing copied) takes the NumPy path, which raises as it always did.
            if compiled is not None and compiled(plan.src_pages, plan.dst_pages):
                return 1
            cache: dict[str, torch.Tensor] = {}
            return sum(
                copy_rows(src, self._host_rows[i], plan, strategy, index_cache=cache)
                for i, src in enumerate(device_rows)
            )

        done = self._execute("d2h", plan.num_pages, plan.num_pages * self.page_size_bytes, body)
        return Transfer(
            direction="d2h",
            num_pages=plan.num_pages,
            num_bytes=plan.num_pages * self.page_size_bytes,
            num_copies=done.num_copies,
            strategy=strategy,
            event=done.event,
        )

    def load(
        self,
        device_pool: PoolT,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        layer_id: int,
        *,
        completion: LayerCompletion | None = None,
    ) -> LayerLoad:
        """Copy one layer of the given host pages into the given device pages (H2D), then mark
        `completion` (if given) for that layer.

        Mutates only layer `layer_id` of the device pages named. Repeated device pages and
        device page 0 are refused, and so is a `completion` that does not expect this layer
        (LayerIdOutOfRange, LayerAlreadyLoaded); every check runs before any byte moves. On
        CUDA the copies are enqueued on the copy stream; consumers wait through
        `completion.wait(layer_id)`.
        """
        buffer_ids = self.layer_buffer_ids(layer_id)
        device_rows = self._device_rows(device_pool, buffer_ids)
        plan = self.plan_h2d(host_indices, device_indices)
        _check_pending(completion, (layer_id,))
        return self._load_planned(device_rows, buffer_ids, plan, layer_id, completion)

    def load_layers(
        self,
        device_pool: PoolT,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        *,
        completion: LayerCompletion | None = None,
        layer_ids: Sequence[int] | None = None,
    ) -> list[LayerLoad]:
        """`load` every layer (default: all, in order), validating the indices, the layers
        and `completion` once, before the first copy. If a layer's copy raises,
        `completion.fail(error)` wakes its waiters before re-raising."""
        order = list(self.layer_ids if layer_ids is None else layer_ids)
        resolved = self._resolve_layers(device_pool, order)
        plan = self.plan_h2d(host_indices, device_indices)
        _check_pending(completion, order)
        return self._load_resolved(resolved, plan, completion)

    def load_layers_planned(
        self,
        device_pool: PoolT,
        plan: PagePlan,
        *,
        completion: LayerCompletion | None = None,
        layer_ids: Sequence[int] | None = None,
    ) -> list[LayerLoad]:
        """`load_layers` of a plan the caller vouches for (the trusted path of the tier
        controller): host page `plan.src_pages[k]` to device page `plan.dst_pages[k]`. The
        device pool, the layers and `completion` are checked as `load_layers` checks them; the
        pages are taken as `plan_h2d` would have returned them (int64, in range, no device page
        0, no device page twice). A plan from `plan_h2d` is always such a plan."""
        order = list(self.layer_ids if layer_ids is None else layer_ids)
        resolved = self._resolve_layers(device_pool, order)
        _check_pending(completion, order)
        return self._load_resolved(resolved, plan, completion)

    def _resolve_layers(self, device_pool: PoolT, order: list[int]) -> _Resolved:
        resolved: _Resolved = []
        for layer in order:
            buffer_ids = self.layer_buffer_ids(layer)
            resolved.append((layer, buffer_ids, self._device_rows(device_pool, buffer_ids)))
        return resolved

    def _load_resolved(
        self,
        resolved: _Resolved,
        plan: PagePlan,
        completion: LayerCompletion | None,
    ) -> list[LayerLoad]:
        copied = self._copy_compiled(resolved, plan)
        loads: list[LayerLoad] = []
        for layer_id, buffer_ids, device_rows in resolved:
            try:
                loads.append(
                    self._load_planned(device_rows, buffer_ids, plan, layer_id, completion, copied)
                )
            except BaseException as exc:
                if completion is not None:
                    completion.fail(exc)
                raise
        return loads

    def _copy_compiled(self, resolved: _Resolved, plan: PagePlan) -> float | None:
        """Every layer's rows in one copy_pages.c call when each is a gather on CPU (the widest
        decides); the seconds per layer. None, nothing copied: otherwise, or refused (a page id
        out of range: the per-layer NumPy path then raises)."""
        rows = self._h2d_rows
        if rows is None or not resolved:
            return None
        geometry = self.geometry
        widest = max(sum(geometry[i].page_bytes for i in ids) // len(ids) for _, ids, _ in resolved)
        if choose_strategy(plan, widest, cuda=False) is not CopyStrategy.gather:
            return None
        start = time.perf_counter()
        if not rows(plan.src_pages, plan.dst_pages, [i for _, ids, _ in resolved for i in ids]):
            return None
        return (time.perf_counter() - start) / len(resolved)

    # --- page I/O (L3 side) ----------------------------------------------------------------------

    def page_view(self, host_page: int) -> memoryview:
        """Writable zero-copy view of host page `host_page`: page_size_bytes in the device
        pool's flat page format. page_first layouts only (PageNotContiguous for layer_first,
        whose pages are scattered: use read_page_into / write_page_from). Valid while the pool
        lives; after a CUDA backup, wait for its Transfer before reading."""
        pages = self._contiguous_pages_np("page_view")
        return pages[self._check_host_page(host_page)].data

    def page_views(self, host_pages: Sequence[int] | torch.Tensor) -> list[memoryview]:
        """page_view of several pages (the buffers of one L3 batch_get / batch_set), checked
        together before any view is made. A tensor must hold integers (NonIntegerIndex): a
        float page id is never rounded to a page."""
        pages = self._contiguous_pages_np("page_views")
        if isinstance(host_pages, torch.Tensor):
            ids = integer_array(host_pages, what="host pages")
        else:
            ids = np.asarray(host_pages)
            if ids.dtype.kind not in "iu" or ids.ndim != 1:  # floats, objects: one by one
                return [pages[self._check_host_page(p)].data for p in host_pages]
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_pages):
            bad = next(int(p) for p in ids if not 0 <= p < self.num_pages)
            raise IndexOutOfRange(f"host page {bad} not in [0, {self.num_pages})")
        # Slices of one flat byte view of the region: a memoryview slice per page costs about
        # half a NumPy row plus its `.data` (the same bytes, format "B", 1-D, writable).
        flat = pages.data.cast("B")
        size = self.page_size_bytes
        return [flat[p * size : (p + 1) * size] for p in ids.tolist()]

    def page_offset(self, host_page: int) -> int:
        """Byte offset of a page in the pool's region (page_first layouts): with `shared_name`,
        what another process needs to find the page in its own mapping."""
        self._contiguous_pages("page_offset")
        return self._check_host_page(host_page) * self.page_size_bytes

    def read_page_into(self, host_page: int, buf: memoryview | bytearray) -> None:
        """Copy host page `host_page` (flat page format) into a writable buffer of exactly
        page_size_bytes. Works for every layout; mutates only `buf`."""
        out = np.frombuffer(buf, dtype=np.uint8)
        page = self._check_host_page(host_page)
        self._check_buffer(out)
        for g, rows in zip(self.geometry, self._host_rows_np, strict=True):
            out[g.page_offset : g.page_offset + g.page_bytes] = rows[page]

    def write_page_from(self, host_page: int, buf: memoryview | bytes | bytearray) -> None:
        """Overwrite host page `host_page` with a flat-format page of exactly page_size_bytes
        (e.g. one read from L3). Works for every layout; mutates only that host page."""
        src = np.frombuffer(buf, dtype=np.uint8)
        page = self._check_host_page(host_page)
        self._check_buffer(src)
        for g, rows in zip(self.geometry, self._host_rows_np, strict=True):
            rows[page] = src[g.page_offset : g.page_offset + g.page_bytes]

    # --- bookkeeping -----------------------------------------------------------------------------

    def stats(self) -> HostPoolStats:
        """Counters since construction (CUDA latencies are counted once their copies finish)."""
        self._harvest_timings()
        with self._stats_lock:
            counters = {
                d: TransferCounters(
                    calls=self._calls[d],
                    pages=self._pages_moved[d],
                    bytes=self._bytes[d],
                    latency=self._latency[d].snapshot(),
                )
                for d in ("d2h", "h2d")
            }
        return HostPoolStats(
            family=self.family,
            layout=str(self.layout),
            page_size=self.page_size,
            capacity_tokens=self.size,
            capacity_bytes=self.size_bytes,
            d2h=counters["d2h"],
            h2d=counters["h2d"],
        )

    def check_integrity(self) -> None:
        """Assert the layout invariants: one row per host page per buffer, page offsets tiling
        the flat page exactly, every view inside the region."""
        assert sum(g.page_bytes for g in self.geometry) == self.page_size_bytes, "page tiling"
        base = self._region.tensor.data_ptr()
        end = base + self._region.num_bytes
        assert buffer_geometry(self.device_pool.layer_buffers(), self.page_size) == self.geometry, (
            "the device pool's buffers changed shape or dtype since the mirror was built"
        )
        for g, rows in zip(self.geometry, self._host_rows, strict=True):
            assert rows.shape == (self.num_pages, g.page_bytes), "host rows shape drifted"
            last = rows.data_ptr() + (self.num_pages - 1) * rows.stride(0) + g.page_bytes
            assert base <= rows.data_ptr() and last <= end, "a host view escapes its region"

    def close(self) -> None:
        """Release the allocator's hold on the memory (a shared region loses its name).
        Views already handed out stay readable until dropped; do not transfer afterwards."""
        self._region.close()

    # --- internals -------------------------------------------------------------------------------

    @property
    def _cuda(self) -> bool:
        return self._copy_stream is not None

    def _size_in_pages(self, size: int | None, ratio: float | None, size_bytes: int | None) -> int:
        given = [x for x in (size, ratio, size_bytes) if x is not None]
        if len(given) > 1:
            raise InvalidHostPoolSize("give at most one of size, ratio and size_bytes")
        if any(not math.isfinite(x) or x < 0 for x in given):
            raise InvalidHostPoolSize(
                f"a host pool size must be finite and not negative, got {given[0]}"
            )
        if size_bytes is not None:
            num_pages = size_bytes // self.page_size_bytes
        elif size is not None:
            num_pages = size // self.page_size
        else:
            ratio = DEFAULT_RATIO if ratio is None else ratio
            num_pages = int(self.device_pool.size * ratio) // self.page_size
        if num_pages < 1:
            raise HostPoolTooSmall(
                f"the host pool would hold {num_pages} pages; one page of {self.page_size} "
                f"tokens takes {self.page_size_bytes} bytes (size={size}, ratio={ratio}, "
                f"size_bytes={size_bytes})"
            )
        return num_pages

    def _device_rows(self, device_pool: PoolT, buffer_ids: Sequence[int]) -> list[torch.Tensor]:
        # Identity, not geometry: the two sub-pools of an SWA pool can share a spec, and a
        # page of one copied into the other's mirror would be silent corruption.
        if device_pool is not self.device_pool:
            raise PoolMismatch(
                f"this {type(self).__name__} mirrors another device pool "
                f"({type(self.device_pool).__name__} at {id(self.device_pool):#x}); build one "
                "host pool per device pool (SWA: one per sub-pool)"
            )
        return [self._device_page_rows[i] for i in buffer_ids]

    def _device_num_pages(self) -> int:
        return self.device_pool.num_rows // self.page_size

    def plan_d2h(self, device_indices: torch.Tensor, host_indices: torch.Tensor) -> PagePlan:
        """The validated page plan of `backup(device_pool, device_indices, host_indices)`:
        NonIntegerIndex, IndexLengthMismatch, MisalignedIndex, IndexOutOfRange, ReservedIndex
        (device page 0) or DuplicateIndex (a host page twice) otherwise."""
        return self._checked_plan(("device", device_indices), ("host", host_indices))

    def plan_h2d(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> PagePlan:
        """The validated page plan of `load(device_pool, host_indices, device_indices, ...)`:
        raises as `plan_d2h` (a device page twice is the DuplicateIndex)."""
        return self._checked_plan(("host", host_indices), ("device", device_indices))

    def _checked_plan(
        self, src: tuple[str, torch.Tensor], dst: tuple[str, torch.Tensor]
    ) -> PagePlan:
        """Pages of (side, token indices), range-checked, the destination's for repeats."""
        pages = [indices_to_pages(t, self.page_size, side=side) for side, t in (src, dst)]
        plan = make_plan(*pages)
        for (side, _), ids in zip((src, dst), pages, strict=True):
            device = side == "device"
            num = self._device_num_pages() if device else self.num_pages
            check_page_range(ids, num_pages=num, reserve_page_zero=device, side=side)
        check_unique(pages[1], side=dst[0])
        return plan

    def _load_planned(
        self,
        device_rows: list[torch.Tensor],
        buffer_ids: tuple[int, ...],
        plan: PagePlan,
        layer_id: int,
        completion: LayerCompletion | None,
        copied: float | None = None,
    ) -> LayerLoad:
        """One layer, then marked; `copied`: the seconds `_copy_compiled` copied it in."""
        layer_page_bytes = sum(self.geometry[i].page_bytes for i in buffer_ids)
        num_bytes = plan.num_pages * layer_page_bytes
        if copied is not None:
            strategy, done = CopyStrategy.gather, _Executed(1, None)
            self._count("h2d", plan.num_pages, num_bytes, copied)
        else:
            strategy = choose_strategy(plan, layer_page_bytes // len(buffer_ids), cuda=self._cuda)

            def body() -> int:
                cache: dict[str, torch.Tensor] = {}
                return sum(
                    copy_rows(self._host_rows[i], dst, plan, strategy, index_cache=cache)
                    for i, dst in zip(buffer_ids, device_rows, strict=True)
                )

            done = self._execute("h2d", plan.num_pages, num_bytes, body)
        if completion is not None:
            completion.mark_loaded(layer_id, done.event)
        return LayerLoad(
            direction="h2d",
            num_pages=plan.num_pages,
            num_bytes=num_bytes,
            num_copies=done.num_copies,
            strategy=strategy,
            event=done.event,
            layer_id=layer_id,
        )

    def _backup_direct(self, device_pool: PoolT, plan: PagePlan) -> int:
        # Whole flat pages come from the device pool's own read_pages, so the host bytes are
        # the flat page format by construction; device pages may be scattered (read_pages
        # gathers them), host pages are grouped into runs.
        pages = self._pages
        assert pages is not None, "direct backup needs a page_first region"
        host_runs = find_runs(plan.dst_pages, plan.dst_pages)
        long_runs = (
            choose_strategy(
                make_plan(plan.dst_pages, plan.dst_pages), self.page_size_bytes, cuda=self._cuda
            )
            is CopyStrategy.runs
        )
        src_ids = torch.from_numpy(plan.src_pages).to(self.device)
        if long_runs and not self._cuda:
            k = 0
            for start, n in zip(host_runs.dst_starts, host_runs.lengths, strict=True):
                device_pool.read_pages(src_ids[k : k + n], pages[start : start + n])
                k += n
            return len(host_runs.lengths)
        # Gather on the device into one staging block, then move it to the host: on CUDA one
        # async D2H per host run into pinned memory; with short host runs, one scatter.
        staged = torch.empty(
            (plan.num_pages, self.page_size_bytes), dtype=torch.uint8, device=self.device
        )
        device_pool.read_pages(src_ids, staged)
        if long_runs:
            k = 0
            for start, n in zip(host_runs.dst_starts, host_runs.lengths, strict=True):
                pages[start : start + n].copy_(staged[k : k + n], non_blocking=True)
                k += n
            return 1 + len(host_runs.lengths)
        # NumPy's fancy assignment copies whole rows; torch's CPU index_copy_ walks bytes.
        host_staged = staged.cpu() if self._cuda else staged
        pages.numpy()[plan.dst_pages] = host_staged.numpy()
        return 3 if self._cuda else 2

    def _execute(
        self, direction: Direction, num_pages: int, num_bytes: int, body: Callable[[], int]
    ) -> _Executed:
        self._harvest_timings()
        if self._copy_stream is None:
            start = time.perf_counter()
            copies = body()
            self._count(direction, num_pages, num_bytes, time.perf_counter() - start)
            return _Executed(copies, None)
        stream = self._copy_stream
        # Copies must see everything the compute stream queued before (the KV a backup
        # reads, the last readers of the slots a load overwrites).
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            begin = torch.cuda.Event(enable_timing=True)
            event = torch.cuda.Event(enable_timing=True)
            begin.record(stream)
            copies = body()
            event.record(stream)
        with self._stats_lock:
            self._pending.append((direction, begin, event))
        self._count(direction, num_pages, num_bytes, None)
        return _Executed(copies, event)

    def _count(
        self, direction: Direction, num_pages: int, num_bytes: int, seconds: float | None
    ) -> None:
        """Count one copy call of `seconds` (None: a CUDA copy, timed once its event fired)."""
        if seconds is not None:
            self._latency[direction].observe(seconds)
        with self._stats_lock:
            self._calls[direction] += 1
            self._pages_moved[direction] += num_pages
            self._bytes[direction] += num_bytes

    def _harvest_timings(self) -> None:
        # CUDA latencies are known only once the end event has fired; collect those that have.
        if not self._pending:
            return
        with self._stats_lock:
            finished, pending = [], []
            for entry in self._pending:
                (finished if entry[2].query() else pending).append(entry)
            self._pending = pending
        for direction, begin, end in finished:
            self._latency[direction].observe(begin.elapsed_time(end) / 1e3)

    def _contiguous_pages_np(self, what: str) -> np.ndarray:
        if self._pages_np is None:
            self._contiguous_pages(what)  # raises PageNotContiguous
        assert self._pages_np is not None
        return self._pages_np

    def _contiguous_pages(self, what: str) -> torch.Tensor:
        if self._pages is None:
            raise PageNotContiguous(
                f"{what} needs a page_first layout; in layer_first a page is split across "
                f"{len(self.geometry)} buffers: use read_page_into / write_page_from"
            )
        return self._pages

    def _check_host_page(self, host_page: int) -> int:
        """`host_page` as a Python int in [0, num_pages); IndexOutOfRange otherwise (a float
        is refused, never truncated; NumPy and 0-d tensor integers are accepted)."""
        try:
            page = operator.index(host_page)
        except TypeError:
            raise IndexOutOfRange(f"a host page is an integer, got {host_page!r}") from None
        if not 0 <= page < self.num_pages:
            raise IndexOutOfRange(f"host page {page} not in [0, {self.num_pages})")
        return page

    def _check_buffer(self, buf: np.ndarray) -> None:
        if buf.size != self.page_size_bytes:
            raise BufferSizeMismatch(
                f"a page is {self.page_size_bytes} bytes, the buffer holds {buf.size}"
            )


KVPoolT = TypeVar("KVPoolT", bound=KVPool)


class KVHostPool(HostPool[KVPoolT]):
    """Host mirror of an attention KV pool (MHA, MLA): it takes the layer ids the device pool
    holds (global ids, from the pipeline stage's `start_layer`)."""

    @property
    def layer_ids(self) -> range:
        return self.device_pool.layer_ids
