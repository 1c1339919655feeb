"""Base classes of the device pools, and the record a layer lookup returns.

    DevicePool   slots of fixed bytes on one device, moved by whole pages (MambaPool, KVPool)
    KVPool       + attention layers: get_key_buffer / get_value_buffer / set_kv (MHA, MLA)

Slot numbering (the allocators hand out the same numbers):

    row:   0 .. P-1 | P .. 2P-1 | ... | size .. size+P-1        num_rows = size + P
    page:     0     |     1     | ... |    num_pages-1          num_pages = num_rows // P
              ^ the dummy page: padded tokens write here; never holds real data

Every buffer a pool owns is `[num_rows, ...]`, so token slot s of buffer b is `b[s]`. Buffers
live as long as the pool: views and page ids stay valid until the pool is dropped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, TypeVar

import numpy as np
import torch

from kvstrata.pool.dtypes import check_dtype, store_dtype
from kvstrata.pool.errors import (
    BufferMismatch,
    DuplicateIndex,
    IndexOutOfRange,
    InvalidArgument,
    LayerOutOfRange,
    ReservedIndex,
)
from kvstrata.pool.page_io import BufferStack, PageLayout
from kvstrata.pool.spec import MHASpec, MLASpec


@dataclass(slots=True)
class PageIOCounters:
    """Cumulative page I/O of one pool: plain integers, read by `PoolCollector` at scrape time.
    "read" is pool -> caller buffer (read_pages), "written" caller buffer -> pool."""

    pages_read: int = 0
    pages_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


PoolT = TypeVar("PoolT", bound="DevicePool")
SpecT = TypeVar("SpecT", MHASpec, MLASpec)


class LayerRoute(NamedTuple, Generic[PoolT]):
    """Where a layer lives: the pool owning it and the layer id that pool's methods take."""

    pool: PoolT
    local_layer_id: int


