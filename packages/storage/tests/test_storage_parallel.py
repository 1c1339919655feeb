"""BatchRunner, and FileStorage with its batch I/O spread over threads (io_threads > 1) against
the same calls done in the calling thread (io_threads = 1)."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from kvstrata.storage import FileStorage, file_format, open_storage
from kvstrata.storage import file as file_module
from kvstrata.storage.errors import BufferSizeMismatch, InvalidParameter, InvalidStorageURL
from kvstrata.storage.parallel import BatchRunner
from kvstrata.testkit.storage import page_payload

SIZE = 4096


def pages(keys: list[bytes]) -> list[bytes]:
    return [page_payload(k, SIZE) for k in keys]


def read_all(storage: FileStorage, keys: list[bytes]) -> list[bytes | None]:
    outs = [bytearray(SIZE) for _ in keys]
    found = storage.batch_get(keys, outs)
    return [bytes(o) if ok else None for o, ok in zip(outs, found, strict=True)]


# ---------------------------------------------------------------------- BatchRunner


@pytest.mark.parametrize("threads", [0, -1, 2.0, True])
def test_runner_refuses_a_bad_thread_count(threads: object) -> None:
    with pytest.raises(InvalidParameter):
        BatchRunner(threads)  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize(
    ("threads", "n", "ranges"),
    [
        (1, 5, [(0, 5)]),
        (4, 0, []),
        (4, 1, [(0, 1)]),
        (4, 3, [(0, 3)]),  # ranges of at least 2 pages
        (4, 5, [(0, 3), (3, 5)]),
        (4, 9, [(0, 3), (3, 5), (5, 7), (7, 9)]),
        (3, 128, [(0, 43), (43, 86), (86, 128)]),
    ],
)
def test_runner_splits_into_contiguous_balanced_ranges(
    threads: int, n: int, ranges: list[tuple[int, int]]
) -> None:
    assert BatchRunner(threads).split(n) == ranges


def test_runner_covers_every_index_once_on_several_threads() -> None:
    runner = BatchRunner(4)
    seen: list[int] = []
    names: set[str] = set()
    lock = threading.Lock()

    def task(lo: int, hi: int) -> None:
        with lock:
            seen.extend(range(lo, hi))
            names.add(threading.current_thread().name)

    runner.run(100, task)
    assert sorted(seen) == list(range(100))
    assert threading.current_thread().name in names and len(names) > 1
    runner.close()


def test_runner_waits_for_every_range_before_raising() -> None:
    runner = BatchRunner(4)
    finished: list[int] = []
    release = threading.Event()

    def task(lo: int, hi: int) -> None:
        if lo == 0:
            raise ValueError("range 0")
        release.wait(5)
        finished.append(lo)

    threading.Timer(0.05, release.set).start()
    with pytest.raises(ValueError, match="range 0"):
        runner.run(8, task)
    assert sorted(finished) == [2, 4, 6]  # all done before run() raised
    runner.close()


def test_runner_restarts_after_close() -> None:
    runner = BatchRunner(2)
    out: list[int] = []
    runner.run(4, lambda lo, hi: out.extend(range(lo, hi)))
    runner.close()
    runner.run(4, lambda lo, hi: out.extend(range(lo, hi)))
    assert sorted(out) == [0, 0, 1, 1, 2, 2, 3, 3]


def test_runner_close_racing_with_runs_loses_no_range() -> None:
    runner = BatchRunner(3)
    covered: list[list[int]] = []
    stop = threading.Event()

    def runs() -> None:
        try:
            for _ in range(200):
                seen: list[int] = []
                runner.run(6, _extender(seen))
                covered.append(sorted(seen))
        finally:
            stop.set()

    worker = threading.Thread(target=runs)
    worker.start()
    while not stop.is_set():
        runner.close()
    worker.join()
    runner.close()
    assert covered == [list(range(6))] * 200  # every run covered its pages (none raised)


def _extender(out: list[int]) -> Callable[[int, int], None]:
    return lambda lo, hi: out.extend(range(lo, hi))


# ---------------------------------------------------------------------- FileStorage


def test_io_threads_is_validated_and_reachable_by_url(tmp_path: Path) -> None:
    with pytest.raises(InvalidParameter):
        FileStorage(tmp_path, capacity_bytes=1 << 20, io_threads=0)
    storage = open_storage(f"file://{tmp_path}?capacity_bytes=1MiB&io_threads=3")
    assert isinstance(storage, FileStorage) and storage.io_threads == 3
    with pytest.raises(InvalidStorageURL):
        open_storage(f"file://{tmp_path}?capacity_bytes=1MiB&io_threads=many")


@pytest.mark.parametrize("fsync", ["never", "page", "batch"])
def test_parallel_and_sequential_give_the_same_results(tmp_path: Path, fsync: str) -> None:
    """The same calls (with repeats, present keys, evictions and misses) on two stores."""
    stores = []
    for threads in (1, 4):
        root = tmp_path / f"t{threads}"
        root.mkdir()
        probe = FileStorage(root, capacity_bytes=0)
        stores.append(
            FileStorage(
                root,
                capacity_bytes=20 * probe.page_file_bytes(SIZE),
                fsync=fsync,  # pyright: ignore[reportArgumentType]
                io_threads=threads,
            )
        )
    keys = [f"k{i}".encode() for i in range(40)]
    calls = [keys[0:12], [*keys[5:20], keys[6], keys[6]], keys[18:35], keys[0:3] + keys[30:40]]
    for batch in calls:
        sets = [s.batch_set_results(batch, pages(batch)) for s in stores]
        assert sets[0] == sets[1]
        probe_keys = keys[::3]
        assert read_all(stores[0], probe_keys) == read_all(stores[1], probe_keys)
        assert stores[0].lru_keys() == stores[1].lru_keys()
        assert stores[0].batch_exists(batch) == stores[1].batch_exists(batch)
    for storage in stores:
        storage.check_integrity()
        got = read_all(storage, storage.lru_keys())
        assert got == pages(storage.lru_keys())
    one, many = (s.stats() for s in stores)
    assert (one.evictions, one.used_bytes, one.hits) == (many.evictions, many.used_bytes, many.hits)


def test_a_wrong_buffer_size_raises_before_any_thread_writes_a_buffer(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 22, io_threads=4)
    keys = [f"k{i}".encode() for i in range(16)]
    assert all(storage.batch_set(keys, pages(keys)))
    outs = [bytearray(SIZE) for _ in keys]
    outs[11] = bytearray(SIZE - 1)
    with pytest.raises(BufferSizeMismatch):
        storage.batch_get(keys, outs)
    assert all(o == bytearray(len(o)) for o in outs)
    assert storage.lru_keys() == keys  # nothing touched


def test_parallel_faults_fail_only_the_pages_concerned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Write errors on one range's thread and a corrupt page read on another: only those
    pages are False, and nothing partial or temporary is left."""
    storage = FileStorage(tmp_path, capacity_bytes=1 << 22, io_threads=4)
    keys = [f"k{i}".encode() for i in range(16)]
    doomed = {keys[1].hex()[:32], keys[13].hex()[:32]}
    real_open = os.open

    def failing_open(path: str, flags: int, mode: int = 0o777) -> int:
        name = os.path.basename(path)
        if name.endswith(".tmp") and name.split(".")[1] in doomed:
            raise OSError(errno.EIO, "I/O error", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", failing_open)
    ok = storage.batch_set(keys, pages(keys))
    monkeypatch.undo()
    assert ok == [i not in (1, 13) for i in range(16)]
    assert list(tmp_path.rglob(".*.tmp")) == []
    page = Path(storage._page_path(keys[9]))
    raw = bytearray(page.read_bytes())
    raw[-1] ^= 0xFF
    page.write_bytes(bytes(raw))
    got = read_all(storage, keys)
    assert [g is not None for g in got] == [i not in (1, 9, 13) for i in range(16)]
    assert all(g == p for g, p in zip(got, pages(keys), strict=True) if g is not None)
    assert not page.exists() and storage.stats().corrupt_pages == 1
    storage.check_integrity()


def test_a_page_renamed_in_but_not_yet_indexed_is_not_adopted_by_a_reader(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Between a page's rename and its indexing, a reader of ours finds the page on disk: it
    reads it, but leaves the indexing (and the bytes) to the writer."""
    storage = FileStorage(tmp_path, capacity_bytes=1 << 22, io_threads=2)
    keys = [b"a", b"b", b"c", b"d"]
    seen: list[bytes | None] = []
    real_rename = file_module.rename_noreplace
    target = storage._page_path(b"a")

    def rename_then_read(src: str, dst: str) -> None:
        real_rename(src, dst)
        if dst == target and not seen:
            seen.extend(read_all(storage, [b"a"]))

    monkeypatch.setattr(file_module, "rename_noreplace", rename_then_read)
    assert all(storage.batch_set(keys, pages(keys)))
    assert seen == pages([b"a"])
    assert storage.lru_keys() == keys  # indexed by the writer, in batch order
    assert storage.stats().used_bytes == 4 * storage.page_file_bytes(SIZE)
    storage.check_integrity()


def test_close_stops_the_threads_and_the_storage_stays_usable(tmp_path: Path) -> None:
    before = set(threading.enumerate())
    storage = FileStorage(tmp_path, capacity_bytes=1 << 22, io_threads=3)
    keys = [f"k{i}".encode() for i in range(8)]
    assert all(storage.batch_set(keys, pages(keys)))
    ours = [t for t in set(threading.enumerate()) - before if t.name.startswith("kvstrata")]
    assert ours and all(t.is_alive() for t in ours)
    storage.close()
    assert not any(t.is_alive() for t in ours)
    assert read_all(storage, keys) == pages(keys)
    assert file_module.DEFAULT_IO_THREADS >= 1


class _NoWaitReads:
    """Makes preadv calls with RWF_NOWAIT fail (EAGAIN: "not in the page cache", or EOPNOTSUPP:
    "flag not supported"), or return only part of a payload first, and records which threads
    did the blocking reads."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
        self.mode = mode
        self.real_preadv = os.preadv
        self.blocking_threads: set[str] = set()
        self.partial_done: set[int] = set()
        monkeypatch.setattr(os, "preadv", self.preadv)

    def preadv(self, fd: int, buffers: list[memoryview], offset: int, flags: int = 0) -> int:
        if not flags:
            self.blocking_threads.add(threading.current_thread().name)
            return self.real_preadv(fd, buffers, offset)
        if self.mode == "partial" and offset > 0 and fd not in self.partial_done:
            self.partial_done.add(fd)  # half a page from the cache, then "would wait"
            return self.real_preadv(fd, [buffers[0][: buffers[0].nbytes // 2]], offset, flags)
        if self.mode == "partial":
            if offset == 0:
                return self.real_preadv(fd, buffers, offset, flags)  # headers are cached
            raise BlockingIOError(errno.EAGAIN, "would block")
        code = errno.EAGAIN if self.mode == "eagain" else errno.EOPNOTSUPP
        raise OSError(code, os.strerror(code))


@pytest.mark.skipif(file_format.RWF_NOWAIT is None, reason="no RWF_NOWAIT on this platform")
@pytest.mark.parametrize("mode", ["eagain", "unsupported", "partial"])
def test_reads_that_would_wait_go_to_the_io_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 22, io_threads=4)
    # The kernel's answers are faked below: the path runs even where the file system (tmpfs
    # with --basetemp=/dev/shm/...) made the storage turn RWF_NOWAIT off.
    storage._nowait = True
    keys = [f"k{i}".encode() for i in range(16)]
    assert all(storage.batch_set(keys, pages(keys)))
    assert read_all(storage, keys) == pages(keys)  # warm: no blocking read at all
    reads = _NoWaitReads(monkeypatch, mode)
    assert read_all(storage, keys) == pages(keys)
    monkeypatch.undo()
    assert any(name.startswith("kvstrata-file-io") for name in reads.blocking_threads)
    if mode == "partial":
        assert len(reads.partial_done) == 16  # every payload restarted after half a read
    stats = storage.stats()
    assert stats.corrupt_pages == 0 and stats.misses == 0
    storage.check_integrity()


def test_a_warm_batch_is_read_in_the_calling_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 22, io_threads=4)
    keys = [f"k{i}".encode() for i in range(16)]
    assert all(storage.batch_set(keys, pages(keys)))
    threads: set[str] = set()
    real_preadv = os.preadv

    def spy(fd: int, buffers: list[memoryview], offset: int, flags: int = 0) -> int:
        threads.add(threading.current_thread().name)
        return real_preadv(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", spy)
    assert read_all(storage, keys) == pages(keys)
    if not storage._nowait:
        pytest.skip("RWF_NOWAIT is not supported on this file system: reads use the threads")
    assert threads == {threading.current_thread().name}


def test_nowait_is_turned_off_where_the_file_system_refuses_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tmpfs on some kernels answers RWF_NOWAIT with EOPNOTSUPP: the storage remembers it and
    reads as without the flag (on the I/O threads), correctly."""
    if file_format.RWF_NOWAIT is None:
        pytest.skip("no RWF_NOWAIT on this platform")
    real_preadv = os.preadv
    flagged: list[int] = []

    def refuse(fd: int, buffers: list[bytearray], offset: int, flags: int = 0) -> int:
        if flags:
            flagged.append(flags)
            raise OSError(errno.EOPNOTSUPP, "Operation not supported")
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", refuse)
    storage = FileStorage(tmp_path, capacity_bytes=1 << 22, io_threads=4)
    assert not storage._nowait
    keys = [f"k{i}".encode() for i in range(8)]
    assert all(storage.batch_set(keys, pages(keys)))
    flagged.clear()
    assert read_all(storage, keys) == pages(keys)
    assert flagged == []
