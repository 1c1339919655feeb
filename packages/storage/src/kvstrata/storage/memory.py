"""MemoryStorage: pages held as `bytes` in this process, byte-capacity LRU."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvstrata.storage.base import Occupancy, Storage, WriteResult
from kvstrata.storage.errors import BufferSizeMismatch, InvalidParameter


class MemoryStorage(Storage):
    """Pages in a dict ordered from least to most recently used; evicts from the front.

    The buffers of evicted and deleted pages are kept as spares (within the capacity not used
    by pages) and reused for new pages of the same size: in the steady state of a full store,
    a write then costs one memcpy instead of a fresh allocation that the kernel must fault in.
    Because a buffer can be reused, `batch_get` copies under the lock (the copy holds the GIL
    anyway, so this costs no parallelism).

    Cost: exists O(keys); get one memcpy per hit; set one memcpy per page plus O(pages
    evicted). A page larger than the capacity is refused. A batch of new pages that fits
    without evicting (the common case below the capacity) is copied and inserted by C-level
    calls under the lock, with no Python step per page; any other batch copies outside it.
    """

    in_process_memory = True

    def __init__(self, *, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise InvalidParameter(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        super().__init__()
        self.capacity_bytes = capacity_bytes
        self._pages: OrderedDict[bytes, bytearray] = OrderedDict()
        self._used_bytes = 0
        self._spares: dict[int, list[bytearray]] = {}  # page size -> reusable buffers
        self._spare_bytes = 0
        self._lock = threading.Lock()

    def _exists_prefix(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            if all(map(self._pages.__contains__, keys)):  # all there: no Python step per key
                return len(keys)
            for i, key in enumerate(keys):
                if key not in self._pages:
                    return i
            return len(keys)

    def _get_into(self, keys: Sequence[bytes], views: list[memoryview]) -> list[bool]:
        with self._lock:
            found = [self._pages.get(key) for key in keys]
            for key, page, view in zip(keys, found, views, strict=True):
                if page is not None and len(page) != view.nbytes:
                    raise BufferSizeMismatch(
                        f"page {key.hex()[:16]} has {len(page)} bytes, its buffer {view.nbytes}"
                    )
            for key, page, view in zip(keys, found, views, strict=True):
                if page is not None:
                    view[:] = page
                    self._pages.move_to_end(key)
        return [page is not None for page in found]

    def _set_from(self, keys: Sequence[bytes], views: list[memoryview]) -> list[WriteResult]:
        with self._lock:
            if self._fits_whole(keys, views):
                # A batch of new, distinct pages that fits as it is, with no spare to reuse
                # (always so below the capacity: a store that never evicted has no spares):
                # page by page would write each in order, evicting nothing. Copied and
                # inserted by C-level calls; a page becomes visible only whole (under the lock).
                # Every copy is made before the store changes: a MemoryError mid-batch
                # leaves it as it was.
                copies = list(map(bytearray, views))
                self._pages.update(zip(keys, copies, strict=True))
                self._used_bytes += sum(map(len, copies))
                return [WriteResult.WRITTEN] * len(keys)
        return self._set_each(keys, views)

    def _fits_whole(self, keys: Sequence[bytes], views: list[memoryview]) -> bool:
        """Under the lock: whether every page of the batch is new, the keys distinct, the
        whole batch fits in the free capacity and there is no spare buffer to reuse or trim."""
        return (
            not self._spares  # by buffers, not bytes: zero-length spares count too
            and self._pages.keys().isdisjoint(keys)
            and len(set(keys)) == len(keys)
            and self._used_bytes + sum(map(len, views)) <= self.capacity_bytes
        )

    def _set_each(self, keys: Sequence[bytes], views: list[memoryview]) -> list[WriteResult]:
        """`_set_from` of a batch that may hold stored or repeated keys, or need evictions."""
        # The lock is taken twice per batch, not twice per page: under it, find the pages not
        # stored yet and take spare buffers for them; outside it, copy them (a buffer is
        # private until inserted, so a page becomes visible only whole); under it again, go
        # through the batch in order exactly as one page at a time would.
        batch = frozenset(keys)
        capacity = self.capacity_bytes
        pages = self._pages
        buffers: list[bytearray | None] = [None] * len(keys)
        with self._lock:
            fresh = [
                i
                for i, (key, view) in enumerate(zip(keys, views, strict=True))
                if key not in pages and view.nbytes <= capacity
            ]
            spares = [self._take_spare(views[i].nbytes) for i in fresh] if self._spares else None
        for k, i in enumerate(fresh):
            spare = None if spares is None else spares[k]
            if spare is None:
                buffers[i] = bytearray(views[i])
            else:
                spare[:] = views[i]
                buffers[i] = spare
        results: list[WriteResult] = []
        written = WriteResult.WRITTEN
        with self._lock:
            for key, view, buffer in zip(keys, views, buffers, strict=True):
                if (
                    buffer is not None
                    and not self._spare_bytes
                    and self._used_bytes + len(buffer) <= capacity
                    and key not in pages
                ):  # room and no spare to trim: `_insert`'s common case, inlined
                    pages[key] = buffer
                    self._used_bytes += len(buffer)
                    results.append(written)
                elif key in pages:
                    pages.move_to_end(key)
                    results.append(WriteResult.PRESENT)
                    if buffer is not None:  # a repeat in this batch, or stored meanwhile
                        self._keep_spare(buffer)
                elif buffer is None:  # larger than the capacity (or stored, then evicted)
                    too_big = view.nbytes > capacity
                    results.append(
                        WriteResult.FAILED if too_big else self._insert_copy(key, view, batch)
                    )
                else:
                    results.append(self._insert(key, buffer, protect=batch))
        return results

    def _insert_copy(self, key: bytes, view: memoryview, batch: frozenset[bytes]) -> WriteResult:
        """Under the lock: insert a copy of `view` (a page that was stored when the batch
        began and was evicted by another thread since)."""
        buffer = self._take_spare(view.nbytes)
        if buffer is None:
            buffer = bytearray(view)
        else:
            buffer[:] = view
        return self._insert(key, buffer, protect=batch)

    def _insert(self, key: bytes, page: bytearray, *, protect: frozenset[bytes]) -> WriteResult:
        """Under the lock: add the page, evicting least recently used pages not in `protect`.
        Evicts nothing when even that would not make room (the buffer becomes a spare)."""
        if key in self._pages:  # another thread stored it while we copied
            self._pages.move_to_end(key)
            self._keep_spare(page)
            return WriteResult.PRESENT
        need = self._used_bytes + len(page) - self.capacity_bytes
        if need <= 0 and not self._spare_bytes:  # room and no spare to trim: the common case
            self._pages[key] = page
            self._used_bytes += len(page)
            return WriteResult.WRITTEN
        victims: list[bytes] = []
        for candidate, stored in self._pages.items():
            if need <= 0:
                break
            if candidate not in protect:
                victims.append(candidate)
                need -= len(stored)
        if need > 0:
            self._keep_spare(page)
            return WriteResult.FAILED
        for victim in victims:
            evicted = self._pages.pop(victim)
            self._used_bytes -= len(evicted)
            self._keep_spare(evicted)
        if victims:
            self._count_evictions(len(victims))
        self._pages[key] = page
        self._used_bytes += len(page)
        self._trim_spares()
        return WriteResult.WRITTEN

    def _take_spare(self, size: int) -> bytearray | None:
        spares = self._spares.get(size)
        if not spares:
            return None
        buffer = spares.pop()
        if not spares:
            del self._spares[size]
        self._spare_bytes -= size
        return buffer

    def _keep_spare(self, page: bytearray) -> None:
        if not page:  # nothing to reuse in an empty buffer
            return
        self._spares.setdefault(len(page), []).append(page)
        self._spare_bytes += len(page)
        self._trim_spares()

    def _trim_spares(self) -> None:
        """Spares live only in the capacity that pages do not use: drop the excess."""
        while self._spare_bytes > self.capacity_bytes - self._used_bytes:
            size = max(self._spares)
            self._spares[size].pop()
            if not self._spares[size]:
                del self._spares[size]
            self._spare_bytes -= size

    def _delete(self, keys: Sequence[bytes]) -> int:
        removed = 0
        with self._lock:
            for key in keys:
                page = self._pages.pop(key, None)
                if page is not None:
                    self._used_bytes -= len(page)
                    self._keep_spare(page)
                    removed += 1
        return removed

    def _clear(self) -> None:
        """Drops pages and spares: the memory goes back to the allocator."""
        with self._lock:
            self._pages.clear()
            self._spares.clear()
            self._used_bytes = self._spare_bytes = 0

    def _occupancy(self) -> Occupancy:
        with self._lock:
            return Occupancy(len(self._pages), self._used_bytes, self.capacity_bytes)

    def lru_keys(self) -> list[bytes]:
        """Stored keys from least to most recently used (a copy; for tests and debugging)."""
        with self._lock:
            return list(self._pages)

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(len(page) for page in self._pages.values())
            assert total == self._used_bytes, (
                f"used_bytes {self._used_bytes} != sum of page sizes {total}: an insert or "
                "eviction forgot to account a page"
            )
            spare = sum(size * len(buffers) for size, buffers in self._spares.items())
            assert spare == self._spare_bytes, f"spare_bytes {self._spare_bytes} != {spare}"
            assert all(len(b) == size for size, bs in self._spares.items() for b in bs), (
                "a spare buffer is filed under the wrong size"
            )
            assert all(self._spares.values()), "_take_spare left an empty spare list behind"
            assert self._used_bytes + self._spare_bytes <= self.capacity_bytes, (
                f"pages {self._used_bytes} + spares {self._spare_bytes} > capacity "
                f"{self.capacity_bytes}: _insert made too little room or _trim_spares kept too much"
            )
