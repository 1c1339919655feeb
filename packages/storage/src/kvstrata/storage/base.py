"""The `Storage` interface every L3 backend implements, and what it reports.

A storage maps page keys (`bytes`) to page payloads (bytes of any length, in practice one
`page_size_bytes` of a pool). The public batch methods live here and do what every backend shares:
argument checks (raised before anything changes), buffer adaptation, timing and counters. A
backend implements the underscored hooks.
"""

from __future__ import annotations

import ctypes
import enum
import operator
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, TypeAlias, cast

import numpy.typing as npt

from kvstrata.core.histogram import HistogramSnapshot, LatencyHistogram
from kvstrata.storage.errors import BatchLengthMismatch, InvalidBuffer, InvalidKey
from kvstrata.storage.immutable import inside_bytes_object

#: The batch operations that are timed, one latency histogram each.
OPERATIONS: tuple[str, ...] = ("exists", "get", "set", "delete")

#: Upper bounds (seconds) of the latency buckets: from a page-cache hit of a small page (tens of
#: microseconds) to a batch stuck behind a slow disk (seconds). The +Inf bucket is implicit.
LATENCY_BUCKETS_S: tuple[float, ...] = (
    1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3,
    1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class BufferLike(Protocol):
    """Anything with the buffer protocol: bytes, bytearray, memoryview, numpy arrays, mmap."""

    def __buffer__(self, flags: int, /) -> memoryview: ...


class DeviceLike(Protocol):
    @property
    def type(self) -> str: ...


class TensorLike(Protocol):
    """A torch tensor, seen without importing torch: torch tensors have no buffer protocol, so
    a CPU tensor is read through its data pointer (and must stay alive for the call)."""

    @property
    def nbytes(self) -> int: ...

    @property
    def device(self) -> DeviceLike: ...

    def data_ptr(self) -> int: ...

    def is_contiguous(self) -> bool: ...


#: numpy arrays are listed on their own: they have the buffer protocol at runtime, but numpy's
#: stubs declare `__buffer__` only for Python >= 3.12, so on 3.11 they do not match BufferLike.
PageBuffer: TypeAlias = BufferLike | TensorLike | npt.NDArray[Any]


def page_view(buffer: PageBuffer, *, writable: bool) -> memoryview:
    """A flat byte view (format 'B', 1-D) sharing memory with `buffer`; no copy.

    The view is valid only while `buffer` is alive and unresized. Raises InvalidBuffer for a
    non-contiguous buffer, a tensor that is not on the CPU, or a read-only buffer when
    `writable` is asked for.
    """
    try:
        view = memoryview(buffer)  # pyright: ignore[reportArgumentType]
    except TypeError:
        view = None  # no buffer protocol: maybe a torch tensor
    if view is not None:
        if not view.c_contiguous:
            raise InvalidBuffer(f"page buffers must be C-contiguous, got {type(buffer).__name__}")
        if writable and view.readonly:
            raise InvalidBuffer(
                f"batch_get needs writable buffers, got a read-only {type(buffer).__name__}"
            )
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    if hasattr(buffer, "data_ptr") and hasattr(buffer, "is_contiguous"):
        tensor: TensorLike = buffer  # pyright: ignore[reportAssignmentType]
        if tensor.device.type != "cpu":
            raise InvalidBuffer(f"page tensors must be on the CPU, got {tensor.device.type}")
        if not tensor.is_contiguous():
            raise InvalidBuffer("page tensors must be contiguous")
        if tensor.nbytes == 0:
            return memoryview(bytearray())
        if writable and inside_bytes_object(tensor.data_ptr(), tensor.nbytes):
            raise InvalidBuffer(
                "batch_get needs writable buffers, got a tensor over an immutable bytes object "
                "(torch.frombuffer of bytes)"
            )
        raw = (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())
        return memoryview(raw).cast("B")
    raise InvalidBuffer(f"{type(buffer).__name__} is neither a buffer nor a CPU tensor")


def flat_views(buffers: Sequence[PageBuffer], *, writable: bool) -> list[memoryview]:
    """`page_view` of each buffer, in order; the same views and errors.

    A batch of memoryviews, bytes and bytearrays only (what the tiers pass: host page views
    and small checksum buffers) is viewed and checked by whole-list calls in C instead of one
    `page_view` call per page (about 3 us each): bytes and bytearrays are always flat bytes, so
    only the memoryviews' format, dimensions and contiguity are read, one attribute per pass
    (no tuple per view). Anything else goes page by page through `page_view`.
    """
    kinds = set(map(type, buffers))
    if kinds <= _PLAIN_BUFFERS:
        try:
            views = list(map(memoryview, buffers))  # pyright: ignore[reportArgumentType]
        except ValueError:  # a released view: page by page raises in batch order
            views = None
        if (
            views is not None
            and (
                memoryview not in kinds
                or (
                    set(map(_FORMAT, views)) <= _FLAT_FORMAT
                    and set(map(_NDIM, views)) <= _FLAT_NDIM
                    and all(map(_C_CONTIGUOUS, views))
                )
            )
            and not (writable and any(map(_READONLY, views)))
        ):
            return views
    return [page_view(b, writable=writable) for b in buffers]


#: Buffer types whose memoryview is taken directly (anything else: numpy arrays, tensors,
#: mmaps, goes through `page_view`).
_PLAIN_BUFFERS = frozenset({memoryview, bytes, bytearray})
#: A memoryview's format, dimensions and contiguity, and whether it is read-only: attribute
#: getters in C, so a whole batch is checked without a Python call per view.
_FORMAT = operator.attrgetter("format")
_NDIM = operator.attrgetter("ndim")
_C_CONTIGUOUS = operator.attrgetter("c_contiguous")
_READONLY = operator.attrgetter("readonly")
_FLAT_FORMAT = frozenset({"B"})
_FLAT_NDIM = frozenset({1})


def check_keys(keys: Sequence[bytes], *, max_key_bytes: int | None = None) -> None:
    """Raise InvalidKey unless every key is non-empty bytes (and not longer than the limit)."""
    # The valid batch is checked by whole-list calls in C; the loop below only runs to name
    # the first bad key.
    if type(keys) not in (list, tuple):  # a numpy array or other sequence: checked below
        keys = list(keys)
    if (
        (not keys or set(map(type, keys)) == {bytes})
        and b"" not in keys
        and (max_key_bytes is None or not keys or max(map(len, keys)) <= max_key_bytes)
    ):
        return
    for key in keys:
        if type(key) is not bytes:
            raise InvalidKey(f"page keys must be bytes, got {type(key).__name__}")
        if not key:
            raise InvalidKey("page keys must not be empty")
        if max_key_bytes is not None and len(key) > max_key_bytes:
            raise InvalidKey(f"key of {len(key)} bytes; this backend takes at most {max_key_bytes}")


class WriteResult(enum.Enum):
    """What a backend did with one page of `batch_set`."""

    WRITTEN = "written"
    PRESENT = "present"  # already stored: a key names its content, so the write is skipped
    FAILED = "failed"  # refused (larger than capacity, no room) or an I/O error


class Occupancy(NamedTuple):
    num_pages: int
    used_bytes: int
    capacity_bytes: int


@dataclass(frozen=True, kw_only=True)
class StorageStats:
    """Counters of one storage since it was constructed (occupancy: now).

    `hits`/`misses` count pages of `batch_get`; `pages_read`/`bytes_read` the hits' payloads;
    `pages_written`/`bytes_written` pages actually written (not those skipped as present);
    `write_failures` pages `batch_set` returned False for; `corrupt_pages` pages that failed a
    check on read and were dropped; `race_misses` pages that were misses because another
    process removed, recycled or replaced the file while it was read (not corruption: nothing
    is dropped); `latency` one histogram per operation in OPERATIONS.
    """

    num_pages: int
    used_bytes: int
    capacity_bytes: int
    pages_read: int
    bytes_read: int
    pages_written: int
    bytes_written: int
    hits: int
    misses: int
    corrupt_pages: int
    evictions: int
    write_failures: int
    latency: dict[str, HistogramSnapshot]
    race_misses: int = 0


class Storage(ABC):
    """A page store keyed by bytes. Thread-safe: any method may be called from any thread.

    Buffers are anything with the buffer protocol or CPU torch tensors, C-contiguous; a page's
    size is its buffer's `nbytes`. Keys are non-empty `bytes`; a key names its content, so a
    `batch_set` of a key already stored keeps the stored page.
    """

    #: Longest key the backend accepts (None: no limit).
    max_key_bytes: int | None = None
    #: True when every call is memory work in this process, with no I/O or remote call to wait
    #: on: a caller with nothing to overlap (a tier controller on the CPU) may then run its
    #: backups on its own thread. False (the default, and for any wrapper) keeps them queued.
    in_process_memory: bool = False

    def __init__(self) -> None:
        self._counters_lock = threading.Lock()
        self._pages_read = self._bytes_read = self._hits = self._misses = 0
        self._pages_written = self._bytes_written = self._write_failures = 0
        self._corrupt_pages = self._evictions = 0
        self._race_misses = 0
        self._latency = {op: LatencyHistogram(LATENCY_BUCKETS_S) for op in OPERATIONS}

    # ------------------------------------------------------------------ public batch calls

    def batch_exists(self, keys: Sequence[bytes], *, trusted: bool = False) -> int:
        """How many keys, from the first, are stored consecutively: the count stops at the
        first missing key. A page whose write has not completed is not visible. Mutates
        nothing but counters (a backend may refresh its index of pages written by others).

        `trusted=True` (the tiers' path, see `_check_trusted_keys`): the caller vouches that
        `keys` is a list of non-empty bytes, so only a backend's key length limit is checked."""
        if trusted:
            self._check_trusted_keys(keys)
        else:
            check_keys(keys, max_key_bytes=self.max_key_bytes)
        start = time.perf_counter()
        found = self._exists_prefix(keys) if keys else 0
        self._observe("exists", start)
        return found

    def batch_get(
        self, keys: Sequence[bytes], buffers: Sequence[PageBuffer], *, trusted: bool = False
    ) -> list[bool]:
        """Copy each stored page into the buffer at the same position; True where it was.

        Each buffer must be writable and exactly the size of the stored page: a wrong size
        raises BufferSizeMismatch before any buffer is written. A False page's buffer has
        unspecified contents (a backend may have read it before its check failed). A page that
        fails a check is removed and reported False, never returned. Marks hits as recently
        used.

        `trusted=True` (the tiers' path): the caller vouches that `keys` is a list of non-empty
        bytes and `buffers` a list of writable flat byte memoryviews (format "B", 1-D,
        C-contiguous), so neither is checked nor re-viewed; the batch lengths and a backend's
        key length limit still are.
        """
        views = self._checked_views(keys, buffers, trusted=trusted, writable=True)
        start = time.perf_counter()
        found = self._get_into(keys, views)
        elapsed = time.perf_counter() - start
        num_hits = found.count(True)
        hit_bytes = _bytes_of(views, found, num_hits)
        with self._counters_lock:
            self._hits += num_hits
            self._misses += len(keys) - num_hits
            self._pages_read += num_hits
            self._bytes_read += hit_bytes
            self._latency["get"].observe(elapsed)
        return found

    def batch_set(
        self, keys: Sequence[bytes], buffers: Sequence[PageBuffer], *, trusted: bool = False
    ) -> list[bool]:
        """Store each buffer under its key; True where the page is stored afterwards.
        Same as `batch_set_results`, with each result reduced to "stored or not".
        """
        results = self.batch_set_results(keys, buffers, trusted=trusted)
        if WriteResult.FAILED not in results:
            return [True] * len(results)
        return [r is not WriteResult.FAILED for r in results]

    def batch_set_results(
        self, keys: Sequence[bytes], buffers: Sequence[PageBuffer], *, trusted: bool = False
    ) -> list[WriteResult]:
        """Store each buffer under its key; per page WRITTEN, PRESENT (already stored, skipped)
        or FAILED.

        Copies the buffers (they may be reused when the call returns). A key already stored is
        skipped (PRESENT). May evict least recently used pages to make room, never a page of this
        batch. FAILED for a page that cannot be stored (larger than the capacity, an I/O error,
        disk full); other pages of the batch are unaffected, and a failed page is never visible.

        `trusted=True` (the tiers' path): as for `batch_get`, with flat byte memoryviews that
        may be read-only.
        """
        views = self._checked_views(keys, buffers, trusted=trusted, writable=False)
        start = time.perf_counter()
        results = self._set_from(keys, views)
        elapsed = time.perf_counter() - start
        num_written = results.count(WriteResult.WRITTEN)
        bytes_written = _bytes_of(views, (r is WriteResult.WRITTEN for r in results), num_written)
        num_failed = results.count(WriteResult.FAILED)
        with self._counters_lock:
            self._pages_written += num_written
            self._bytes_written += bytes_written
            self._write_failures += num_failed
            self._latency["set"].observe(elapsed)
        return results

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove the pages of these keys; returns how many were stored. Missing keys are
        ignored."""
        check_keys(keys, max_key_bytes=self.max_key_bytes)
        start = time.perf_counter()
        removed = self._delete(keys)
        self._observe("delete", start)
        return removed

    def clear(self) -> None:
        """Remove every page. Counters are kept (they count since construction)."""
        self._clear()

    def stats(self) -> StorageStats:
        """A consistent snapshot of the counters and the current occupancy."""
        occupancy = self._occupancy()
        with self._counters_lock:
            return StorageStats(
                num_pages=occupancy.num_pages,
                used_bytes=occupancy.used_bytes,
                capacity_bytes=occupancy.capacity_bytes,
                pages_read=self._pages_read,
                bytes_read=self._bytes_read,
                pages_written=self._pages_written,
                bytes_written=self._bytes_written,
                hits=self._hits,
                misses=self._misses,
                corrupt_pages=self._corrupt_pages,
                evictions=self._evictions,
                write_failures=self._write_failures,
                latency={op: h.snapshot() for op, h in self._latency.items()},
                race_misses=self._race_misses,
            )

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the backend's invariants (bytes accounted == sum of page sizes <= capacity)."""

    # ------------------------------------------------------------------ for backends

    def _count_evictions(self, num_pages: int) -> None:
        with self._counters_lock:
            self._evictions += num_pages

    def _count_corrupt(self, num_pages: int) -> None:
        with self._counters_lock:
            self._corrupt_pages += num_pages

    def _count_races(self, num_pages: int) -> None:
        with self._counters_lock:
            self._race_misses += num_pages

    @abstractmethod
    def _exists_prefix(self, keys: Sequence[bytes]) -> int: ...

    @abstractmethod
    def _get_into(self, keys: Sequence[bytes], views: list[memoryview]) -> list[bool]:
        """Fill views; raise BufferSizeMismatch before writing any view if a stored page's
        size differs from its view's."""

    @abstractmethod
    def _set_from(self, keys: Sequence[bytes], views: list[memoryview]) -> list[WriteResult]: ...

    @abstractmethod
    def _delete(self, keys: Sequence[bytes]) -> int: ...

    @abstractmethod
    def _clear(self) -> None: ...

    @abstractmethod
    def _occupancy(self) -> Occupancy: ...

    # ------------------------------------------------------------------ internals

    def _checked_views(
        self,
        keys: Sequence[bytes],
        buffers: Sequence[PageBuffer],
        *,
        trusted: bool,
        writable: bool,
    ) -> list[memoryview]:
        """The checks of `batch_get` (`writable`) and `batch_set_results`, keys first, then
        the batch lengths; the buffers as flat byte views. With `trusted=True` the keys are
        checked only against the backend's key length limit (a caller vouches for its keys'
        types, not for every backend's limit) and the caller's flat byte memoryviews are taken
        as they are."""
        if trusted:
            self._check_trusted_keys(keys)
        else:
            check_keys(keys, max_key_bytes=self.max_key_bytes)
        if len(keys) != len(buffers):
            raise BatchLengthMismatch(f"{len(keys)} keys but {len(buffers)} buffers")
        if trusted:
            return cast("list[memoryview]", buffers if type(buffers) is list else list(buffers))
        return flat_views(buffers, writable=writable)

    def _check_trusted_keys(self, keys: Sequence[bytes]) -> None:
        """What `trusted=True` still checks of the keys: the backend's key length limit."""
        limit = self.max_key_bytes
        if limit is not None and keys and max(map(len, keys)) > limit:
            check_keys(keys, max_key_bytes=limit)  # names the key, raises InvalidKey

    def _observe(self, operation: str, start: float) -> None:
        elapsed = time.perf_counter() - start
        with self._counters_lock:
            self._latency[operation].observe(elapsed)


def _bytes_of(views: list[memoryview], done: Iterable[object], num_done: int) -> int:
    """The bytes of the pages whose flag in `done` is true (`num_done` of them), for the read
    and write counters; when every page is done, the page sizes summed in C (len of a flat
    byte view is its nbytes). A flag counts by its truth: a backend's `_get_into` may flag a
    hit with 1 or numpy's True."""
    if num_done == len(views):
        return sum(map(len, views))
    return sum(v.nbytes for v, ok in zip(views, done, strict=True) if ok)
