"""FileStorage: one file per page under a directory, shared by every process that opens it.

Layout (`directory.py`): `<root>/ns-<namespace>/ab/<key>.page`, a page being written at
`.../ab/.<key>.<pid>.<n>.tmp`. The namespace is part of the path, so storages of two namespaces
on one directory never open, report or remove each other's pages. Page format and the reads and
writes of one file: `file_format.py`. The byte accounting every process on the directory shares:
`ledger.py`.

A page is written to its temp file and renamed into place without replacing anything
(renameat2 RENAME_NOREPLACE), so a reader sees either no page or a whole one, and a file at a
page path is never swapped for another in place. A page whose header, key, length or checksum
does not check out is a miss; it is removed (and counted corrupt) only when the same file is
still at its path and fails again when read afresh; a file that another process removed,
recycled or replaced while it was read is a miss counted as a race, never as corruption.

A write that has to evict reuses the evicted page's file as its temp file (renamed, rewritten
in place, cut to length) instead of unlinking one inode and creating another, the costly file
system operations (README: "Recycling"); the key id in the header keeps a reader of the old file
from taking the new page's bytes as its own.
"""

from __future__ import annotations

import itertools
import logging
import os
import stat
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, TypeAlias

from kvstrata.storage.base import Occupancy, Storage, WriteResult
from kvstrata.storage.directory import (
    PAGE_SUFFIX,
    check_arguments,
    fsync_dir,
    fsync_dirs,
    key_of,
    namespace_dir,
    probe_writable,
    scan,
)
from kvstrata.storage.errors import (
    BufferSizeMismatch,
    StorageDirectoryError,
)
from kvstrata.storage.file_format import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAGIC,
    PageCodec,
    Probe,
    encode_header,
    key_id,
    namespace_fingerprint,
    page_checksum,
    unlink_quietly,
    write_temp,
)
from kvstrata.storage.file_format import read_payload as _read_payload
from kvstrata.storage.file_index import PageIndex
from kvstrata.storage.ledger import DirectoryLedger, rename_noreplace
from kvstrata.storage.parallel import BatchRunner

__all__ = [
    "DEFAULT_IO_THREADS",
    "DEFAULT_WRITE_TIMEOUT_S",
    "FORMAT_VERSION",
    "FSYNC_POLICIES",
    "HEADER_BYTES",
    "MAGIC",
    "MAX_KEY_BYTES",
    "FileStorage",
    "FsyncPolicy",
    "encode_header",
    "key_id",
    "namespace_fingerprint",
    "page_checksum",
]

FsyncPolicy: TypeAlias = Literal["never", "page", "batch"]
FSYNC_POLICIES: tuple[str, ...] = ("never", "page", "batch")

#: A temp file unchanged for this long is reclaimed, even if its writer's pid runs (a hung
#: writer, or a reused pid): writing one page never takes this long.
DEFAULT_WRITE_TIMEOUT_S = 600.0
#: Threads a batch call spreads its pages' file I/O over (the caller's included).
DEFAULT_IO_THREADS = 4
#: 2 hex characters per key byte plus the suffix must fit in a 255-byte file name.
MAX_KEY_BYTES = 120

_log = logging.getLogger(__name__)


class _Temp(NamedTuple):
    """A page written to its temp file, not yet renamed over its final name."""

    fd: int
    path: str


class _Job(NamedTuple):
    """A page of a batch_set admitted (room reserved; an evicted page's file already renamed
    to `temp_path` when `recycled`). Its state: _RESERVED -> _STAGED (temp file written, fd
    open) -> _PUBLISHED (renamed into place and indexed), or -> _RELEASED (failed or unwound:
    temp file removed, reservation released), or -> _FOUND (another writer put the page in
    place first: temp file removed, reservation released, the page is PRESENT)."""

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


_RESERVED, _STAGED, _PUBLISHED, _RELEASED, _FOUND = range(5)


