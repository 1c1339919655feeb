"""StoreCore: the page store one node's actor runs, without Ray (so it is tested directly).

Pages live in the arena (memory) first and spill to a `FileStorage` (disk) when memory passes
its high watermark; every key is in at most one of the two. Memory is LRU over pages:

    used bytes  0 ........ low ...... high ..... capacity
                           ^ spill stops   ^ a write that ends above here spills LRU pages

A write is reserve -> fill -> commit: `reserve` sets aside arena ranges (invisible to readers),
the writer fills them (the actor from a received array, or a same-node client through its own
mapping), and `commit` makes them visible with the xxh3_64 the writer computed over the bytes
it put there (`copy_checksum`; `verify=True` re-reads them to check it). A read under a lease:
`lease` pins the pages (they are neither spilled nor evicted while pinned) and returns where
they are; the reader copies them out of the arena, checks each checksum, and releases. Leases
and reservations expire (`lease_s`), so a reader or writer that died never pins memory for good.

A page read from disk comes back into memory (and leaves the disk): the page is hot again.

Thread-safe (one lock): the actor's metrics thread reads stats while calls run.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import xxhash

from kvstrata.l3_store.arena import Extents, aligned
from kvstrata.l3_store.errors import InvalidStoreConfig, UnknownLease, UnknownReservation
from kvstrata.storage import FileStorage
from kvstrata.storage.base import WriteResult, check_keys
from kvstrata.storage.errors import BatchLengthMismatch, InvalidParameter


def checksum(data: memoryview | bytes | bytearray) -> int:
    """xxh3_64 of a page: what a writer sends with it and a reader checks after copying."""
    return xxhash.xxh3_64_intdigest(data)


def copy_checksum(dst: memoryview, src: memoryview) -> int:
    """Copy `src` into `dst` (same length) and return the xxh3_64 of the bytes now in `dst`
    (== `checksum(dst)`): what a writer commits and what a reader compares with the stored
    checksum. One memcpy, then one hash pass over the copy. (Copying and hashing 256 KiB
    chunks in turn, so that each is hashed while in cache, measured no faster from numpy
    sources and 2-3x slower out of the arena mapping on the 2-core VM of the figures.)"""
    if dst.nbytes != src.nbytes:
        raise BatchLengthMismatch(f"copy of {src.nbytes} bytes into {dst.nbytes}")
    dst[:] = src
    return xxhash.xxh3_64_intdigest(dst)


@dataclass(frozen=True, kw_only=True)
class StoreParams:
    """Budget and timing of one store. Memory sizes are arena bytes (pages take whole
    alignment units); `disk` None keeps pages in memory only (an evicted page is dropped)."""

    memory_bytes: int
    high_watermark: float = 0.95
    low_watermark: float = 0.85
    lease_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise InvalidStoreConfig(
                f"watermarks must satisfy 0 < low <= high <= 1, got low={self.low_watermark} "
                f"high={self.high_watermark}"
            )
        if not self.lease_s > 0:
            raise InvalidStoreConfig(f"lease_s must be > 0, got {self.lease_s}")


@dataclass(frozen=True)
class PageRef:
    """Where a leased page lies in the arena."""

    offset: int
    size: int
    checksum: int


@dataclass(frozen=True)
class Lease:
    """`refs[i]` is None where key i is not stored (or could not be brought into memory).
    `lease_id` is None when nothing was pinned (no release needed)."""

    lease_id: int | None
    refs: list[PageRef | None]


@dataclass(frozen=True)
class Reservation:
    """`offsets[i]` is where the writer puts page i; None where the key is stored already
    (`present[i]`) or there was no room."""

    reservation_id: int | None
    offsets: list[int | None]
    present: list[bool]


@dataclass(frozen=True, kw_only=True)
class CoreStats:
    memory_pages: int
    memory_used_bytes: int
    memory_capacity_bytes: int
    disk_pages: int
    disk_used_bytes: int
    disk_capacity_bytes: int
    hits_memory: int
    hits_disk: int
    misses: int
    pages_written: int
    bytes_written: int
    pages_read: int
    bytes_read: int
    write_failures: int
    checksum_failures: int
    spills: int
    drops: int
    active_leases: int
    active_reservations: int
    expired: int
    operations: int


@dataclass
class _Page:
    offset: int
    size: int
    checksum: int
    pins: int = 0


@dataclass
class _Pending:
    keys: list[bytes]
    pins: list[bytes]  # keys pinned (leases) or reserved (reservations), with repetition
    deadline: float


class StoreCore:
    """Memory (arena extents) + optional disk (`FileStorage`), one LRU each. The disk is
    cleared at construction (the store is its one owner)."""

    def __init__(
        self,
        params: StoreParams,
        *,
        arena: memoryview,
        disk: FileStorage | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if arena.nbytes < params.memory_bytes:
            raise InvalidStoreConfig(
                f"arena of {arena.nbytes} bytes < memory budget {params.memory_bytes}"
            )
        self.params = params
        self._arena = arena
        self._extents = Extents(params.memory_bytes)
        self._disk = disk
        if disk is not None:
            # The store is the directory's one owner, and its memory index starts empty: pages
            # left by an earlier store on this node are stale (their sizes are not indexed).
            disk.clear()
        self._clock = clock
        self._pages: OrderedDict[bytes, _Page] = OrderedDict()  # LRU first
        self._reserved: dict[bytes, _Page] = {}  # being written, invisible
        # Payload size and checksum of each page spilled to disk (the disk's own index knows
        # file sizes only; the checksum is the page's own, checked when it comes back).
        self._disk_bytes: dict[bytes, tuple[int, int]] = {}
        self._leases: dict[int, _Pending] = {}
        self._reservations: dict[int, _Pending] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._n = dict.fromkeys(
            (
                "hits_memory", "hits_disk", "misses", "pages_written", "bytes_written",
                "pages_read", "bytes_read", "write_failures", "checksum_failures", "spills",
                "drops", "expired", "operations",
            ),
            0,
        )  # fmt: skip

    # ------------------------------------------------------------------ reads

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: stored (memory or disk). Mutates nothing but the operation counter."""
        check_keys(keys)
        with self._lock:
            self._n["operations"] += 1
            in_memory = [k in self._pages for k in keys]
        if self._disk is None or all(in_memory):
            return in_memory
        rest = [k for k, m in zip(keys, in_memory, strict=True) if not m]
        on_disk = iter(self._disk_mask(rest))
        return [m or next(on_disk) for m in in_memory]

    def lease(self, keys: Sequence[bytes]) -> Lease:
        """Pin the stored pages of `keys` in memory (bringing disk pages back) and say where
        they are. Release with `release(lease_id)` after copying them out."""
        check_keys(keys)
        with self._lock:
            self._n["operations"] += 1
            self._expire_locked()
        from_disk = self._promote([k for k in keys if k not in self._pages])
        with self._lock:
            refs: list[PageRef | None] = []
            pinned: list[bytes] = []
            for key in keys:
                page = self._pages.get(key)
                if page is None:
                    refs.append(None)
                    self._n["misses"] += 1
                    continue
                page.pins += 1
                pinned.append(key)
                self._n["hits_disk" if key in from_disk else "hits_memory"] += 1
                self._pages.move_to_end(key)
                refs.append(PageRef(page.offset, page.size, page.checksum))
                self._n["pages_read"] += 1
                self._n["bytes_read"] += page.size
            if not pinned:
                return Lease(None, refs)
            lease_id = next(self._ids)
            self._leases[lease_id] = _Pending(
                list(keys), pinned, self._clock() + self.params.lease_s
            )
            return Lease(lease_id, refs)

    def release(self, lease_id: int) -> None:
        """Unpin a lease's pages. UnknownLease for an id not granted, released or expired."""
        with self._lock:
            pending = self._leases.pop(lease_id, None)
            if pending is None:
                raise UnknownLease(f"no lease {lease_id} (released twice, or expired)")
            self._unpin_locked(pending.pins)

    def read(self, keys: Sequence[bytes]) -> tuple[list[bytes | None], list[int]]:
        """Copies of the stored pages (None where missing) and their checksums (0 there):
        what the actor sends to another node."""
        grant = self.lease(keys)
        try:
            pages = [
                None if r is None else bytes(self._arena[r.offset : r.offset + r.size])
                for r in grant.refs
            ]
            return pages, [0 if r is None else r.checksum for r in grant.refs]
        finally:
            if grant.lease_id is not None:
                self.release(grant.lease_id)

    def view(self, ref: PageRef) -> memoryview:
        """The arena bytes of a leased page (valid until its lease is released)."""
        return self._arena[ref.offset : ref.offset + ref.size]

    # ------------------------------------------------------------------ writes

    def reserve(self, keys: Sequence[bytes], sizes: Sequence[int]) -> Reservation:
        """Set aside arena room for the pages of `keys` not stored yet, spilling or dropping
        least recently used unpinned pages as needed; the pages become visible at `commit`."""
        check_keys(keys)
        if len(keys) != len(sizes):
            raise BatchLengthMismatch(f"{len(keys)} keys but {len(sizes)} sizes")
        if any(type(s) is not int or s < 0 for s in sizes):
            raise InvalidParameter(f"page sizes must be ints >= 0, got {list(sizes)}")
        with self._lock:
            self._n["operations"] += 1
            self._expire_locked()
        present = [k in self._pages or k in self._reserved for k in keys]
        if self._disk is not None:
            rest = [k for k, p in zip(keys, present, strict=True) if not p]
            on_disk = iter(self._disk_mask(rest))
            present = [p or next(on_disk) for p in present]
        offsets: list[int | None] = []
        reserved: list[bytes] = []
        with self._lock:
            for key, size, here in zip(keys, sizes, present, strict=True):
                if here or key in self._reserved:
                    offsets.append(None)
                    continue
                offset = self._room_locked(size)
                offsets.append(offset)
                if offset is None:
                    self._n["write_failures"] += 1
                    continue
                self._reserved[key] = _Page(offset, size, 0)
                reserved.append(key)
            if not reserved:
                return Reservation(None, offsets, present)
            rid = next(self._ids)
            self._reservations[rid] = _Pending(
                list(keys), reserved, self._clock() + self.params.lease_s
            )
        return Reservation(rid, offsets, present)

    def commit(
        self, reservation_id: int, checksums: Sequence[int | None], *, verify: bool = True
    ) -> list[WriteResult]:
        """Publish the reserved pages of a reservation (one checksum per key of it; ignored
        where nothing was reserved). `verify`: publish only pages whose arena bytes match their
        checksum (one xxh3 pass per page here); without it the writer's checksums are taken as
        they are (it computed them over the arena bytes it wrote: `copy_checksum`), and a
        page damaged later is caught where it is read (every reader checks) or brought back
        from disk. A None checksum: the writer found the page damaged (dropped). Dropped pages
        are FAILED and freed."""
        with self._lock:
            pending = self._reservations.get(reservation_id)
            if pending is None:
                raise UnknownReservation(f"no reservation {reservation_id} (or it expired)")
            if len(checksums) != len(pending.keys):
                raise BatchLengthMismatch(
                    f"{len(pending.keys)} pages reserved but {len(checksums)} checksums"
                )
            del self._reservations[reservation_id]
            pages = {k: self._reserved.pop(k) for k in pending.pins}
        good: dict[bytes, bool] = {}
        for key, page in pages.items():  # the checksum pass runs outside the lock
            want = checksums[pending.keys.index(key)]
            good[key] = want is not None and (
                not verify or checksum(self._arena[page.offset : page.offset + page.size]) == want
            )
        results: list[WriteResult] = []
        with self._lock:
            for key, want in zip(pending.keys, checksums, strict=True):
                page = pages.pop(key, None)
                if page is None:  # not reserved: stored already, or no room
                    stored = key in self._pages or key in good
                    results.append(WriteResult.PRESENT if stored else WriteResult.FAILED)
                    continue
                if not good[key] or want is None:
                    self._extents.free(page.offset)
                    self._n["checksum_failures"] += 1
                    self._n["write_failures"] += 1
                    results.append(WriteResult.FAILED)
                    continue
                page.checksum = want
                self._pages[key] = page
                self._n["pages_written"] += 1
                self._n["bytes_written"] += page.size
                results.append(WriteResult.WRITTEN)
            self._watermark_locked()
        return results

    def write(
        self, keys: Sequence[bytes], pages: Sequence[memoryview | bytes]
    ) -> list[WriteResult]:
        """reserve + copy (checksummed as it goes) + commit, for pages the store received
        itself."""
        return self.write_verified(keys, pages, None)

    def write_verified(
        self,
        keys: Sequence[bytes],
        pages: Sequence[memoryview | bytes],
        checksums: Sequence[int] | None,
    ) -> list[WriteResult]:
        """`write`, refusing (FAILED, counted as checksum failures) each page whose bytes do
        not match the writer's checksum (it was damaged on the way); None: no checksums to
        check. One copy and one hash per page (`copy_checksum`: the hash is of the arena
        bytes), and the commit takes that hash without another pass (it used to take three)."""
        views = [memoryview(p).cast("B") for p in pages]
        if len(keys) != len(views):
            raise BatchLengthMismatch(f"{len(keys)} keys but {len(views)} pages")
        if checksums is not None and len(checksums) != len(views):
            raise BatchLengthMismatch(f"{len(views)} pages but {len(checksums)} checksums")
        grant = self.reserve(keys, [v.nbytes for v in views])
        sums: list[int | None] = [0] * len(keys)
        for i, (offset, view) in enumerate(zip(grant.offsets, views, strict=True)):
            if offset is not None:
                got = copy_checksum(self._arena[offset : offset + view.nbytes], view)
                sums[i] = got if checksums is None or checksums[i] == got else None
        if grant.reservation_id is None:
            return [WriteResult.PRESENT if p else WriteResult.FAILED for p in grant.present]
        return self.commit(grant.reservation_id, sums, verify=False)

    # ------------------------------------------------------------------ removal

    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove unpinned pages of `keys` (memory and disk); returns how many were stored.
        A pinned page is removed when its last lease goes."""
        check_keys(keys)
        removed = 0
        with self._lock:
            self._n["operations"] += 1
            for key in keys:
                page = self._pages.get(key)
                if page is not None and page.pins == 0:
                    del self._pages[key]
                    self._extents.free(page.offset)
                    removed += 1
        if self._disk is not None:
            removed += self._disk.delete(list(keys))
        return removed

    def clear(self) -> None:
        """Drop every unpinned page, memory and disk (pinned ones stay until released)."""
        with self._lock:
            for key in [k for k, p in self._pages.items() if p.pins == 0]:
                self._extents.free(self._pages.pop(key).offset)
        if self._disk is not None:
            self._disk.clear()
            with self._lock:
                self._disk_bytes.clear()

    def expire(self) -> int:
        """Drop leases and reservations past their deadline; returns how many."""
        with self._lock:
            return self._expire_locked()

    # ------------------------------------------------------------------ state

    def stats(self) -> CoreStats:
        disk = self._disk.stats() if self._disk is not None else None
        with self._lock:
            return CoreStats(
                memory_pages=len(self._pages),
                memory_used_bytes=self._extents.used_bytes,
                memory_capacity_bytes=self._extents.capacity_bytes,
                disk_pages=disk.num_pages if disk else 0,
                disk_used_bytes=disk.used_bytes if disk else 0,
                disk_capacity_bytes=disk.capacity_bytes if disk else 0,
                active_leases=len(self._leases),
                active_reservations=len(self._reservations),
                **self._n,
            )

    def lru_keys(self) -> list[bytes]:
        with self._lock:
            return list(self._pages)

    def check_integrity(self) -> None:
        with self._lock:
            self._extents.check_integrity()
            held = [p for p in self._pages.values()] + list(self._reserved.values())
            assert sum(aligned(p.size) for p in held) == self._extents.used_bytes, (
                "arena bytes in use differ from the pages and reservations holding them"
            )
            assert len({p.offset for p in held}) == len(held), "two pages share an arena range"
            assert not set(self._pages) & set(self._reserved), "a key both stored and reserved"
            pins: dict[bytes, int] = {}
            for lease in self._leases.values():
                for key in lease.pins:
                    pins[key] = pins.get(key, 0) + 1
            for key, page in self._pages.items():
                assert page.pins == pins.get(key, 0), f"page {key.hex()[:12]} pin count drifted"
            assert set(pins) <= set(self._pages), "a lease pins a page that is not stored"
            reserved = [k for r in self._reservations.values() for k in r.pins]
            assert sorted(reserved) == sorted(self._reserved), "reservations out of sync"
            for key, page in self._pages.items():
                data = self._arena[page.offset : page.offset + page.size]
                assert checksum(data) == page.checksum, f"page {key.hex()[:12]} bytes changed"
            memory_keys = list(self._pages)
        if self._disk is not None:
            self._disk.check_integrity()
            assert not any(self._disk_mask(memory_keys)), "a page is both in memory and on disk"

    # ------------------------------------------------------------------ internals

    def _disk_mask(self, keys: list[bytes]) -> list[bool]:
        assert self._disk is not None, "_disk_mask needs a disk"
        mask: list[bool] = []
        lo = 0
        while lo < len(keys):  # batch_exists counts a run of present keys; a miss ends it
            run = self._disk.batch_exists(keys[lo:])
            mask += [True] * run
            lo += run
            if lo < len(keys):
                mask.append(False)
                lo += 1
        return mask

    def _promote(self, keys: list[bytes]) -> set[bytes]:
        """Bring disk pages of `keys` back into memory (a miss where there is no room);
        returns the keys brought back."""
        if self._disk is None or not keys:
            return set()
        promoted: set[bytes] = set()
        for key in keys:
            with self._lock:
                spilled = self._disk_bytes.get(key)
                if spilled is None or key in self._pages or key in self._reserved:
                    continue
                size, want = spilled
                offset = self._room_locked(size)
                if offset is None:
                    continue
                self._reserved[key] = _Page(offset, size, 0)
            view = self._arena[offset : offset + size]
            ok = self._disk.batch_get([key], [view])[0]
            # A page damaged in the arena before it spilled (commits take the writer's checksum)
            # was written to disk with its damage: it must not come back as good.
            damaged = ok and checksum(view) != want
            with self._lock:
                page = self._reserved.pop(key)
                self._disk_bytes.pop(key, None)
                if damaged:
                    self._n["checksum_failures"] += 1
                if not ok or damaged:
                    self._extents.free(offset)
                else:
                    page.checksum = want
                    self._pages[key] = page
                    promoted.add(key)
            if ok:
                self._disk.delete([key])
        return promoted

    def _disk_bytes_pruned(self) -> dict[bytes, tuple[int, int]]:
        """The payload sizes of the pages the disk still holds (it evicts on its own)."""
        assert self._disk is not None, "_disk_bytes_pruned needs a disk"
        return {k: self._disk_bytes[k] for k in self._disk.lru_keys() if k in self._disk_bytes}

    def _room_locked(self, size: int) -> int | None:
        """An arena offset for `size` bytes, spilling LRU unpinned pages until one fits."""
        if aligned(size) > self._extents.capacity_bytes:
            return None
        offset = self._extents.alloc(size)
        while offset is None:
            victim = next((k for k, p in self._pages.items() if p.pins == 0), None)
            if victim is None:
                return None
            self._spill_locked(victim)
            offset = self._extents.alloc(size)
        return offset

    def _watermark_locked(self) -> None:
        cap = self._extents.capacity_bytes
        if self._extents.used_bytes <= self.params.high_watermark * cap:
            return
        for key in [k for k, p in self._pages.items() if p.pins == 0]:
            if self._extents.used_bytes <= self.params.low_watermark * cap:
                break
            self._spill_locked(key)

    def _spill_locked(self, key: bytes) -> None:
        """Move an unpinned page to disk (or drop it: no disk, or the disk refused it)."""
        page = self._pages.pop(key)
        stored = False
        if self._disk is not None:
            data = self._arena[page.offset : page.offset + page.size]
            stored = self._disk.batch_set([key], [data])[0]
        self._extents.free(page.offset)
        self._n["spills" if stored else "drops"] += 1
        if stored:
            self._disk_bytes[key] = (page.size, page.checksum)
            if len(self._disk_bytes) > 2 * len(self._disk_bytes_pruned()) + 1024:
                self._disk_bytes = self._disk_bytes_pruned()

    def _unpin_locked(self, keys: list[bytes]) -> None:
        for key in keys:
            page = self._pages.get(key)
            assert page is not None and page.pins > 0, f"unpin of unpinned {key.hex()[:12]}"
            page.pins -= 1

    def _expire_locked(self) -> int:
        now = self._clock()
        gone = 0
        for lid in [i for i, p in self._leases.items() if p.deadline <= now]:
            self._unpin_locked(self._leases.pop(lid).pins)
            gone += 1
        for rid in [i for i, p in self._reservations.items() if p.deadline <= now]:
            for key in self._reservations.pop(rid).pins:
                self._extents.free(self._reserved.pop(key).offset)
            gone += 1
        self._n["expired"] += gone
        return gone
