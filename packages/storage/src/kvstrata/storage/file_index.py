"""This process's view of the pages on a FileStorage directory, and the evictions that keep
the directory within its capacity.

The index maps page paths (of every namespace: capacity is the directory's) to their file bytes,
least recently used first. It is a view, not the truth: another process may have removed a page
it names (found out by a stat when it is picked for eviction, or by a reader) or written pages it
does not name yet (adopted when read, or by a rescan when the index cannot make room). Every
change of the directory's bytes goes through the ledger (`ledger.py`).

Not thread-safe on its own: methods ending in `_locked` run under the owning storage's lock, and
those that evict, remove or reserve under the ledger's lock too.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections import OrderedDict
from dataclasses import KW_ONLY, dataclass, field
from typing import NamedTuple

from kvstrata.storage.directory import PageFile, is_orphan, legacy_files, scan
from kvstrata.storage.file_format import unlink_quietly
from kvstrata.storage.ledger import DirectoryLedger

#: At most one rescan of the directory this often, when this process's index cannot make room.
RESCAN_INTERVAL_S = 0.05

_log = logging.getLogger(__name__)


class Room(NamedTuple):
    """What `PageIndex.make_room_locked` found: whether the bytes fit once the victims are gone, and
    the victims (already out of the index; the caller unlinks or recycles their files)."""

    fits: bool
    victims: list[tuple[str, int]]  # (page path, file bytes)


@dataclass(eq=False)
class PageIndex:
    """Page path -> file bytes in LRU order, the paths this process is writing, and eviction
    (the caller counts the victims of each `Room`)."""

    root: str
    _: KW_ONLY
    capacity_bytes: int
    ledger: DirectoryLedger
    write_timeout_s: float
    entries: OrderedDict[str, int] = field(default_factory=OrderedDict[str, int], init=False)
    indexed_bytes: int = field(default=0, init=False)
    #: Paths a batch_set of ours is writing (admitted, not yet indexed) -> how many batches:
    #: a reader that finds such a page already renamed into place leaves it to the writer.
    writing: dict[str, int] = field(default_factory=dict[str, int], init=False)
    _last_rescan: float = field(default=0.0, init=False)

    def put_locked(self, path: str, size: int) -> None:
        """Index `path` as the most recently used page (replacing an entry of the same path)."""
        self.forget_locked(path)
        self.entries[path] = size
        self.indexed_bytes += size

    def adopt_locked(self, path: str, size: int, *, touch: bool) -> None:
        """Index a page found on disk (no bytes change hands: the ledger counted it when it
        was reserved), unless a batch of ours is writing it (its writer indexes it) or it is
        gone (a writer of ours may have evicted it since it was read: one stat)."""
        if path in self.entries:
            if touch:
                self.entries.move_to_end(path)
            return
        if path in self.writing or not os.path.exists(path):
            return
        self.entries[path] = size
        self.indexed_bytes += size

    def mark_writing_locked(self, path: str) -> None:
        self.writing[path] = self.writing.get(path, 0) + 1

    def evictable_bytes_locked(self, protect: frozenset[str]) -> int:
        return sum(b for p, b in self.entries.items() if p not in protect)

    def forget_locked(self, path: str) -> None:
        """Under the lock: drop an index entry (the caller removes or has removed its file)."""
        size = self.entries.pop(path, None)
        if size is not None:
            self.indexed_bytes -= size

    def remove_locked(self, path: str, *, same_as: os.stat_result | None) -> bool:
        """Under both locks: unlink the regular file at `path` (only if it is `same_as`, when
        given) and take its bytes off the ledger; whether it did."""
        try:
            current = os.lstat(path)
        except FileNotFoundError:
            return False
        if not stat.S_ISREG(current.st_mode):
            return False
        if same_as is not None and (current.st_ino, current.st_dev) != (
            same_as.st_ino,
            same_as.st_dev,
        ):
            return False
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False  # removed by a process outside the ledger
        except OSError as exc:
            _log.warning("cannot remove %s: %s", path, exc)
            return False
        self.ledger.add(-min(current.st_size, self.ledger.used_bytes))
        return True

    def make_room_locked(self, size: int, *, protect: frozenset[str], rescan: bool = True) -> Room:
        """Under both locks: find least recently used pages not in `protect` whose files free
        enough bytes for `size` more in the directory (each one stat'ed: a page another process
        removed frees nothing, and its entry is dropped), and take them out of the index.
        Evicts nothing when that cannot make enough room; then, if this process's index ran
        out, rescans the directory once (at most every RESCAN_INTERVAL_S) and tries again."""
        need = self.ledger.used_bytes + size - self.capacity_bytes
        if need <= 0:
            return Room(True, [])
        if size > self.capacity_bytes:
            return Room(False, [])
        victims: list[tuple[str, int]] = []
        gone: list[str] = []
        for path in self.entries:
            if path in protect:
                continue
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                gone.append(path)
                continue
            victims.append((path, st.st_size))
            need -= st.st_size
            if need <= 0:
                break
        for path in gone:
            self.forget_locked(path)
        if need > 0:
            if rescan and time.monotonic() - self._last_rescan >= RESCAN_INTERVAL_S:
                self._last_rescan = time.monotonic()
                if self.scan_locked():
                    return self.make_room_locked(size, protect=protect, rescan=False)
            return Room(False, [])
        for path, _size in victims:
            self.forget_locked(path)
        return Room(True, victims)

    def take_room_locked(self, room: Room, size: int, *, temp: str | None) -> bool:
        """Under both locks: evict `room.victims` and reserve `size` bytes in the ledger. The
        first victim no larger than the new page is recycled (renamed to `temp`, the new page's
        temp file, which then never holds more bytes than reserved); the others are unlinked.
        Whether a file now sits at `temp`."""
        freed = 0
        recycled = False
        for path, victim_bytes in room.victims:
            if temp is not None and not recycled and victim_bytes <= size:
                try:
                    try:
                        os.rename(path, temp)
                    except FileNotFoundError:
                        if not os.path.lexists(path):
                            continue  # removed by a process outside the ledger
                        os.makedirs(os.path.dirname(temp), exist_ok=True)  # first use
                        os.rename(path, temp)
                    recycled = True
                    freed += victim_bytes
                    continue
                except OSError as exc:
                    _log.warning("cannot recycle %s: %s", path, exc)
            if self.remove_locked(path, same_as=None):
                continue  # _remove_locked took its bytes off the ledger
        self.ledger.add(size - freed)
        return recycled

    def rebuild_locked(self) -> int:
        """Under both locks, for the first storage to open the directory: remove every temp
        file (no other storage has the directory open, so none is being written) and the files
        of the old layout, index every page, and return their bytes (the ledger's new value)."""
        for path in legacy_files(self.root):
            unlink_quietly(path)
        pages, temps = scan(self.root)
        for temp in temps:
            unlink_quietly(temp.path)
        self.index_found(pages)
        return sum(page.size for page in pages)

    def scan_locked(self) -> bool:
        """Under the lock: index the pages on disk this process does not know (at the least
        recently used end, oldest first: pages this process never used go first), and reclaim
        orphaned temp files (their bytes stay in the ledger until the next rebuild: a killed
        writer's reservation cannot be told apart from a live one's). Whether it found any."""
        pages, temps = scan(self.root)
        now = time.time()
        for temp in temps:
            if is_orphan(temp.path, now, self.write_timeout_s):
                unlink_quietly(temp.path)
        new = [p for p in pages if p.path not in self.entries and p.path not in self.writing]
        self.index_found(new)
        return bool(new)

    def index_found(self, pages: list[PageFile]) -> None:
        for page in sorted(pages, key=lambda p: p.used_at, reverse=True):
            self.entries[page.path] = page.size
            self.entries.move_to_end(page.path, last=False)
            self.indexed_bytes += page.size

    def unmark_writing_locked(self, path: str) -> None:
        left = self.writing[path] - 1
        if left:
            self.writing[path] = left
        else:
            del self.writing[path]
