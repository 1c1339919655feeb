"""The byte accounting a FileStorage directory shares with every process that opens it.

    <root>/.kvstrata-ledger   16 bytes, mmap'ed: b"KVSL", version (u32 LE), then two u64 LE:
                              used bytes (page files + writes in flight), capacity bytes
    <root>/.kvstrata-open     flock'ed LOCK_SH by every open storage for its lifetime

Every change to the set of page files that adds or frees bytes (a reservation before a temp file
is written, an eviction, a delete, a removed corrupt page, a write that is given up) runs with
the ledger's `flock` held and updates `used` in the same critical section, so `used` bounds the
bytes of page and temp files in the directory from above at every instant: bytes are added to
`used` before they reach the disk and taken off after they have left it. Renaming a written temp
file into place moves bytes from "in flight" to "page" and changes nothing.

The process that opens the directory while no other storage has it open (it gets `.kvstrata-open`
exclusively, under the ledger lock) rebuilds `used` from a scan of the files, which undoes what
a killed process left counted (its reservations in flight). A flock is released by the kernel
when its process dies, so a killed process never blocks the others.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import struct
import threading
from collections.abc import Callable
from types import TracebackType

from kvstrata.storage.errors import StorageDirectoryError

LEDGER_NAME = ".kvstrata-ledger"
OPEN_NAME = ".kvstrata-open"
_MAGIC, _VERSION = b"KVSL", 1
_LAYOUT = struct.Struct("<4sIQQ")  # magic, version, used, capacity


class DirectoryLedger:
    """`used` and `capacity` of one directory, shared through a small mmap'ed file.

    Use as a context manager (`with ledger:`) around every read-modify-write of `used`: it takes
    a thread lock and then the file's `flock` (a flock is held per open file, so threads of one
    process need the thread lock too). Not reentrant.
    """

    def __init__(self, root: str) -> None:
        self._thread_lock = threading.Lock()
        path = os.path.join(root, LEDGER_NAME)
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            self._open_fd = os.open(os.path.join(root, OPEN_NAME), os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise StorageDirectoryError(f"cannot open the ledger of {root}: {exc}") from exc
        self._map: mmap.mmap | None = None

    def open(self, capacity_bytes: int, rebuild: Callable[[], int]) -> bool:
        """Join the directory: take `.kvstrata-open` shared for as long as this ledger lives.
        Alone (no other storage has it open): `rebuild()` (the caller's scan, which returns the
        bytes on disk) sets `used`, and `capacity_bytes` is recorded (for inspection: every
        storage enforces its own capacity against `used`). Whether this opener was alone."""
        with self:
            try:
                fcntl.flock(self._open_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                alone = True
            except BlockingIOError:
                alone = False
            if alone:
                used = rebuild()
                self._write(used, capacity_bytes)
                # Still under the ledger lock: no opener can test for "alone" in between.
                fcntl.flock(self._open_fd, fcntl.LOCK_SH)
                return True
            fcntl.flock(self._open_fd, fcntl.LOCK_SH)
            return False

    def close(self) -> None:
        """Leave the directory (the flocks go with the descriptors). Idempotent."""
        with self._thread_lock:
            if self._map is not None:
                self._map.close()
                self._map = None
            for fd in (self._fd, self._open_fd):
                if fd >= 0:
                    os.close(fd)
            self._fd = self._open_fd = -1

    def __enter__(self) -> DirectoryLedger:
        self._thread_lock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except BaseException:
            self._thread_lock.release()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    @property
    def used_bytes(self) -> int:
        """Bytes of page files plus writes in flight, over every process (read under `with`)."""
        return self._fields()[2]

    @used_bytes.setter
    def used_bytes(self, value: int) -> None:
        assert value >= 0, f"ledger used_bytes would go negative ({value}): a double release"
        self._write(value, self.capacity_bytes)

    @property
    def capacity_bytes(self) -> int:
        return self._fields()[3]

    def add(self, delta: int) -> None:
        """`used += delta` (under `with`)."""
        self.used_bytes = self.used_bytes + delta

    def _mapped(self) -> mmap.mmap:
        if self._map is None:
            if os.fstat(self._fd).st_size < _LAYOUT.size:
                os.ftruncate(self._fd, _LAYOUT.size)
            self._map = mmap.mmap(self._fd, _LAYOUT.size)
        return self._map

    def _fields(self) -> tuple[bytes, int, int, int]:
        magic, version, used, capacity = _LAYOUT.unpack_from(self._mapped(), 0)
        if (magic, version) != (_MAGIC, _VERSION):
            return _MAGIC, _VERSION, 0, 0  # a new file (zeros): set by the first opener
        return magic, version, used, capacity

    def _write(self, used: int, capacity: int) -> None:
        _LAYOUT.pack_into(self._mapped(), 0, _MAGIC, _VERSION, used, capacity)


# ---------------------------------------------------------------------- rename without replace

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)
_renameat2 = getattr(_libc, "renameat2", None)


def rename_noreplace(src: str, dst: str) -> None:
    """Rename `src` to `dst`, failing with FileExistsError if `dst` exists (atomically:
    renameat2 RENAME_NOREPLACE; link + unlink where the kernel or file system lacks it). A page
    is never replaced in place, so a reader that finds a file at a page path and the same file
    there later knows nobody swapped it, and no write frees bytes the ledger still counts."""
    if _renameat2 is not None:
        rc = _renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE)
        if rc == 0:
            return
        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS):
            raise OSError(err, os.strerror(err), dst)
    os.link(src, dst)  # FileExistsError if dst exists
    os.unlink(src)
