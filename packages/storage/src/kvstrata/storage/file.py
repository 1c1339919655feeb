"""FileStorage: one file per page under a directory, shared by every process that opens it.

Layout (`ab` = first byte of the key in hex, fan-out so no directory holds millions of files):

    <root>/ab/ab12...ef.page             a complete page: header + payload
    <root>/ab/.ab12...ef.<pid>.<n>.tmp   a page being written (never read)

Page file = a 64-byte msgpack header `[b"KVSP", FORMAT_VERSION, namespace fingerprint (16 bytes),
key id (16 bytes: xxh3_128 of the key), payload length (8 bytes LE), xxh3_64 of the payload
(8 bytes LE)]`, then the payload. Every field has a fixed width, so the header has one length and
its fields sit at fixed offsets: a reader compares the constant prefix (magic, version,
namespace) and the key id, and slices the two integers out, without running a msgpack decoder
per page (any msgpack reader still decodes it). A page is written to its temp file and renamed
over its final name, so a reader sees either no page or a whole one; a page whose header, key,
length or checksum does not check out (including a page of another format version) is removed
and is a miss.

A write that has to evict reuses the evicted page's file as its temp file (renamed, rewritten
in place, truncated if the sizes differ) instead of unlinking one inode and allocating another:
creating and unlinking are the costly file system operations (~0.1-3 ms each on the ext4 this
was measured on, against ~50 us for a rename and ~30 us to rewrite 64 KiB), so a full tier
writes at rename speed. The key id is what makes that safe: a reader that opened the victim
before it was recycled reads another key's header (a miss) or a payload that fails its
checksum (a miss), never another page's bytes as its own.

The checksum is xxh3_64 (the `xxhash` package): it guards against torn and damaged files, not
against someone who can write the directory (they could write a valid checksum too), so a
cryptographic hash would buy nothing. xxh3 runs at ~10-14 GB/s here against ~2-3.5 GB/s for
zlib.crc32 and ~1.2 GB/s for sha256, which matters because the checksum pass is the one CPU cost
of a read that plain file I/O does not have.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, NamedTuple, TypeAlias

import msgpack
import xxhash

from kvstrata.storage.base import Occupancy, Storage, WriteResult
from kvstrata.storage.errors import (
    BufferSizeMismatch,
    InvalidParameter,
    StorageDirectoryError,
)
from kvstrata.storage.parallel import BatchRunner

FsyncPolicy: TypeAlias = Literal["never", "page", "batch"]
FSYNC_POLICIES: tuple[str, ...] = ("never", "page", "batch")

MAGIC = b"KVSP"
#: 1: variable-width header with a crc32; 2: fixed-width header with an xxh3_64. A page of any
#: other version is a miss and is removed (its key simply gets written again).
FORMAT_VERSION = 2
_SUFFIX = ".page"
#: A temp file this old is an orphan even if its pid looks alive (pids are reused).
STALE_TEMP_S = 3600.0
#: Threads a batch call spreads its pages' file I/O over (the caller's included).
DEFAULT_IO_THREADS = 4
#: 2 hex characters per key byte plus the suffix must fit in a 255-byte file name.
MAX_KEY_BYTES = 120

_log = logging.getLogger(__name__)


def namespace_fingerprint(namespace: bytes | str) -> bytes:
    """16 bytes naming the layout a page was written for (model, dtype, page size, ...)."""
    data = namespace.encode("utf-8") if isinstance(namespace, str) else bytes(namespace)
    return hashlib.sha256(b"kvstrata.storage.file-namespace\x00" + data).digest()[:16]


def page_checksum(payload: bytes | bytearray | memoryview) -> int:
    """The checksum a page file carries for `payload` (xxh3_64, seed 0). Holds the GIL (the
    xxhash package does not release it), unlike the file system calls around it."""
    return xxhash.xxh3_64_intdigest(payload)


def key_id(key: bytes) -> bytes:
    """The 16 bytes a page file carries to name its key (xxh3_128 of the key)."""
    return xxhash.xxh3_128_digest(key)


def encode_header(fingerprint: bytes, key: bytes, payload_bytes: int, checksum: int) -> bytes:
    """The header of a page file: always HEADER_BYTES long for a 16-byte fingerprint."""
    packed = msgpack.packb(
        [
            MAGIC,
            FORMAT_VERSION,
            fingerprint,
            key_id(key),
            payload_bytes.to_bytes(8, "little"),
            checksum.to_bytes(8, "little"),
        ]
    )
    assert isinstance(packed, bytes), "msgpack.packb returns bytes without a stream"
    return packed


HEADER_BYTES = len(encode_header(bytes(16), b"", 0, 0))
#: msgpack's markers of a 16-byte and an 8-byte bin, in front of the fields of those widths.
_BIN16, _BIN8 = b"\xc4\x10", b"\xc4\x08"
#: Field offsets: [marker, magic, version, fingerprint, _BIN16][key id][_BIN8][length][_BIN8][sum]
_CHECKSUM_AT = HEADER_BYTES - 8
_LENGTH_AT = _CHECKSUM_AT - len(_BIN8) - 8
_KEY_ID_AT = _LENGTH_AT - len(_BIN8) - 16


def _check_layout() -> None:
    head = encode_header(bytes(16), b"", 0, 0)
    assert head[_KEY_ID_AT - 2 : _KEY_ID_AT] == _BIN16, "header layout: key id marker"
    assert head[_LENGTH_AT - 2 : _LENGTH_AT] == _BIN8, "header layout: length marker"
    assert head[_CHECKSUM_AT - 2 : _CHECKSUM_AT] == _BIN8, "header layout: checksum marker"


_check_layout()


class _Temp(NamedTuple):
    """A page written to its temp file, not yet renamed over its final name."""

    fd: int
    path: str


class _Room(NamedTuple):
    """What `_make_room_locked` did: whether the bytes fit now, and the evicted pages (already
    out of the index; their files are still there for the caller to unlink or recycle)."""

    fits: bool
    victims: list[tuple[bytes, int]]  # (key, file bytes)


class _Job(NamedTuple):
    """A page of a batch_set admitted (room reserved; an evicted page's file already renamed
    to `temp_path` when `recycled`). Its state: _RESERVED -> _STAGED (temp file written, fd
    open) -> _PUBLISHED (renamed into place and indexed), or -> _RELEASED (failed or unwound:
    temp file removed, reservation released)."""

    position: int  # in the batch
    key: bytes
    view: memoryview
    path: str
    temp_path: str
    recycled: bool

    @property
    def size(self) -> int:
        """File bytes reserved for the page."""
        return HEADER_BYTES + self.view.nbytes


_RESERVED, _STAGED, _PUBLISHED, _RELEASED = range(4)


@dataclass(eq=False)
class _Batch:
    """One batch_set's jobs and their states (a job's entries are only touched by the thread
    running its range, and by the caller once the runner has returned)."""

    keys: frozenset[bytes]
    jobs: list[_Job] = field(default_factory=list[_Job])
    state: list[int] = field(default_factory=list[int])
    staged: list[_Temp | None] = field(default_factory=list[_Temp | None])  # fsync "batch"
    first_job: dict[bytes, int] = field(default_factory=dict[bytes, int])  # key -> its job
    repeats: list[tuple[int, int]] = field(default_factory=list[tuple[int, int]])  # (pos, job)


class _Probe(NamedTuple):
    """An open page file whose header was read. `valid` is False when any header check failed
    (then the other fields are zero). `pending`: the header is not read yet, because it was not
    in the page cache and the read asked not to wait (`valid` is False meanwhile)."""

    fd: int
    valid: bool
    payload_bytes: int
    checksum: int
    pending: bool = False


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
    - `io_threads`: how many threads (the caller's included) a batch call spreads its pages'
      file I/O and checksums over; 1 does everything in the calling thread. Each batch runs in
      phases with a barrier between them: get = open + header checks of all pages (so a wrong
      buffer size raises before any buffer is written), then payload reads + checksums, then
      the index updates in the caller in batch order (in both read phases the caller reads
      what the page cache holds itself, with RWF_NOWAIT, and hands the threads only the
      reads that would wait for the disk); set = admission in the caller in batch
      order (presence, eviction, reservation), then checksum + temp file + rename per page in
      parallel (under "batch": write all, then fsync + rename all, then the directories).

    Costs per page (syscalls): exists = open + fstat + header pread + close; get = open +
    header pread + one preadv straight into the caller's buffer + close, then an xxh3_64 pass
    over that buffer; set = stat + xxh3_64 + create the temp file + one writev + close + rename
    (+ fsyncs by policy). A set that evicts renames the victim's file to its temp file and
    rewrites it (no inode created or freed); other evictions unlink. A reader that already
    opened an evicted page reads it whole if it was unlinked, and gets a miss if it was
    recycled (the key id and checksum in the header catch it).
    """

    max_key_bytes = MAX_KEY_BYTES

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity_bytes: int,
        namespace: bytes | str = b"",
        fsync: FsyncPolicy = "never",
        io_threads: int = DEFAULT_IO_THREADS,
    ) -> None:
        if capacity_bytes < 0:
            raise InvalidParameter(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        if fsync not in FSYNC_POLICIES:
            raise InvalidParameter(f"fsync must be one of {FSYNC_POLICIES}, got {fsync!r}")
        root = Path(path)
        if not root.is_dir():
            what = "is not a directory" if root.exists() else "does not exist"
            raise StorageDirectoryError(f"FileStorage directory {root} {what}")
        io = BatchRunner(io_threads, name="kvstrata-file-io")  # validates io_threads
        nowait = _probe_writable(root)
        super().__init__()
        self._io = io
        # Whether reads may ask not to wait (RWF_NOWAIT): off where the file system refuses
        # the flag (tmpfs on some kernels: EOPNOTSUPP), so a warm get is not tried twice.
        self._nowait = nowait
        self.io_threads = io_threads
        self.path = root
        self.capacity_bytes = capacity_bytes
        self.namespace = namespace
        self.fsync: FsyncPolicy = fsync
        self._fingerprint = namespace_fingerprint(namespace)
        # The first _KEY_ID_AT bytes of every page file of this storage: compared, not decoded.
        self._header_prefix = encode_header(self._fingerprint, b"", 0, 0)[:_KEY_ID_AT]
        self._root = str(root)
        self._lock = threading.Lock()
        # Notified whenever reserved bytes are indexed or released (see `_admit`).
        self._room_freed = threading.Condition(self._lock)
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> file bytes, LRU first
        self._indexed_bytes = 0
        self._reserved_bytes = 0  # writes of this process in flight
        # Keys a batch_set of ours is writing (admitted, not yet indexed) -> how many batches:
        # a reader that finds such a page already renamed into place leaves it to the writer.
        self._writing: dict[bytes, int] = {}
        self._temp_seq = itertools.count()
        with self._lock:
            self._scan()
            self._unlink_locked(self._make_room_locked(0, protect=frozenset()).victims)

    # ------------------------------------------------------------------ hooks

    def _exists_prefix(self, keys: Sequence[bytes]) -> int:
        for i, key in enumerate(keys):
            path = self._page_path(key)
            probe = self._open(key, path)
            if probe is None:
                self._forget_if_missing(key)
                return i
            try:
                size = HEADER_BYTES + probe.payload_bytes
                if not probe.valid or os.fstat(probe.fd).st_size != size:
                    self._drop_corrupt(key, path, probe.fd)
                    return i
                self._adopt(key, size, touch=False)
            except OSError as exc:
                _log.warning("cannot stat page %s: %s", path, exc)
                return i
            finally:
                os.close(probe.fd)
        return len(keys)

    def _get_into(self, keys: Sequence[bytes], views: list[memoryview]) -> list[bool]:
        paths = [self._page_path(key) for key in keys]
        probes: list[_Probe | None] = [None] * len(keys)
        read_ok = [False] * len(keys)
        # With several threads, this thread first reads what the page cache holds, asking the
        # kernel not to wait (RWF_NOWAIT); only what would wait goes to the I/O threads. A warm
        # batch then costs no hand-offs (they cost more than they save when the CPU, not the
        # disk, is the limit), and a cold one still has its reads overlapped.
        cache_first = self._io.threads > 1 and self._nowait

        def open_range(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                probes[i] = self._open(keys[i], paths[i])

        def header_list(indices: list[int]) -> None:
            for i in indices:
                probe = probes[i]
                assert probe is not None and probe.pending, "only pending headers are re-read"
                probes[i] = self._read_header(keys[i], paths[i], probe.fd)

        def read_list(indices: Sequence[int]) -> None:
            spare = bytearray(1)  # catches a file longer than its header says, in the same read
            for i in indices:
                probe = probes[i]
                if probe is not None and probe.valid:
                    read_ok[i] = bool(_read_payload(probe, views[i], spare))

        try:
            # Phase 1: headers only, so that a wrong buffer size raises before any buffer is
            # written and any page touched.
            if cache_first:
                for i, (key, path) in enumerate(zip(keys, paths, strict=True)):
                    probes[i] = self._open(key, path, nowait=True)
                waits = [i for i, p in enumerate(probes) if p is not None and p.pending]
                self._io.run(len(waits), lambda lo, hi: header_list(waits[lo:hi]))
            else:
                self._io.run(len(keys), open_range)
            for key, probe, view in zip(keys, probes, views, strict=True):
                if probe is not None and probe.valid and probe.payload_bytes != view.nbytes:
                    raise BufferSizeMismatch(
                        f"page {key.hex()[:16]} has {probe.payload_bytes} bytes, "
                        f"its buffer {view.nbytes}"
                    )
            # Phase 2: payloads straight into the caller's buffers and their checksums; then
            # the index, in this thread and in batch order (LRU order follows the batch).
            if cache_first:
                spare, waits = bytearray(1), []
                for i, probe in enumerate(probes):
                    if probe is not None and probe.valid:
                        ok = _read_payload(probe, views[i], spare, nowait=True)
                        if ok is None:
                            waits.append(i)
                        else:
                            read_ok[i] = ok
                self._io.run(len(waits), lambda lo, hi: read_list(waits[lo:hi]))
            else:
                self._io.run(len(keys), lambda lo, hi: read_list(range(lo, hi)))
            found: list[bool] = []
            for key, path, probe, ok in zip(keys, paths, probes, read_ok, strict=True):
                if probe is None:
                    self._forget_if_missing(key)
                    found.append(False)
                elif ok:
                    self._adopt(key, HEADER_BYTES + probe.payload_bytes, touch=True)
                    found.append(True)
                else:
                    assert not probe.pending, "a header left unread would pass for corrupt"
                    self._drop_corrupt(key, path, probe.fd)
                    found.append(False)
            return found
        finally:
            for probe in probes:
                if probe is not None:
                    os.close(probe.fd)

    def _set_from(self, keys: Sequence[bytes], views: list[memoryview]) -> list[WriteResult]:
        results = [WriteResult.FAILED] * len(keys)
        batch = _Batch(frozenset(keys))
        # Admission in this thread and batch order (presence, eviction of least recently used
        # pages, reservation), then the admitted pages written on the I/O threads; a page is
        # indexed as soon as it is renamed into place, so other batches can evict it. When a
        # page finds no room only because other batches hold reservations, the pages admitted
        # so far are written first (they are protected anyway), and then, holding nothing,
        # this batch waits for the others to index theirs: a page fails for lack of room only
        # when evicting every page it may evict cannot make room.
        try:
            position = 0
            while position < len(keys):
                lo = len(batch.jobs)
                position = self._admit(keys, views, position, batch, results)
                self._write_jobs(batch, lo)
        finally:
            # Also after an unexpected exception (MemoryError, KeyboardInterrupt, a pool that
            # cannot start): temp files closed and removed, every reservation released.
            self._finish_jobs(batch)
            for job, state in zip(batch.jobs, batch.state, strict=True):
                if state == _PUBLISHED:
                    results[job.position] = WriteResult.WRITTEN
            for position, j in batch.repeats:
                published = batch.state[j] == _PUBLISHED
                results[position] = WriteResult.PRESENT if published else WriteResult.FAILED
            self._touch_batch(keys, results)
        return results

    def _admit(
        self,
        keys: Sequence[bytes],
        views: list[memoryview],
        position: int,
        batch: _Batch,
        results: list[WriteResult],
    ) -> int:
        """Admit pages from `position` on, in batch order, into `batch.jobs` (room reserved);
        the position where admission stopped: len(keys), or a page that must wait until the
        pages admitted before it are written."""
        held = 0  # bytes this call reserved (earlier chunks are all published or released)
        for position in range(position, len(keys)):  # noqa: B020 - the return value
            key, view = keys[position], views[position]
            if key in batch.first_job:
                batch.repeats.append((position, batch.first_job[key]))
                continue
            path = self._page_path(key)
            if self._is_present(key, path):
                results[position] = WriteResult.PRESENT
                continue
            size = HEADER_BYTES + view.nbytes
            temp_path = self._temp_path(key, path)
            with self._lock:
                while True:
                    room = self._make_room_locked(size, protect=batch.keys)
                    if room.fits or not self._others_in_the_way_locked(size, held, batch.keys):
                        break
                    if held:
                        return position  # write what is admitted, then come back here
                    self._room_freed.wait()  # holding nothing: no batch can wait on this one
                if room.fits:
                    self._reserved_bytes += size
                    held += size
                    self._writing[key] = self._writing.get(key, 0) + 1
                # Under the lock, like every eviction: once the victims' files are gone or
                # renamed, no thread of ours can find them and adopt them back.
                recycled = self._recycle_locked(room.victims, temp_path)
            if room.fits:
                batch.first_job[key] = len(batch.jobs)
                batch.jobs.append(_Job(position, key, view, path, temp_path, recycled))
                batch.state.append(_RESERVED)
                batch.staged.append(None)
        return len(keys)

    def _others_in_the_way_locked(self, size: int, held: int, protect: frozenset[bytes]) -> bool:
        """Under the lock, after `_make_room_locked` found no room: whether the page would fit
        but for other batches' reservations (which become evictable pages once written)."""
        others = self._reserved_bytes - held
        if others <= 0:
            return False
        evictable = sum(b for k, b in self._index.items() if k not in protect)
        return self._indexed_bytes - evictable + held + size <= self.capacity_bytes

    def _write_jobs(self, batch: _Batch, lo: int) -> None:
        """Write the admitted jobs `lo..` (checksum, temp file, rename, indexing) on the I/O
        threads; under fsync "batch": write them all, then fsync + rename them all, then fsync
        their directories."""
        jobs, state, staged = batch.jobs, batch.state, batch.staged

        def write_range(a: int, b: int) -> None:
            for j in range(lo + a, lo + b):
                job = jobs[j]
                header = self._header(job.key, job.view.nbytes, page_checksum(job.view))
                temp = self._write_temp(
                    job.path, job.temp_path, header, job.view, recycled=job.recycled
                )
                if temp is None:
                    self._finish_job(job, None)
                    state[j] = _RELEASED
                    continue
                staged[j], state[j] = temp, _STAGED
                if self.fsync != "batch":
                    state[j] = self._publish(job, temp)
                    staged[j] = None

        def publish_range(a: int, b: int) -> None:
            for j in range(lo + a, lo + b):
                temp = staged[j]
                if temp is not None:
                    state[j] = self._publish(jobs[j], temp)
                    staged[j] = None

        n = len(jobs) - lo
        self._io.run(n, write_range)
        if self.fsync == "batch" and n:
            self._io.run(n, publish_range)
            dirs = sorted(
                {
                    os.path.dirname(jobs[j].path)
                    for j in range(lo, len(jobs))
                    if state[j] == _PUBLISHED
                }
            )
            self._io.run(len(dirs), lambda a, b: _fsync_dirs(dirs[a:b]))

    def _finish_job(self, job: _Job, temp: _Temp | None) -> None:
        """Undo what a job not published holds: its open temp file (closed and removed, or
        the recycled file at its temp path removed), its reservation and its writing mark."""
        if temp is not None:
            os.close(temp.fd)
        _unlink_quietly(job.temp_path)
        with self._lock:
            self._reserved_bytes -= job.size
            self._unmark_writing_locked(job.key)
            self._room_freed.notify_all()

    def _finish_jobs(self, batch: _Batch) -> None:
        for j, job in enumerate(batch.jobs):
            if batch.state[j] in (_RESERVED, _STAGED):
                self._finish_job(job, batch.staged[j])
                batch.state[j], batch.staged[j] = _RELEASED, None

    def _unmark_writing_locked(self, key: bytes) -> None:
        left = self._writing[key] - 1
        if left:
            self._writing[key] = left
        else:
            del self._writing[key]

    def _touch_batch(self, keys: Sequence[bytes], results: list[WriteResult]) -> None:
        """After a batch_set, under the lock once and in batch order (so LRU order follows
        the batch whatever thread wrote which page): touch the pages written or found present
        that are still indexed."""
        with self._lock:
            for key, result in zip(keys, results, strict=True):
                if result is not WriteResult.FAILED and key in self._index:
                    self._index.move_to_end(key)

    def _delete(self, keys: Sequence[bytes]) -> int:
        removed = 0
        for key in keys:
            path = self._page_path(key)
            try:
                # Under the lock, where our writers index what they rename in: unlinking
                # outside it could remove a page indexed in between, leaving the index stale.
                with self._lock:
                    self._forget_locked(key)
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
        return HEADER_BYTES + payload_bytes

    def close(self) -> None:
        """Stop the I/O threads (after the batches in flight). Pages, index and counters are
        kept, and the storage stays usable: the next batch of several pages starts them again.
        Optional: the threads also stop when the storage is garbage collected."""
        self._io.close()

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

    def _header(self, key: bytes, payload_bytes: int, checksum: int) -> bytes:
        """encode_header(fingerprint, key, ...), from the precomputed prefix."""
        return b"".join(
            (
                self._header_prefix,
                key_id(key),
                _BIN8,
                payload_bytes.to_bytes(8, "little"),
                _BIN8,
                checksum.to_bytes(8, "little"),
            )
        )

    def _open(self, key: bytes, path: str, *, nowait: bool = False) -> _Probe | None:
        """Open a page file and check its header; None when it is missing or unreadable. The
        file's length is not checked here: `_read_payload` catches a short or long file in the
        read it does anyway, which saves an fstat per page. `nowait`: see `_read_header`."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        except OSError as exc:
            _log.warning("cannot open page %s: %s", path, exc)
            return None
        return self._read_header(key, path, fd, nowait=nowait)

    def _read_header(
        self, key: bytes, path: str, fd: int, *, nowait: bool = False
    ) -> _Probe | None:
        """Read and check the header of the open page file `fd`; None (and `fd` closed) when it
        cannot be read. With `nowait`, a header that is not in the page cache is not waited
        for: the probe comes back `pending` (fd open) for a blocking call later."""
        try:
            head = _pread_nowait(fd, HEADER_BYTES) if nowait else os.pread(fd, HEADER_BYTES, 0)
        except OSError as exc:
            os.close(fd)
            _log.warning("cannot read page %s: %s", path, exc)
            return None
        if head is None:
            return _Probe(fd, False, 0, 0, pending=True)
        # A header of another version or namespace fails the prefix comparison (a version 1
        # header differs from byte 7 on, the version field); a file of another key (a recycled
        # inode read through an old descriptor, a misplaced file) fails the key id.
        if (
            len(head) == HEADER_BYTES
            and head.startswith(self._header_prefix)
            and head[_KEY_ID_AT : _KEY_ID_AT + 16] == key_id(key)
            and head[_LENGTH_AT - 2 : _LENGTH_AT] == _BIN8
            and head[_CHECKSUM_AT - 2 : _CHECKSUM_AT] == _BIN8
        ):
            payload_bytes = int.from_bytes(head[_LENGTH_AT : _LENGTH_AT + 8], "little")
            checksum = int.from_bytes(head[_CHECKSUM_AT:], "little")
            return _Probe(fd, True, payload_bytes, checksum)
        return _Probe(fd, False, 0, 0)

    def _drop_corrupt(self, key: bytes, path: str, fd: int) -> None:
        """Remove a page that failed a check, unless another writer has replaced the file
        since we opened it (then the new file is not ours to judge)."""
        opened = os.fstat(fd)
        with self._lock:  # our writers rename in and index under it: no swap in between
            try:
                current = os.stat(path)
            except FileNotFoundError:
                current = None
            if current is None:
                self._forget_locked(key)
            elif (current.st_ino, current.st_dev) == (opened.st_ino, opened.st_dev):
                _unlink_quietly(path)
                self._forget_locked(key)
        self._count_corrupt(1)

    def _is_present(self, key: bytes, path: str) -> bool:
        """Whether the page file exists (the disk, not the index, is the truth: another
        process may have written or evicted it)."""
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            self._forget_if_missing(key)
            return False
        except OSError as exc:  # the write that follows will fail and report it
            _log.warning("cannot stat page %s: %s", path, exc)
            return False
        self._adopt(key, size, touch=True)
        return True

    def _forget_locked(self, key: bytes) -> None:
        """Under the lock: drop an index entry (the caller removes or has removed its file)."""
        size = self._index.pop(key, None)
        if size is not None:
            self._indexed_bytes -= size

    def _forget_if_missing(self, key: bytes) -> None:
        """Drop an index entry whose file a reader found missing, if it is still missing:
        checked under the lock (where our writers index what they rename in, as `_adopt`
        does), so a page another thread of ours has just written is not dropped."""
        with self._lock:
            if key in self._index and not os.path.exists(self._page_path(key)):
                self._forget_locked(key)

    def _adopt(self, key: bytes, size: int, *, touch: bool) -> None:
        with self._lock:
            if key in self._index:
                if touch:
                    self._index.move_to_end(key)
                return
            if key in self._writing:  # its writer (a batch of ours) indexes it when done
                return
            # A reader adopts after its read; a writer of this process may have evicted (unlinked
            # or recycled) the page since. Evictions run under this lock, so one stat here keeps
            # the index from naming a file that is gone. Only on this uncommon path.
            if not os.path.exists(self._page_path(key)):
                return
            self._index[key] = size
            self._indexed_bytes += size
            self._unlink_locked(self._make_room_locked(0, protect=frozenset((key,))).victims)

    def _temp_path(self, key: bytes, path: str) -> str:
        name = f".{key.hex()[:32]}.{os.getpid()}.{next(self._temp_seq)}.tmp"
        return os.path.join(os.path.dirname(path), name)

    def _write_temp(
        self, path: str, temp: str, header: bytes, view: memoryview, *, recycled: bool
    ) -> _Temp | None:
        """Write header + payload to the temp file `temp` beside `path`: a fresh file, or, when
        `recycled`, an evicted page's file already renamed there (rewritten from offset 0 and
        cut to length). (fd, temp path), or None on an I/O error (then nothing is left)."""
        try:
            if recycled:
                fd = os.open(temp, os.O_WRONLY)
            else:
                try:
                    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                except FileNotFoundError:  # the fan-out directory, made on first use
                    os.makedirs(os.path.dirname(temp), exist_ok=True)
                    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except OSError as exc:
            _log.warning("cannot create %s: %s", temp, exc)
            if recycled:
                _unlink_quietly(temp)
            return None
        try:
            _write_all(fd, header, view)
            if recycled:
                size = len(header) + view.nbytes
                if os.fstat(fd).st_size != size:
                    os.ftruncate(fd, size)
            if self.fsync == "page":
                os.fsync(fd)
        except BaseException as exc:
            # Also on MemoryError or KeyboardInterrupt: no descriptor or temp file outlives it.
            os.close(fd)
            _unlink_quietly(temp)
            if not isinstance(exc, OSError):
                raise
            _log.warning("cannot write page %s: %s", path, exc)
            return None
        return _Temp(fd, temp)

    def _publish(self, job: _Job, temp: _Temp) -> int:
        """Make a written temp file the page (fsync first under "batch", its directory after
        under "page") and index it at once, so other batches can evict it (LRU order is set
        in batch order by `_touch_batch` at the end of the batch). _PUBLISHED, or _RELEASED
        on failure (temp file removed, reservation released)."""
        fd = temp.fd
        try:
            if self.fsync == "batch":
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.replace(temp.path, job.path)
        except OSError as exc:
            _log.warning("cannot publish page %s: %s", job.path, exc)
            self._finish_job(job, temp if fd >= 0 else None)
            return _RELEASED
        with self._lock:
            self._reserved_bytes -= job.size
            self._unmark_writing_locked(job.key)
            # A delete of ours may have unlinked the page between the rename and here (every
            # unlink of ours runs under this lock): then it is written but not indexed.
            if os.path.exists(job.path):
                old = self._index.pop(job.key, None)  # another batch of ours wrote it too
                if old is not None:
                    self._indexed_bytes -= old
                self._index[job.key] = job.size
                self._indexed_bytes += job.size
            self._room_freed.notify_all()
        if self.fsync == "page":
            _fsync_dir(os.path.dirname(job.path))
        return _PUBLISHED

    def _make_room_locked(self, size: int, *, protect: frozenset[bytes]) -> _Room:
        """Under the lock: take least recently used pages not in `protect` out of the index
        until `size` more bytes fit. Evicts nothing when that cannot make enough room. The
        caller unlinks or recycles the victims' files (still under the lock)."""
        need = self._indexed_bytes + self._reserved_bytes + size - self.capacity_bytes
        if need <= 0:
            return _Room(True, [])
        victims: list[tuple[bytes, int]] = []
        for key, page_bytes in self._index.items():
            if key not in protect:
                victims.append((key, page_bytes))
                need -= page_bytes
                if need <= 0:
                    break
        if need > 0:
            return _Room(False, [])
        for key, page_bytes in victims:
            del self._index[key]
            self._indexed_bytes -= page_bytes
        self._count_evictions(len(victims))
        return _Room(True, victims)

    def _unlink_locked(self, victims: list[tuple[bytes, int]]) -> None:
        for key, _size in victims:
            _unlink_quietly(self._page_path(key))

    def _recycle_locked(self, victims: list[tuple[bytes, int]], temp: str) -> bool:
        """Rename the first victim's file to `temp` (the new page's temp file) and unlink the
        others; whether a file now sits at `temp`. A victim removed by another process
        meanwhile is skipped (the next one is tried)."""
        recycled = False
        for key, _size in victims:
            path = self._page_path(key)
            if not recycled:
                try:
                    try:
                        os.rename(path, temp)
                    except FileNotFoundError:
                        if not os.path.lexists(path):
                            continue  # removed by another process
                        os.makedirs(os.path.dirname(temp), exist_ok=True)  # first use
                        os.rename(path, temp)
                    recycled = True
                    continue
                except OSError as exc:
                    _log.warning("cannot recycle %s: %s", path, exc)
            _unlink_quietly(path)
        return recycled

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


#: preadv flag: fail with EAGAIN instead of waiting for the disk (Linux >= 4.14); None elsewhere.
_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None)
#: What a read with _RWF_NOWAIT raises when it would wait, or when the file system or kernel
#: does not support the flag: either way, the page takes the blocking path.
_WOULD_WAIT = frozenset((errno.EAGAIN, errno.EOPNOTSUPP, errno.EINVAL))
#: The granularity at which the page cache holds file data (a nowait read stops only there).
_MEMORY_PAGE = mmap.PAGESIZE


