"""The shared-memory arena of one node's store: a file (under /dev/shm by default) that the store
actor maps and sizes, and that engine processes on the same node map too, so a same-node get is
one memcpy out of the mapping instead of a serialised message.

The store owns the layout: `Extents` hands out aligned byte ranges of the arena, first fit,
and merges neighbouring free ranges when a range is freed.

    arena:  |==page a==|....free....|==page b==|==reserved==|......free......|
            0          ^ free list holds (offset, size) of each '....' run, sorted, merged

Cost: alloc O(free runs) (first fit over a short list in practice: pages are a few sizes),
free O(log runs) + O(runs) list insert.
"""

from __future__ import annotations

import bisect
import ctypes
import logging
import mmap
import os
import threading
from pathlib import Path

from kvstrata.l3_store.errors import ArenaMismatch, InvalidStoreConfig

_log = logging.getLogger(__name__)

#: Pages start on this boundary: memcpy runs at full speed on aligned rows, and a page never
#: shares a cache line with its neighbour.
ALIGNMENT = 4096


#: madvise advice that allocates the file's pages (where missing) and fills this mapping's page
#: table for a range, writable, in one call (Linux >= 5.14; older kernels refuse it: EINVAL).
MADV_POPULATE_WRITE = 23
#: Bytes one populate call covers: `close` waits for at most one call.
POPULATE_CHUNK = 64 << 20


def aligned(size: int) -> int:
    """`size` rounded up to the arena alignment (a 0-byte page still takes one unit)."""
    return max(ALIGNMENT, -(-size // ALIGNMENT) * ALIGNMENT)


class Extents:
    """Aligned byte ranges of a region of `capacity_bytes`: alloc(size) -> offset | None."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < ALIGNMENT or capacity_bytes % ALIGNMENT:
            raise InvalidStoreConfig(
                f"arena capacity must be a positive multiple of {ALIGNMENT}, got {capacity_bytes}"
            )
        self.capacity_bytes = capacity_bytes
        self._free_offsets: list[int] = [0]  # sorted
        self._free_sizes: dict[int, int] = {0: capacity_bytes}
        self._used: dict[int, int] = {}  # offset -> aligned size
        self.used_bytes = 0

    def alloc(self, size: int) -> int | None:
        """An offset of `aligned(size)` free bytes, or None (nothing changes) when no free run
        is long enough."""
        need = aligned(size)
        for i, offset in enumerate(self._free_offsets):
            run = self._free_sizes[offset]
            if run < need:
                continue
            del self._free_sizes[offset]
            if run == need:
                del self._free_offsets[i]
            else:
                self._free_offsets[i] = offset + need
                self._free_sizes[offset + need] = run - need
            self._used[offset] = need
            self.used_bytes += need
            return offset
        return None

    def free(self, offset: int) -> None:
        """Give back the range that starts at `offset`, merging it with free neighbours."""
        size = self._used.pop(offset)
        self.used_bytes -= size
        i = bisect.bisect_left(self._free_offsets, offset)
        end = offset + size
        if i < len(self._free_offsets) and self._free_offsets[i] == end:  # merge the next run
            size += self._free_sizes.pop(end)
            del self._free_offsets[i]
        if i > 0:
            prev = self._free_offsets[i - 1]
            if prev + self._free_sizes[prev] == offset:  # merge into the previous run
                self._free_sizes[prev] += size
                return
        self._free_offsets.insert(i, offset)
        self._free_sizes[offset] = size

    def largest_free(self) -> int:
        return max(self._free_sizes.values(), default=0)

    def check_integrity(self) -> None:
        assert self._free_offsets == sorted(self._free_sizes), "free offsets out of sync"
        runs = [(o, self._free_sizes[o]) for o in self._free_offsets]
        runs += sorted(self._used.items())
        runs.sort()
        cursor = 0
        for offset, size in runs:
            assert offset == cursor, f"gap or overlap at {offset} (expected {cursor})"
            assert size > 0 and size % ALIGNMENT == 0, f"range at {offset} of size {size}"
            cursor += size
        assert cursor == self.capacity_bytes, "ranges do not cover the arena"
        for a, b in zip(self._free_offsets, self._free_offsets[1:], strict=False):
            assert a + self._free_sizes[a] < b, f"free runs at {a} and {b} were not merged"
        assert self.used_bytes == sum(self._used.values()), "used_bytes out of sync"


class ArenaFile:
    """A file of `size_bytes` mapped read-write. The store creates it (`create`); same-node
    clients open it (`open`) and check its size against what the store reported.

    `populate`: a background thread makes every page of the mapping present and writable,
    chunk by chunk (MADV_POPULATE_WRITE), so that copies into and out of the arena never fault:
    the first touch of a 4 KiB page of a tmpfs mapping (allocating it, zeroing it and mapping
    it) cost 3-7x the memcpy of its bytes on the 2-core VM the figures come from (README
    "Figures"). The store's thread allocates the file's memory up front (the `--store-bytes`
    budget becomes resident as the store starts, and a /dev/shm too small for it shows at once
    in the log instead of as a SIGBUS at the first write past its end); a client's only fills
    its own page table (8 bytes per 4 KiB of arena)."""

    def __init__(self, path: Path, size_bytes: int, *, create: bool, populate: bool = True) -> None:
        self.path = path
        self.size_bytes = size_bytes
        flags = os.O_RDWR | (os.O_CREAT | os.O_TRUNC if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, size_bytes)
            elif os.fstat(fd).st_size != size_bytes:
                raise ArenaMismatch(
                    f"{path} has {os.fstat(fd).st_size} bytes, its store says {size_bytes}"
                )
            self.map = mmap.mmap(fd, size_bytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.view = memoryview(self.map)
        self._closed = False
        self._map_lock = threading.Lock()  # held per populate call, and by close
        #: Set when the whole mapping is populated (or populating stopped: closed, refused).
        self.populated = threading.Event()
        if populate and size_bytes:
            threading.Thread(target=self._populate, name="l3-arena-populate", daemon=True).start()
        else:
            self.populated.set()

    def _populate(self) -> None:
        try:
            madvise = ctypes.CDLL(None, use_errno=True).madvise
            madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
            with self._map_lock:
                if self._closed:
                    return
                anchor = ctypes.c_char.from_buffer(self.map)
                base = ctypes.addressof(anchor)
                del anchor  # releases the buffer export (close needs none left)
            for lo in range(0, self.size_bytes, POPULATE_CHUNK):
                with self._map_lock:  # ctypes calls run without the GIL
                    if self._closed:
                        return
                    rc = madvise(base + lo, min(POPULATE_CHUNK, self.size_bytes - lo),
                                 MADV_POPULATE_WRITE)  # fmt: skip
                if rc != 0:
                    _log.info(
                        "arena %s not populated past %d bytes: %s (pages fault in on first use)",
                        self.path, lo, os.strerror(ctypes.get_errno()),
                    )  # fmt: skip
                    return
        finally:
            self.populated.set()

    def close(self) -> None:
        """Unmap. A slice of `view` still alive elsewhere keeps the mapping until it is
        collected (mmap refuses to close under exported buffers); the mapping then goes with
        the last slice."""
        with self._map_lock:
            self._closed = True
            try:
                self.view.release()
                self.map.close()
            except BufferError:
                _log.debug("arena %s still has live slices; unmapped when they go", self.path)

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)
