"""FileStorage: one file per page under a directory, shared by every process that opens it.

Layout (`ab` = first byte of the key in hex, fan-out so no directory holds millions of files):

    <root>/ab/ab12...ef.page             a complete page: header + payload
    <root>/ab/.ab12...ef.<pid>.<n>.tmp   a page being written (never read)

Page file = msgpack header `[b"KVSP", FORMAT_VERSION, namespace fingerprint (16 bytes),
payload length, crc32 of the payload (4 bytes, little-endian)]`, then the payload. The crc is
packed as fixed-width bytes so that every page of one size has one file size. A page is written
to its temp file and renamed over its final name, so a reader sees either no page or a whole
one; a page whose header, length or checksum does not check out is removed and is a miss.

The checksum is zlib.crc32: it guards against torn and damaged files, not against someone who can
write the directory (they could write a valid checksum too), so a cryptographic hash would buy
nothing and costs 3x the time here (crc32 ~3.5 GB/s against sha256 ~1.2 GB/s on this machine).
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import os
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal, NamedTuple, TypeAlias

import msgpack

from kvstrata.storage.base import Occupancy, Storage, WriteResult
from kvstrata.storage.errors import (
    BufferSizeMismatch,
    InvalidParameter,
    StorageDirectoryError,
)

FsyncPolicy: TypeAlias = Literal["never", "page", "batch"]
FSYNC_POLICIES: tuple[str, ...] = ("never", "page", "batch")

MAGIC = b"KVSP"
FORMAT_VERSION = 1
#: The header is at most ~40 bytes; one read of this many bytes always holds it.
_HEADER_READ_BYTES = 64
_SUFFIX = ".page"
#: A temp file this old is an orphan even if its pid looks alive (pids are reused).
STALE_TEMP_S = 3600.0
#: 2 hex characters per key byte plus the suffix must fit in a 255-byte file name.
MAX_KEY_BYTES = 120

_log = logging.getLogger(__name__)


def namespace_fingerprint(namespace: bytes | str) -> bytes:
    """16 bytes naming the layout a page was written for (model, dtype, page size, ...)."""
    data = namespace.encode("utf-8") if isinstance(namespace, str) else bytes(namespace)
    return hashlib.sha256(b"kvstrata.storage.file-namespace\x00" + data).digest()[:16]


def encode_header(fingerprint: bytes, payload_bytes: int, crc32: int) -> bytes:
    crc = crc32.to_bytes(4, "little")
    packed = msgpack.packb([MAGIC, FORMAT_VERSION, fingerprint, payload_bytes, crc])
    assert isinstance(packed, bytes), "msgpack.packb returns bytes without a stream"
    return packed


class _Temp(NamedTuple):
    """A page written to its temp file, not yet renamed over its final name."""

    fd: int
    path: str


class _Staged(NamedTuple):
    position: int
    key: bytes
    temp: _Temp
    path: str
    size: int


class _Probe(NamedTuple):
    """An open page file whose header was read. `valid` is False when any header check failed
    (then the other fields are zero)."""

    fd: int
    valid: bool
    header_bytes: int
    payload_bytes: int
    crc32: int


class FileStorage(Storage):
    """Pages as files under `path`, with a byte capacity over this process's view of them.

    - `capacity_bytes` counts whole files (header included). The index of pages (LRU order) is
      rebuilt at construction by scanning the directory, oldest `max(atime, mtime)` first, and
      pages found beyond the capacity are evicted then. Pages written by another process join
      this index when this process sees them (exists or get).
    - `namespace` is the layout fingerprint: a page written under another namespace is a miss
      and is removed.
    - `fsync`: "never" (the OS decides; a machine crash may lose or damage recent pages, and
      the header checks turn damaged ones into misses), "page" (each page is fsynced with its
      directory before the call returns), "batch" (all pages of a batch are fsynced, then
      renamed, then their directories fsynced once).

    Costs per page: exists = open + 64-byte read; get = open + two reads + crc32; set = stat +
    crc32 + write of a temp file + rename (+ fsyncs by policy). Eviction unlinks files; a reader
    that already opened an evicted page still reads it whole (POSIX unlink semantics).
    """

    max_key_bytes = MAX_KEY_BYTES

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity_bytes: int,
        namespace: bytes | str = b"",
        fsync: FsyncPolicy = "never",
    ) -> None:
        if capacity_bytes < 0:
            raise InvalidParameter(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if fsync not in FSYNC_POLICIES:
            raise InvalidParameter(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        root = Path(path)
        if not root.is_dir():
            what = "is not a directory" if root.exists() else "does not exist"
            raise StorageDirectoryError(f"FileStorage directory {root} {what}")
        _probe_writable(root)
        super().__init__()
        self.path = root
        self.capacity_bytes = capacity_bytes
        self.namespace = namespace
        self.fsync: FsyncPolicy = fsync
        self._fingerprint = namespace_fingerprint(namespace)
        self._root = str(root)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, LRU first
        self._indexed_bytes = 0
        self._reserved_bytes = 0  # writes of this process in flight
        self._temp_seq = itertools.count()
        with self._lock:
            self._scan()
            self._make_room_locked(0, protect=frozenset())

    # ------------------------------------------------------------------ hooks

    def _exists_prefix(self, keys: Sequence[bytes]) -> int:
        for i, key in enumerate(keys):
            path = self._page_path(key)
            probe = self._open(path)
            if probe is None:
                self._forget(key)
                return i
            try:
                if not probe.valid:
                    self._drop_corrupt(key, path, probe.fd)
                    return i
                self._adopt(key, probe.header_bytes + probe.payload_bytes, touch=False)
            finally:
                os.close(probe.fd)
        return len(keys)

    def _get_into(self, keys: Sequence[bytes], views: list[memoryview]) -> list[bool]:
        paths = [self._page_path(key) for key in keys]
        probes: list[_Probe | None] = []
        try:
            # Phase 1: headers only, so that a wrong buffer size raises before any buffer is
            # written and any page touched.
            probes.extend(self._open(path) for path in paths)
            for key, probe, view in zip(keys, probes, views, strict=True):
                if probe is not None and probe.valid and probe.payload_bytes != view.nbytes:
                    raise BufferSizeMismatch(
                        f"page {key.hex()[:16]} has {probe.payload_bytes} bytes, "
                        f"its buffer {view.nbytes}"
                    )
            # Phase 2: payloads straight into the caller's buffers, then their checksums.
            found: list[bool] = []
            for key, path, probe, view in zip(keys, paths, probes, views, strict=True):
                if probe is None:
                    self._forget(key)
                    found.append(False)
                elif probe.valid and self._read_payload(probe, view):
                    self._adopt(key, probe.header_bytes + probe.payload_bytes, touch=True)
                    found.append(True)
                else:
                    self._drop_corrupt(key, path, probe.fd)
                    found.append(False)
            return found
        finally:
            for probe in probes:
                if probe is not None:
                    os.close(probe.fd)

    def _set_from(self, keys: Sequence[bytes], views: list[memoryview]) -> list[WriteResult]:
        batch = frozenset(keys)
        results: list[WriteResult] = []
        staged: list[_Staged] = []  # fsync "batch": renamed together at the end
        for key, view in zip(keys, views, strict=True):
            path = self._page_path(key)
            if self._is_present(key, path):
                results.append(WriteResult.PRESENT)
                continue
            header = encode_header(self._fingerprint, view.nbytes, zlib.crc32(view))
            size = len(header) + view.nbytes
            with self._lock:
                reserved = self._make_room_locked(size, protect=batch)
                if reserved:
                    self._reserved_bytes += size
            if not reserved:
                results.append(WriteResult.FAILED)
                continue
            temp = self._write_temp(key, path, header, view)
            if temp is None:
                self._release(size)
                results.append(WriteResult.FAILED)
            elif self.fsync == "batch":
                staged.append(_Staged(len(results), key, temp, path, size))
                results.append(WriteResult.WRITTEN)
            else:
                ok = self._publish(key, temp, path, size)
                results.append(WriteResult.WRITTEN if ok else WriteResult.FAILED)
        if staged:
            dirs: set[str] = set()
            for page in staged:
                if self._publish(page.key, page.temp, page.path, page.size):
                    dirs.add(os.path.dirname(page.path))
                else:
                    results[page.position] = WriteResult.FAILED
            for directory in dirs:
                _fsync_dir(directory)
        return results

    def _delete(self, keys: Sequence[bytes]) -> int:
        removed = 0
        for key in keys:
            self._forget(key)
            path = self._page_path(key)
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass  # deleted by another process, or never stored
            except OSError as exc:
                _log.warning("cannot remove page %s: %s", path, exc)
        return removed

    def _clear(self) -> None:
        with self._lock:
            for _key, path, _stat in self._page_files():
                _unlink_quietly(path)
            self._index.clear()
            self._indexed_bytes = 0

    def _occupancy(self) -> Occupancy:
        with self._lock:
            used = self._indexed_bytes + self._reserved_bytes
            return Occupancy(len(self._index), used, self.capacity_bytes)

    # ------------------------------------------------------------------ public helpers

    def page_file_bytes(self, payload_bytes: int) -> int:
        """Bytes a page of `payload_bytes` takes against the capacity (header included)."""
        return len(encode_header(self._fingerprint, payload_bytes, 0)) + payload_bytes

    def lru_keys(self) -> list[bytes]:
        """Indexed keys from least to most recently used (a copy; for tests and debugging)."""
        with self._lock:
            return list(self._index)

    def check_integrity(self) -> None:
        """Assert the accounting, and that every indexed page is on disk at its indexed size.
        Files on disk that are not indexed are allowed (another process may have written them).
        Cost: one stat per indexed page."""
        with self._lock:
            total = sum(self._index.values())
            assert total == self._indexed_bytes, (
                f"indexed_bytes {self._indexed_bytes} != sum of page sizes {total}"
            )
            assert self._reserved_bytes >= 0, "a write released more than it reserved"
            used = self._indexed_bytes + self._reserved_bytes
            assert used <= self.capacity_bytes, (
                f"used {used} > capacity {self.capacity_bytes}: _make_room_locked made too "
                "little room"
            )
            for key, size in self._index.items():
                on_disk = os.stat(self._page_path(key)).st_size
                assert on_disk == size, f"page {key.hex()} is {on_disk} bytes, indexed {size}"

    # ------------------------------------------------------------------ internals

    def _page_path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self._root, name[:2], name + _SUFFIX)

    def _open(self, path: str) -> _Probe | None:
        """Open a page file and check its header; None when it is missing or unreadable."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            _log.warning("cannot open page %s: %s", path, exc)
            return None
        try:
            file_bytes = os.fstat(fd).st_size
            head = os.pread(fd, _HEADER_READ_BYTES, 0)
        except OSError as exc:
            os.close(fd)
            _log.warning("cannot read page %s: %s", path, exc)
            return None
        unpacker = msgpack.Unpacker()
        unpacker.feed(head)
        try:
            fields = unpacker.unpack()
        except (msgpack.OutOfData, msgpack.FormatError, msgpack.StackError, ValueError):
            return _Probe(fd, False, 0, 0, 0)
        header_bytes = unpacker.tell()
        if (
            isinstance(fields, list)
            and len(fields) == 5
            and fields[0] == MAGIC
            and fields[1] == FORMAT_VERSION
            and fields[2] == self._fingerprint
            and isinstance(fields[3], int)
            and isinstance(fields[4], bytes)
            and len(fields[4]) == 4
            and header_bytes + fields[3] == file_bytes
        ):
            return _Probe(fd, True, header_bytes, fields[3], int.from_bytes(fields[4], "little"))
        return _Probe(fd, False, 0, 0, 0)

    def _read_payload(self, probe: _Probe, view: memoryview) -> bool:
        done = 0
        try:
            while done < probe.payload_bytes:
                n = os.preadv(probe.fd, [view[done:]], probe.header_bytes + done)
                if n == 0:
                    return False  # truncated under us
                done += n
        except OSError as exc:
            _log.warning("cannot read page payload: %s", exc)
            return False
        return zlib.crc32(view) == probe.crc32

    def _drop_corrupt(self, key: bytes, path: str, fd: int) -> None:
        """Remove a page that failed a check, unless another writer has replaced the file
        since we opened it (then the new file is not ours to judge)."""
        opened = os.fstat(fd)
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        same_file = current is not None and (current.st_ino, current.st_dev) == (
            opened.st_ino,
            opened.st_dev,
        )
        if same_file:
            _unlink_quietly(path)
        self._forget(key)
        self._count_corrupt(1)

    def _is_present(self, key: bytes, path: str) -> bool:
        """Whether the page file exists (the disk, not the index, is the truth: another
        process may have written or evicted it)."""
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            self._forget(key)
            return False
        except OSError as exc:  # the write that follows will fail and report it
            _log.warning("cannot stat page %s: %s", path, exc)
            return False
        self._adopt(key, size, touch=True)
        return True

    def _forget(self, key: bytes) -> None:
        """Drop an index entry whose file is gone (removed by another process)."""
        with self._lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._indexed_bytes -= size

    def _adopt(self, key: bytes, size: int, *, touch: bool) -> None:
        with self._lock:
            if key in self._index:
                if touch:
                    self._index.move_to_end(key)
                return
            self._index[key] = size
            self._indexed_bytes += size
            self._make_room_locked(0, protect=frozenset((key,)))

    def _write_temp(self, key: bytes, path: str, header: bytes, view: memoryview) -> _Temp | None:
        """Write header + payload to a fresh temp file beside `path`; (fd, temp path) or None on
        an I/O error (then nothing is left behind)."""
        directory = os.path.dirname(path)
        temp = os.path.join(
            directory, f".{key.hex()[:32]}.{os.getpid()}.{next(self._temp_seq)}.tmp"
        )
        try:
            try:
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileNotFoundError:
                os.makedirs(directory, exist_ok=True)
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            _log.warning("cannot create %s: %s", temp, exc)
            return None
        try:
            _write_all(fd, header, view)
            if self.fsync == "page":
                os.fsync(fd)
        except OSError as exc:
            _log.warning("cannot write page %s: %s", path, exc)
            os.close(fd)
            _unlink_quietly(temp)
            return None
        return _Temp(fd, temp)

    def _publish(self, key: bytes, temp: _Temp, path: str, size: int) -> bool:
        """Make a written temp file the page (fsync first under "batch"); index it."""
        fd = temp.fd
        try:
            if self.fsync == "batch":
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(temp.path, path)
        except OSError as exc:
            _log.warning("cannot publish page %s: %s", path, exc)
            if fd >= 0:
                os.close(fd)
            _unlink_quietly(temp.path)
            self._release(size)
            return False
        if self.fsync == "page":
            _fsync_dir(os.path.dirname(path))
        with self._lock:
            self._reserved_bytes -= size
            if key in self._index:  # another thread of ours published it meanwhile
                self._index.move_to_end(key)
            else:
                self._index[key] = size
                self._indexed_bytes += size
        return True

    def _release(self, size: int) -> None:
        with self._lock:
            self._reserved_bytes -= size

    def _make_room_locked(self, size: int, *, protect: frozenset[bytes]) -> bool:
        """Under the lock: evict least recently used pages not in `protect` until `size` more
        bytes fit. Evicts nothing and returns False when that cannot make enough room."""
        need = self._indexed_bytes + self._reserved_bytes + size - self.capacity_bytes
        if need <= 0:
            return True
        victims: list[bytes] = []
        for key, page_bytes in self._index.items():
            if key not in protect:
                victims.append(key)
                need -= page_bytes
                if need <= 0:
                    break
        if need > 0:
            return False
        for key in victims:
            self._indexed_bytes -= self._index.pop(key)
            _unlink_quietly(self._page_path(key))
        self._count_evictions(len(victims))
        return True

    def _scan(self) -> None:
        """Rebuild the index from the directory, oldest first; remove orphaned temp files."""
        found: list[tuple[float, bytes, int]] = []
        for key, _path, st in self._page_files(remove_orphans=True):
            found.append((max(st.st_atime, st.st_mtime), key, st.st_size))
        found.sort()
        for _when, key, size in found:
            self._index[key] = size
            self._indexed_bytes += size

    def _page_files(
        self, *, remove_orphans: bool = False
    ) -> Iterator[tuple[bytes, str, os.stat_result]]:
        now = time.time()
        with os.scandir(self._root) as top:
            subdirs = [e.path for e in top if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
        for subdir in subdirs:
            with os.scandir(subdir) as entries:
                for entry in entries:
                    name = entry.name
                    if name.endswith(_SUFFIX) and not name.startswith("."):
                        try:
                            key = bytes.fromhex(name[: -len(_SUFFIX)])
                            st = entry.stat(follow_symlinks=False)
                        except (ValueError, FileNotFoundError):
                            continue  # not one of ours, or removed by another process
                        yield key, entry.path, st
                    elif (
                        remove_orphans
                        and name.startswith(".")
                        and name.endswith(".tmp")
                        and _is_orphan(name, entry.path, now)
                    ):
                        _unlink_quietly(entry.path)


def _write_all(fd: int, header: bytes, view: memoryview) -> None:
    """writev until everything is written (a regular file may take a short write)."""
    pending = [v for v in (memoryview(header), view) if v.nbytes]
    while pending:
        n = os.writev(fd, pending)
        if n == 0:
            raise OSError(errno.EIO, "writev wrote nothing")
        while n:
            if n >= pending[0].nbytes:
                n -= pending.pop(0).nbytes
            else:
                pending[0] = pending[0][n:]
                n = 0


def _fsync_dir(directory: str) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError as exc:
        _log.warning("cannot open %s to fsync it: %s", directory, exc)
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        _log.warning("cannot fsync %s: %s", directory, exc)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass  # already gone: another process removed it
    except OSError as exc:
        _log.warning("cannot remove %s: %s", path, exc)


def _is_orphan(name: str, path: str, now: float) -> bool:
    """A temp file whose writer is gone: its pid no longer runs, or it is very old."""
    try:
        pid = int(name.split(".")[2])
    except (IndexError, ValueError):
        return False  # not a temp file of ours
    try:
        if now - os.stat(path).st_mtime > STALE_TEMP_S:
            return True
    except FileNotFoundError:
        return False
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, owned by another user
    return False


def _probe_writable(root: Path) -> None:
    """Create and remove a file: permission bits lie for root and read-only mounts."""
    probe = os.path.join(root, f".probe.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        read_only = exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
        reason = "read-only" if read_only else "unusable"
        raise StorageDirectoryError(f"FileStorage directory {root} is {reason}: {exc}") from exc
    os.close(fd)
    os.unlink(probe)