def _pread_nowait(fd: int, size: int) -> bytes | None:
    """`os.pread(fd, size, 0)` if the bytes are in the page cache, else None (never waits)."""
    assert _RWF_NOWAIT is not None, "only called where RWF_NOWAIT exists"
    buf = bytearray(size)
    try:
        got = os.preadv(fd, [buf], 0, _RWF_NOWAIT)
    except OSError as exc:
        if exc.errno in _WOULD_WAIT:
            return None
        raise
    return bytes(buf[:got])


def _read_payload(
    probe: _Probe, view: memoryview, spare: bytearray, *, nowait: bool = False
) -> bool | None:
    """Read the payload into `view` and check its length and checksum. `spare` takes the byte
    after the payload in the same preadv, so a file longer than its header says costs no
    extra call; a short file hits end of file first. With `nowait` (RWF_NOWAIT), None as soon
    as a read would wait for the disk (`view` then holds part of the payload): the caller
    reads the page again without the flag."""
    done, end = 0, probe.payload_bytes
    flags = _RWF_NOWAIT if nowait and _RWF_NOWAIT is not None else 0
    try:
        spare_tried = False  # whether a read reached for the byte after the payload
        while done < end:
            n = os.preadv(probe.fd, [view[done:], spare], HEADER_BYTES + done, flags)
            if n == 0:
                return False  # shorter than its header says: truncated
            # A blocking read stops short of the spare byte only at end of file. A nowait read
            # also stops where the page cache runs out, which is always a memory-page
            # boundary: stopping anywhere else is end of file too. Only a stop exactly on a
            # boundary is ambiguous and costs the probe below (a file ends on one only when
            # header + payload is a multiple of the page size).
            off_boundary = (HEADER_BYTES + done + n) % _MEMORY_PAGE != 0
            spare_tried = not flags or n > end - done or off_boundary
            done += n
        if done > end:
            return False  # longer than its header says
        if not spare_tried and os.preadv(probe.fd, [spare], HEADER_BYTES + end, flags):
            return False  # longer than its header says
    except OSError as exc:
        if flags and exc.errno in _WOULD_WAIT:
            return None
        _log.warning("cannot read page payload: %s", exc)
        return False
    return page_checksum(view) == probe.checksum


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


def _fsync_dirs(directories: list[str]) -> None:
    for directory in directories:
        _fsync_dir(directory)


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


def _probe_writable(root: Path) -> bool:
    """Create and remove a file: permission bits lie for root and read-only mounts. Whether a
    read with RWF_NOWAIT works on this file system (tried on the probe file, in the page
    cache as it was just written)."""
    probe = os.path.join(root, f".probe.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
    except OSError as exc:
        read_only = exc.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
        reason = "read-only" if read_only else "unusable"
        raise StorageDirectoryError(f"FileStorage directory {root} is {reason}: {exc}") from exc
    try:
        return _nowait_works(fd)
    finally:
        os.close(fd)
        os.unlink(probe)


def _nowait_works(fd: int) -> bool:
    if _RWF_NOWAIT is None:
        return False
    try:
        os.write(fd, b"\0")
        os.preadv(fd, [bytearray(1)], 0, _RWF_NOWAIT)
    except OSError as exc:  # EAGAIN: supported, the byte just is not cached
        return exc.errno == errno.EAGAIN  # EOPNOTSUPP, EINVAL: not on this file system
    return True