@dataclass(eq=False)
class _Batch:
    """One batch_set's jobs and their states (a job's entries are only touched by the thread
    running its range, and by the caller once the runner has returned)."""

    paths: frozenset[str]  # the batch's page paths: never evicted for the batch itself
    jobs: list[_Job] = field(default_factory=list[_Job])
    state: list[int] = field(default_factory=list[int])
    staged: list[_Temp | None] = field(default_factory=list[_Temp | None])  # fsync "batch"
    first_job: dict[bytes, int] = field(default_factory=dict[bytes, int])  # key -> its job
    repeats: list[tuple[int, int]] = field(default_factory=list[tuple[int, int]])  # (pos, job)


class FileStorage(Storage):
    """Pages as files under `path` (absolute), with a byte capacity for the whole directory.

    - `capacity_bytes` counts whole files (header included) of every process and namespace on
      the directory: a ledger shared through the directory (`ledger.py`, flock'ed) accounts
      every byte added or freed, so page and temp files never exceed it. Every storage on one
      directory should be given the same capacity (each enforces its own against the shared
      bytes). The first storage to open the directory rebuilds the ledger from a scan.
    - The index (LRU order) of this process is built at construction by scanning the
      directory, oldest `max(atime, mtime)` first (pages beyond the capacity are evicted then).
      Pages other processes write join it when this process reads them, or when it has to
      evict and its own index cannot make room (a rescan). Evictions take least recently used
      pages of this process's view, of any namespace.
    - `namespace` is the layout fingerprint; it is part of every page's path.
    - `fsync`: "never" (the OS decides; damaged pages after a crash are misses), "page" (each
      page and its directory before the call returns), "batch" (all, then the directories).
    - `io_threads`: how many threads (the caller's included) a batch call spreads its pages'
      file I/O and checksums over; 1 does everything in the calling thread (see the README).
    - `write_timeout_s`: a temp file unchanged this long is reclaimed by the next scan, even
      if its writer runs.

    Costs per page: see the README's operation table (a set of a page already there reads and
    checks it like a get: PRESENT only for a page this storage reads back).
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
        write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
    ) -> None:
        root = check_arguments(
            path, capacity_bytes, namespace, fsync, write_timeout_s, FSYNC_POLICIES
        )
        if not root.is_dir():
            what = "is not a directory" if root.exists() else "does not exist"
            raise StorageDirectoryError(f"FileStorage directory {root} {what}")
        io = BatchRunner(io_threads, name="kvstrata-file-io")  # validates io_threads
        nowait = probe_writable(root)
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
        self.write_timeout_s = float(write_timeout_s)
        self._fingerprint = namespace_fingerprint(namespace)
        self._codec = PageCodec(self._fingerprint)
        self._root = str(root)
        self._space = namespace_dir(self._root, self._fingerprint)
        self._lock = threading.Lock()
        # Notified whenever reserved bytes are indexed or released (see `_admit`).
        self._room_freed = threading.Condition(self._lock)
        self._reserved_bytes = 0  # writes of this storage in flight (also in the ledger)
        self._temp_tag = f"{id(self):x}"
        self._temp_seq = itertools.count()
        self._ledger = DirectoryLedger(self._root)
        weakref.finalize(self, self._ledger.close)
        self._pages = PageIndex(
            self._root,
            capacity_bytes=capacity_bytes,
            ledger=self._ledger,
            write_timeout_s=self.write_timeout_s,
        )
        with self._lock:
            alone = self._ledger.open(capacity_bytes, self._pages.rebuild_locked)
            if not alone:
                self._pages.scan_locked()
            with self._ledger:
                room = self._pages.make_room_locked(0, protect=frozenset(), rescan=False)
                self._pages.take_room_locked(room, 0, temp=None)
        self._count_evictions(len(room.victims))

    # ------------------------------------------------------------------ hooks

    def _exists_prefix(self, keys: Sequence[bytes]) -> int:
        for i, key in enumerate(keys):
            path = self._page_path(key)
            probe = self._codec.open(key, path)
            if probe is None:
                self._forget_if_missing(path)
                return i
            try:
                size = HEADER_BYTES + probe.payload_bytes
                st = os.fstat(probe.fd)
                if not probe.valid or not stat.S_ISREG(st.st_mode) or st.st_size != size:
                    self._failed_check(key, path, probe.fd)
                    return i
                self._adopt(path, size, touch=False)
            except OSError as exc:
                _log.warning("cannot stat page %s: %s", path, exc)
                return i
            finally:
                os.close(probe.fd)
        return len(keys)

    def _get_into(self, keys: Sequence[bytes], views: list[memoryview]) -> list[bool]:
        paths = [self._page_path(key) for key in keys]
        probes: list[Probe | None] = [None] * len(keys)
        read_ok = [False] * len(keys)
        # With several threads, this thread first reads what the page cache holds, asking the
        # kernel not to wait (RWF_NOWAIT); only what would wait goes to the I/O threads. A warm
        # batch then costs no hand-offs (they cost more than they save when the CPU, not the
        # disk, is the limit), and a cold one still has its reads overlapped.
        cache_first = self._io.threads > 1 and self._nowait

        def open_range(lo: int, hi: int) -> None:
            for i in range(lo, hi):
                probes[i] = self._codec.open(keys[i], paths[i])

        def header_list(indices: list[int]) -> None:
            for i in indices:
                probe = probes[i]
                assert probe is not None and probe.pending, "only pending headers are re-read"
                probes[i] = self._codec.read_header(keys[i], paths[i], probe.fd)

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
                    probes[i] = self._codec.open(key, path, nowait=True)
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
                    self._forget_if_missing(path)
                    found.append(False)
                elif ok:
                    self._adopt(path, HEADER_BYTES + probe.payload_bytes, touch=True)
                    found.append(True)
                else:
                    assert not probe.pending, "a header left unread would pass for corrupt"
                    self._failed_check(key, path, probe.fd)
                    found.append(False)
            return found
        finally:
            for probe in probes:
                if probe is not None:
                    os.close(probe.fd)

    def _set_from(self, keys: Sequence[bytes], views: list[memoryview]) -> list[WriteResult]:
        results = [WriteResult.FAILED] * len(keys)
        batch = _Batch(frozenset(self._page_path(key) for key in keys))
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
                elif state == _FOUND:
                    results[job.position] = WriteResult.PRESENT
            for position, j in batch.repeats:
                stored = batch.state[j] in (_PUBLISHED, _FOUND)
                results[position] = WriteResult.PRESENT if stored else WriteResult.FAILED
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
        """Admit pages from `position` on, in batch order, into `batch.jobs` (room reserved in
        the ledger); the position where admission stopped: len(keys), or a page that must wait
        until the pages admitted before it are written."""
        held = 0  # bytes this call reserved (earlier chunks are all published or released)
        for position in range(position, len(keys)):  # noqa: B020 - the return value
            key, view = keys[position], views[position]
            if key in batch.first_job:
                batch.repeats.append((position, batch.first_job[key]))
                continue
            path = self._page_path(key)
            present = self._present(key, path)
            if present is not None:
                results[position] = present
                continue
            size = HEADER_BYTES + view.nbytes
            temp_path = self._temp_path(key, path)
            recycled = False
            with self._lock:
                while True:
                    with self._ledger:
                        room = self._pages.make_room_locked(size, protect=batch.paths)
                        if room.fits:
                            self._count_evictions(len(room.victims))
                            # Under both locks, like every eviction: once the victims' files
                            # are gone or renamed, no thread or process can adopt them back.
                            recycled = self._pages.take_room_locked(room, size, temp=temp_path)
                            break
                        blocked = self._others_in_the_way_locked(size, held, batch.paths)
                    if not blocked:
                        break
                    if held:
                        return position  # write what is admitted, then come back here
                    self._room_freed.wait()  # holding nothing: no batch can wait on this one
                if room.fits:
                    self._reserved_bytes += size
                    held += size
                    self._pages.mark_writing_locked(path)
            if room.fits:
                batch.first_job[key] = len(batch.jobs)
                batch.jobs.append(_Job(position, key, view, path, temp_path, recycled))
                batch.state.append(_RESERVED)
                batch.staged.append(None)
        return len(keys)

    def _others_in_the_way_locked(self, size: int, held: int, protect: frozenset[str]) -> bool:
        """Under both locks, after `_make_room_locked` found no room: whether the page would fit
        but for other batches' reservations of this storage (pages, evictable, once written)."""
        others = self._reserved_bytes - held
        if others <= 0:
            return False
        evictable = self._pages.evictable_bytes_locked(protect)
        return self._ledger.used_bytes + size - evictable - others <= self.capacity_bytes

    def _write_jobs(self, batch: _Batch, lo: int) -> None:
        """Write the admitted jobs `lo..` (checksum, temp file, rename, indexing) on the I/O
        threads; under fsync "batch": write them all, then fsync + rename them all, then fsync
        their directories."""
        jobs, state, staged = batch.jobs, batch.state, batch.staged

        def write_range(a: int, b: int) -> None:
            for j in range(lo + a, lo + b):
                job = jobs[j]
                header = self._codec.header(job.key, job.view.nbytes, page_checksum(job.view))
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
            self._io.run(len(dirs), lambda a, b: fsync_dirs(dirs[a:b]))

    def _finish_job(self, job: _Job, temp: _Temp | None) -> None:
        """Undo what a job not published holds: its open temp file (closed and removed, or
        the recycled file at its temp path removed), its reservation (here and in the ledger)
        and its writing mark."""
        if temp is not None:
            os.close(temp.fd)
        unlink_quietly(job.temp_path)
        with self._lock:
            with self._ledger:
                self._ledger.add(-job.size)
            self._reserved_bytes -= job.size
            self._pages.unmark_writing_locked(job.path)
            self._room_freed.notify_all()

    def _finish_jobs(self, batch: _Batch) -> None:
        for j, job in enumerate(batch.jobs):
            if batch.state[j] in (_RESERVED, _STAGED):
                self._finish_job(job, batch.staged[j])
                batch.state[j], batch.staged[j] = _RELEASED, None

    def _delete(self, keys: Sequence[bytes]) -> int:
        removed = 0
        for key in keys:
            path = self._page_path(key)
            # Under both locks: our writers index what they rename in under the first, and
            # every process accounts what it unlinks under the second.
            with self._lock, self._ledger:
                self._pages.forget_locked(path)
                if self._pages.remove_locked(path, same_as=None):
                    removed += 1
        return removed

    def _clear(self) -> None:
        with self._lock, self._ledger:
            pages, _temps = scan(self._root)
            for page in pages:
                self._pages.remove_locked(page.path, same_as=None)
            self._pages.entries.clear()
            self._pages.indexed_bytes = 0

    def _occupancy(self) -> Occupancy:
        with self._lock, self._ledger:
            return Occupancy(len(self._pages.entries), self._ledger.used_bytes, self.capacity_bytes)

    # ------------------------------------------------------------------ public helpers

    @staticmethod
    def page_file_bytes(payload_bytes: int) -> int:
        """Bytes a page of `payload_bytes` takes against the capacity (header included)."""
        return HEADER_BYTES + payload_bytes

    def close(self) -> None:
        """Stop the I/O threads (after the batches in flight). Pages, index and counters are
        kept, and the storage stays usable: the next batch of several pages starts them again.
        Optional: the threads also stop when the storage is garbage collected (which is also
        when it leaves the directory's ledger)."""
        self._io.close()

    def lru_keys(self) -> list[bytes]:
        """Indexed keys of this storage's namespace, least to most recently used (a copy; for
        tests and debugging)."""
        with self._lock:
            paths = [
                p for p in self._pages.entries if os.path.dirname(os.path.dirname(p)) == self._space
            ]
        return [k for k in map(key_of, paths) if k is not None]

    def check_integrity(self) -> None:
        """Assert the accounting: the index sums, the reservations of this storage are in the
        ledger, the directory's bytes are within the capacity, and every indexed page still on
        disk has its indexed size. An indexed page that is gone is allowed (another process
        evicted it; the entry is dropped when next met). Cost: one stat per indexed page."""
        with self._lock:
            total = sum(self._pages.entries.values())
            assert total == self._pages.indexed_bytes, (
                f"indexed_bytes {self._pages.indexed_bytes} != sum of page sizes {total}"
            )
            assert self._reserved_bytes >= 0, "a write released more than it reserved"
            with self._ledger:
                used = self._ledger.used_bytes
            assert used >= self._reserved_bytes, (
                f"ledger used {used} < this storage's writes in flight {self._reserved_bytes}"
            )
            assert used <= self.capacity_bytes, (
                f"directory used {used} > capacity {self.capacity_bytes}: an eviction made "
                "too little room, or a storage with a larger capacity shares the directory"
            )
            for path, size in self._pages.entries.items():
                try:
                    on_disk = os.lstat(path).st_size
                except FileNotFoundError:
                    continue
                assert on_disk == size, f"page {path} is {on_disk} bytes, indexed {size}"

    # ------------------------------------------------------------------ internals

    def _page_path(self, key: bytes) -> str:
        name = key.hex()
        return os.path.join(self._space, name[:2], name + PAGE_SUFFIX)

    def _failed_check(self, key: bytes, path: str, fd: int) -> None:
        """After the page file `fd` opened at `path` failed a check: a race (another process
        removed, recycled or replaced it meanwhile, or it passes when read afresh) is counted
        apart; corruption (the same file, failing again) is removed and counted corrupt. Not a
        regular file (a FIFO, a directory): a miss, left alone."""
        try:
            opened = os.fstat(fd)
        except OSError as exc:
            _log.warning("cannot stat page %s: %s", path, exc)
            return
        if not stat.S_ISREG(opened.st_mode):
            _log.warning("%s is not a regular file: a miss", path)
            return
        if not self._same_file_at(path, opened):
            self._count_races(1)
            return
        self._remove_damaged(key, path, opened)

    def _same_file_at(self, path: str, opened: os.stat_result) -> bool:
        """Whether the file at `path` is `opened` (drops the index entry when nothing is
        there: checked under the lock, where our writers index what they rename in)."""
        with self._lock:
            try:
                current = os.lstat(path)
            except FileNotFoundError:
                self._pages.forget_locked(path)
                return False
        return (current.st_ino, current.st_dev) == (opened.st_ino, opened.st_dev)

    def _present(self, key: bytes, path: str, *, again: bool = True) -> WriteResult | None:
        """Whether a batch_set may skip the page: PRESENT when a page of this key that this
        storage reads back whole (header, key, length, checksum; any length: a key names its
        content) is at `path`; None when the page must be written (nothing there, or a
        damaged page, removed here and counted corrupt); FAILED when something that cannot be
        a page is in the way (a directory, a FIFO). A file that changed while it was checked
        (another process's eviction) is a race: checked once more."""
        probe = self._codec.open(key, path)
        if probe is None:
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                self._forget_if_missing(path)
                return None
            if stat.S_ISREG(st.st_mode):  # unreadable: damaged, and ours to replace
                return None if self._remove_damaged(key, path, st) else WriteResult.FAILED
            return WriteResult.FAILED
        try:
            opened = os.fstat(probe.fd)
            if not stat.S_ISREG(opened.st_mode):
                return WriteResult.FAILED
            scratch = memoryview(bytearray(probe.payload_bytes if probe.valid else 0))
            if probe.valid and _read_payload(probe, scratch, bytearray(1)):
                self._adopt(path, opened.st_size, touch=True)
                return WriteResult.PRESENT
        finally:
            os.close(probe.fd)
        if not self._same_file_at(path, opened):
            self._count_races(1)
            return self._present(key, path, again=False) if again else WriteResult.FAILED
        return None if self._remove_damaged(key, path, opened) else WriteResult.FAILED

    def _remove_damaged(self, key: bytes, path: str, opened: os.stat_result) -> bool:
        """A page this storage could not read back sits at `path`: unless it reads back whole
        when read afresh (then it changed meanwhile: a race), remove it if it is still that
        file (counted corrupt). Whether the path is free now."""
        if self._codec.reads_back(key, path, None):
            self._count_races(1)
            return False
        with self._lock, self._ledger:
            if self._pages.remove_locked(path, same_as=opened):
                self._pages.forget_locked(path)
                self._count_corrupt(1)
                return True
            return not os.path.lexists(path)

    def _forget_if_missing(self, path: str) -> None:
        """Drop an index entry whose file a reader found missing, if it is still missing:
        checked under the lock (where our writers index what they rename in, as `_adopt`
        does), so a page another thread of ours has just written is not dropped."""
        with self._lock:
            if path in self._pages.entries and not os.path.exists(path):
                self._pages.forget_locked(path)

    def _adopt(self, path: str, size: int, *, touch: bool) -> None:
        """Index a page a reader found on disk (see `PageIndex.adopt_locked`)."""
        with self._lock:
            self._pages.adopt_locked(path, size, touch=touch)

    def _temp_path(self, key: bytes, path: str) -> str:
        name = f".{key.hex()[:32]}.{os.getpid()}.{self._temp_tag}-{next(self._temp_seq)}.tmp"
        return os.path.join(os.path.dirname(path), name)

    def _write_temp(
        self, path: str, temp: str, header: bytes, view: memoryview, *, recycled: bool
    ) -> _Temp | None:
        """`write_temp` (file_format.py) under this storage's fsync policy."""
        fsync = self.fsync == "page"
        fd = write_temp(path, temp, header, view, recycled=recycled, fsync=fsync)
        return None if fd is None else _Temp(fd, temp)

    def _publish(self, job: _Job, temp: _Temp) -> int:
        """Make a written temp file the page, without replacing anything (fsync first under
        "batch", its directory after under "page"), and index it at once, so other batches
        can evict it (LRU order is set in batch order by `_touch_batch` at the end of the
        batch). _PUBLISHED; _FOUND when another writer put the page there first (our copy is
        dropped); _RELEASED on failure (temp file removed, reservation released)."""
        fd = temp.fd
        try:
            if self.fsync == "batch":
                os.fsync(fd)
            os.close(fd)
            fd = -1
            rename_noreplace(temp.path, job.path)
        except FileExistsError:
            self._finish_job(job, None)
            found = self._codec.reads_back(job.key, job.path, None)
            return _FOUND if found else _RELEASED
        except OSError as exc:
            _log.warning("cannot publish page %s: %s", job.path, exc)
            self._finish_job(job, temp if fd >= 0 else None)
            return _RELEASED
        with self._lock:
            self._reserved_bytes -= job.size  # the ledger's bytes stay: now a page's
            self._pages.unmark_writing_locked(job.path)
            # A delete of ours may have unlinked the page between the rename and here (every
            # unlink of ours runs under this lock): then it is written but not indexed.
            if os.path.exists(job.path):
                self._pages.put_locked(job.path, job.size)
            self._room_freed.notify_all()
        if self.fsync == "page":
            fsync_dir(os.path.dirname(job.path))
        return _PUBLISHED

    def _touch_batch(self, keys: Sequence[bytes], results: list[WriteResult]) -> None:
        """After a batch_set, under the lock once and in batch order (so LRU order follows
        the batch whatever thread wrote which page): touch the pages written or found present
        that are still indexed."""
        paths = [
            self._page_path(key)
            for key, result in zip(keys, results, strict=True)
            if result is not WriteResult.FAILED
        ]
        with self._lock:
            for path in paths:
                if path in self._pages.entries:
                    self._pages.entries.move_to_end(path)