def resolve_device(device: torch.device | str) -> torch.device:
    """`device` with an explicit index for CUDA, so it compares equal to a tensor's device."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


#: Index dtypes torch's indexing takes as positions. Any other integer dtype is widened to int64:
#: torch reads a uint8 index tensor as a boolean *mask* (a silent wrong write) and refuses
#: int8 / int16 / unsigned ones, whose min/max it cannot even compute on every backend.
_INDEX_DTYPES = (torch.int64, torch.int32)


def check_index_tensor(ids: object, *, what: str, dims: int | None = 1) -> torch.Tensor:
    """`ids` as an index tensor of rank `dims` (any rank when None): returned unchanged when it
    is int64 or int32, else widened to int64 (same device). InvalidArgument for anything that
    is not an integer tensor of that rank."""
    if not isinstance(ids, torch.Tensor):
        raise InvalidArgument(f"{what} must be a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise InvalidArgument(f"{what} must have an integer dtype, got {ids.dtype}")
    if dims is not None and ids.dim() != dims:
        raise InvalidArgument(f"{what} must be {dims}-D, got shape {tuple(ids.shape)}")
    return ids if ids.dtype in _INDEX_DTYPES else ids.to(torch.int64)


def check_index_range(
    ids: torch.Tensor, *, limit: int, what: str, allow_zero: bool, distinct: bool = False
) -> None:
    """IndexOutOfRange unless every id is in [0, limit); ReservedIndex for 0 unless allowed;
    with `distinct`, then DuplicateIndex when an id repeats. Reads the ids' extremes: a
    device-to-host sync when they live on a GPU.

    CPU ids are checked in NumPy (a few us for a batch; torch's `aminmax` + `unique` cost
    ~100 us at 256 ids, as much as moving 3 MB of pages): with `distinct`, one sort gives the
    extremes and the duplicates together."""
    if ids.numel() == 0:
        return
    duplicate = False
    if ids.device.type == "cpu":
        values = ids.numpy().reshape(-1)
        if distinct and len(values) > 1:
            ordered = np.sort(values)
            lo, hi = int(ordered[0]), int(ordered[-1])
            duplicate = bool(np.count_nonzero(ordered[1:] == ordered[:-1]))
        else:
            lo, hi = int(values.min()), int(values.max())
    else:
        lo, hi = torch.stack(list(torch.aminmax(ids))).tolist()
        duplicate = distinct and torch.unique(ids).numel() != ids.numel()
    if lo < 0 or hi >= limit:
        raise IndexOutOfRange(f"{what} must lie in [0, {limit}); got min {lo}, max {hi}")
    if lo == 0 and not allow_zero:
        raise ReservedIndex(f"{what} includes 0, the reserved padding target")
    if duplicate:
        raise DuplicateIndex(f"{what} lists the same index more than once")


def is_plain_index(value: object) -> bool:
    """A 1-D contiguous int64 CPU tensor: what compiled code may read in place."""
    return (
        type(value) is torch.Tensor
        and value.dtype is torch.int64
        and value.is_cpu
        and value.dim() == 1
        and value.is_contiguous()
    )


def check_distinct(ids: torch.Tensor, *, what: str) -> None:
    """DuplicateIndex when an id repeats (a sort: NumPy on the CPU, torch.unique elsewhere)."""
    if ids.numel() < 2:
        return
    if ids.device.type == "cpu":
        ordered = np.sort(ids.numpy().reshape(-1))
        duplicate = bool(np.count_nonzero(ordered[1:] == ordered[:-1]))
    else:
        duplicate = torch.unique(ids).numel() != ids.numel()
    if duplicate:
        raise DuplicateIndex(f"{what} lists the same index more than once")


class DevicePool(ABC):
    """A pool of fixed-size slots on one device, moved by whole pages (all layers at once).

    Attributes: `size` (usable slots, page 0 excluded), `page_size`, `num_rows`
    (= size + page_size), `num_pages` (ids 1 .. num_pages-1 usable), `device`, `dtype` (logical)
    and `store_dtype` (uint8 for fp8), `counters` (page I/O totals).
    """

    def __init__(
        self, *, size: int, page_size: int, device: torch.device | str, dtype: torch.dtype
    ) -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise InvalidArgument(f"page_size must be a positive int, got {page_size!r}")
        if not isinstance(size, int) or size <= 0 or size % page_size:
            raise InvalidArgument(
                f"size must be a positive multiple of page_size {page_size}, got {size!r}"
            )
        self.size = size
        self.page_size = page_size
        self.num_rows = size + page_size
        self.num_pages = self.num_rows // page_size
        self.device = resolve_device(device)
        self.dtype = check_dtype(dtype)
        self.store_dtype = store_dtype(dtype)
        self.counters = PageIOCounters()
        self._layout: PageLayout | None = None
        self._page_size_bytes = 0  # set once the buffers are bound
        self._stack_spans: list[tuple[int, int]] = []

    def _bind_stacks(self, stacks: Sequence[BufferStack]) -> None:
        """Called once by the subclass after allocating its buffer stacks."""
        self._layout = PageLayout(stacks, num_rows=self.num_rows, page_size=self.page_size)
        assert self._layout.page_size_bytes == self.page_size_bytes, (
            f"buffers hold {self._layout.page_size_bytes} bytes a page, the spec says "
            f"{self.page_size_bytes}: the subclass allocated the wrong shapes"
        )
        self._page_size_bytes = self._layout.page_size_bytes
        #: [start, end) addresses of each buffer stack (for the caller-buffer overlap check).
        self._stack_spans = [
            (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
            for t in self._layout.stack_tensors()
        ]

    @property
    def _pages(self) -> PageLayout:
        assert self._layout is not None, "the subclass never called _bind_stacks"
        return self._layout

    # --- geometry ------------------------------------------------------------------------------

    @property
    @abstractmethod
    def bytes_per_token(self) -> int:
        """Bytes of one slot, all layers."""

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one flat page: bytes_per_token * page_size (kept once the buffers exist:
        every page I/O call reads it several times)."""
        known = self._page_size_bytes
        return known if known else self.bytes_per_token * self.page_size

    @property
    def size_bytes(self) -> int:
        """Bytes of device memory the buffers hold, the dummy page included."""
        return self._pages.num_bytes

    @property
    def native_page_copies(self) -> bool:
        """Whether `read_pages` / `write_pages` run the compiled copies (CPU pools on a machine
        with a C compiler, see `kvstrata.pool.native`) rather than NumPy / torch."""
        return self._pages.native

    def layer_buffers(self) -> list[torch.Tensor]:
        """Every per-layer buffer in the fixed flat-page order, each `[num_rows, ...]` in the
        store dtype (views of the pool's memory: writes through them change the pool)."""
        return list(self._pages.buffers)

    # --- page I/O ------------------------------------------------------------------------------

    def read_pages(
        self,
        page_ids: torch.Tensor,
        out: torch.Tensor,
        *,
        allow_dummy: bool = False,
        non_blocking: bool = False,
    ) -> None:
        """Copy all layers of pages `page_ids` into `out` (uint8 `[len(page_ids),
        page_size_bytes]`, any device, rows may be strided but each row contiguous), row i =
        page `page_ids[i]` in the flat format. Mutates `out` only.

        Page 0 is refused (ReservedIndex) unless `allow_dummy`. Ids may repeat. Every check runs
        before any byte moves. With `out` on another device the pages are gathered on the pool's
        device and copied once; `non_blocking` makes that copy asynchronous (CUDA, pinned `out`):
        synchronise the current stream before reading `out`. An empty `page_ids` is a no-op.
        """
        moved = self._checked_native(page_ids, out, gather=True, allow_dummy=allow_dummy)
        if moved is None:
            ids = self._flat_ids(page_ids, out, "out", allow_dummy=allow_dummy, distinct=False)
            moved = ids.numel()
            if moved and out.device == self.device:
                self._pages.gather(ids, out)
            elif moved:
                staging = torch.empty(
                    (moved, self.page_size_bytes), dtype=torch.uint8, device=self.device
                )
                self._pages.gather(ids, staging)
                out.copy_(staging, non_blocking=non_blocking)
        self.counters.pages_read += moved
        self.counters.bytes_read += moved * self.page_size_bytes

    def write_pages(
        self,
        page_ids: torch.Tensor,
        src: torch.Tensor,
        *,
        allow_dummy: bool = False,
        non_blocking: bool = False,
    ) -> None:
        """Copy `src` (uint8 `[len(page_ids), page_size_bytes]`, flat format, any device) into
        all layers of pages `page_ids`. Mutates those pages only.

        Ids must be distinct (DuplicateIndex) and not 0 unless `allow_dummy`. Every check runs
        before any byte moves. With `src` on another device it is staged on the pool's device
        first; `non_blocking` makes that copy asynchronous: do not change `src` until the
        current stream has passed it. An empty `page_ids` is a no-op.
        """
        moved = self._checked_native(page_ids, src, gather=False, allow_dummy=allow_dummy)
        if moved is None:
            ids = self._flat_ids(page_ids, src, "src", allow_dummy=allow_dummy, distinct=True)
            moved = ids.numel()
            if moved:
                self._pages.scatter(ids, src.to(self.device, non_blocking=non_blocking))
        self.counters.pages_written += moved
        self.counters.bytes_written += moved * self.page_size_bytes

    def _flat_ids(
        self,
        page_ids: torch.Tensor,
        flat: torch.Tensor,
        what: str,
        *,
        allow_dummy: bool,
        distinct: bool,
    ) -> torch.Tensor:
        """The checked Python path's checks of read_pages / write_pages, ids first, then the
        flat buffer `what`: the ids as int64 on the pool's device."""
        ids = check_index_tensor(page_ids, what="page_ids")
        check_index_range(
            ids, limit=self.num_pages, what="page_ids", allow_zero=allow_dummy, distinct=distinct
        )
        problem = self._flat_problem(flat, ids.numel(), what)
        if problem is not None:
            raise BufferMismatch(problem)
        return ids.to(device=self.device, dtype=torch.int64)

    def _flat_problem(self, buf: object, n: int, what: str) -> str | None:
        """Why `buf` cannot be the flat buffer of `n` pages, or None when it can."""
        if not isinstance(buf, torch.Tensor):
            return f"{what} must be a torch.Tensor, got {type(buf).__name__}"
        want = (n, self.page_size_bytes)
        if buf.dtype != torch.uint8 or tuple(buf.shape) != want:
            return f"{what} must be uint8 {list(want)}, got {buf.dtype} {list(buf.shape)}"
        if n and (buf.stride(1) != 1 or (n > 1 and buf.stride(0) < self.page_size_bytes)):
            return f"{what} rows must each be contiguous and not overlap; strides {buf.stride()}"
        if n and buf.device == self.device:
            # A buffer inside the pool's own memory would copy pages onto themselves: refused
            # (the copy routines assume source and destination do not overlap).
            lo = buf.data_ptr()
            hi = lo + (n - 1) * buf.stride(0) + self.page_size_bytes
            for start, end in self._stack_spans:
                if lo < end and start < hi:
                    return f"{what} overlaps the pool's own memory"
        return None

    def _checked_native(
        self, page_ids: torch.Tensor, flat: torch.Tensor, *, gather: bool, allow_dummy: bool
    ) -> int | None:
        """The compiled fast path of read_pages / write_pages: plain ids (1-D contiguous int64
        CPU) and a valid CPU buffer, checked and copied in one C call. The number of pages
        moved, or None when the ids or buffer need the checked Python path (which raises the
        specific error, or copies other id dtypes); nothing has moved then."""
        layout = self._pages
        if not (layout.native and is_plain_index(page_ids)):
            return None
        n = page_ids.shape[0]
        if self._flat_problem(flat, n, "flat") is not None or not flat.is_cpu:
            return None
        return (
            n
            if layout.copy_checked(page_ids, flat, gather=gather, allow_zero=allow_dummy)
            else None
        )

    # --- integrity -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert the buffer geometry this pool promises (shapes, dtypes, device, page size).
        Reads no buffer contents; mutates nothing."""
        layout = self._pages
        assert layout.page_size_bytes == self.bytes_per_token * self.page_size, (
            "flat page size drifted"
        )
        for i, buf in enumerate(layout.buffers):
            assert buf.shape[0] == self.num_rows, f"buffer {i} has {buf.shape[0]} rows"
            assert buf.device == self.device, f"buffer {i} is on {buf.device}"
            assert buf.is_contiguous(), f"buffer {i} is not contiguous"
        for stack in layout.stack_tensors():
            assert stack.shape[1] == self.num_rows, "stack rows differ from num_rows"


class KVPool(DevicePool, Generic[SpecT]):
    """A device pool of attention layers (MHA, MLA), addressed by global layer id.

    `spec.start_layer .. spec.start_layer + spec.num_layers - 1` are the layers held (a pipeline
    stage holds a range); any other id raises LayerOutOfRange.

    `check_locations`: whether `set_kv` range-checks its slots (IndexOutOfRange before writing).
    On by default on CPU; off by default on CUDA, where the check costs a device-to-host sync
    per layer per step (torch's device-side assert still fires on an out-of-range slot, but
    after the fact).
    """

    def __init__(
        self,
        spec: SpecT,
        size: int,
        page_size: int = 1,
        device: torch.device | str = "cpu",
        *,
        check_locations: bool | None = None,
    ) -> None:
        super().__init__(size=size, page_size=page_size, device=device, dtype=spec.dtype)
        self._spec = spec
        self.check_locations = (
            self.device.type == "cpu" if check_locations is None else check_locations
        )
        self._bind_stacks(self._allocate())

    @property
    def spec(self) -> SpecT:
        """The spec the pool was built from."""
        return self._spec

    @abstractmethod
    def _allocate(self) -> list[BufferStack]:
        """Allocate the family's zeroed buffers for `num_rows` rows of `spec` (called once, by
        `__init__`, after size, page size, device and spec are set) and return them as the
        stacks of the flat page, in page order."""

    @property
    def bytes_per_token(self) -> int:
        return self.spec.bytes_per_token

    @property
    def layer_ids(self) -> range:
        """Global ids of the layers this pool holds."""
        return self.spec.layer_ids

    def local_layer_id(self, layer_id: int) -> int:
        """Index of global `layer_id` among this pool's layers; LayerOutOfRange if not held."""
        ids = self.spec.layer_ids
        if layer_id not in ids:
            raise LayerOutOfRange(f"layer {layer_id} is not in this pool's layers {ids}")
        return layer_id - ids.start

    @abstractmethod
    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        """K buffer of global `layer_id`, `[num_rows, ...]`, in the logical dtype (fp8 viewed
        back). A view: valid while the pool lives, and writes through it change the pool."""

    @abstractmethod
    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        """V buffer of global `layer_id` (a view, as get_key_buffer)."""

    @abstractmethod
    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, /) -> None:
        """Write one layer's cache entries of the tokens at slots `loc`, cast to the pool's
        dtype. Mutates rows `loc` of that layer only. Slot 0 (padding) is accepted."""

    def _locations(self, loc: torch.Tensor) -> torch.Tensor:
        loc = check_index_tensor(loc, what="loc")
        if self.check_locations:
            check_index_range(loc, limit=self.num_rows, what="loc", allow_zero=True)
        return loc if loc.device == self.device else loc.to(self.device)

    def _token_values(
        self, x: torch.Tensor, n: int, token_shape: tuple[int, ...], what: str
    ) -> torch.Tensor:
        """`x` reshaped to `[n, *token_shape]`; BufferMismatch if it holds other sizes."""
        if not isinstance(x, torch.Tensor):
            raise BufferMismatch(f"{what} must be a torch.Tensor, got {type(x).__name__}")
        per_token = 1
        for d in token_shape:
            per_token *= d
        if x.dim() == 0 or x.shape[0] != n or x.numel() != n * per_token:
            raise BufferMismatch(
                f"{what} must hold {n} tokens of {list(token_shape)}, got {list(x.shape)}"
            )
        if x.device != self.device:
            raise BufferMismatch(f"{what} is on {x.device}, the pool on {self.device}")
        return x.reshape(n, *token_shape)
