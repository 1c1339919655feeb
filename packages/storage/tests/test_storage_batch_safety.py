"""FileStorage batch calls under faults and concurrency: an unexpected exception mid-batch,
interpreter shutdown, concurrent batches at a tight capacity, readers racing writers."""

from __future__ import annotations

import gc
import mmap
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvstrata.storage import FileStorage, file_format
from kvstrata.storage import file as file_module
from kvstrata.storage.parallel import BatchRunner
from kvstrata.testkit.storage import page_payload

SIZE = 4096


def pages(keys: list[bytes]) -> list[bytes]:
    return [page_payload(k, SIZE) for k in keys]


def open_fds() -> int:
    # Storages of earlier tests close their descriptors when collected: collect first, so that
    # a collection during the test does not read as a change.
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("fsync", ["never", "batch"])
def test_an_unexpected_exception_mid_batch_leaks_no_room_file_or_descriptor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: str
) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 22, io_threads=4, fsync=fsync)  # pyright: ignore[reportArgumentType]
    keys = [f"k{i}".encode() for i in range(16)]
    bad = page_payload(keys[5], SIZE)  # in the second range, not its first page
    real = file_module.page_checksum

    def boom(view: bytes | bytearray | memoryview) -> int:
        if bytes(view) == bad:
            raise MemoryError("simulated")
        return real(view)

    monkeypatch.setattr(file_module, "page_checksum", boom)
    fds = open_fds()
    with pytest.raises(MemoryError):
        storage.batch_set(keys, pages(keys))
    monkeypatch.undo()
    assert storage._reserved_bytes == 0
    assert storage._pages.writing == {}
    assert list(tmp_path.rglob(".*.tmp")) == []
    assert open_fds() == fds
    storage.check_integrity()
    # What was renamed into place is indexed; everything fits again.
    assert storage.stats().used_bytes == storage.stats().num_pages * storage.page_file_bytes(SIZE)
    assert all(storage.batch_set(keys, pages(keys)))
    assert storage.stats().num_pages == 16
    storage.check_integrity()


def test_the_runner_runs_ranges_inline_when_the_pool_refuses_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refuse(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError("cannot schedule new futures after interpreter shutdown")

    monkeypatch.setattr(ThreadPoolExecutor, "submit", refuse)
    runner = BatchRunner(4)
    seen: list[tuple[int, int, str]] = []
    runner.run(12, lambda lo, hi: seen.append((lo, hi, threading.current_thread().name)))
    assert [(lo, hi) for lo, hi, _ in seen] == runner.split(12)
    assert {name for _, _, name in seen} == {threading.current_thread().name}
    runner.close()


def test_a_batch_during_interpreter_shutdown_runs_in_the_calling_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 22, io_threads=4)
    monkeypatch.setattr("sys.is_finalizing", lambda: True)
    keys = [f"k{i}".encode() for i in range(8)]
    assert all(storage.batch_set(keys, pages(keys)))
    outs = [bytearray(SIZE) for _ in keys]
    assert all(storage.batch_get(keys, outs))
    assert [bytes(o) for o in outs] == pages(keys)
    assert storage._io._pool is None


@pytest.mark.parametrize("fsync", ["never", "batch"])
def test_concurrent_batches_at_a_tight_capacity_do_not_fail_each_other(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: str
) -> None:
    """Batch a holds the whole capacity in reservations while it writes; batch b waits for a's
    pages to be indexed and evicts them, instead of failing."""
    probe = FileStorage(tmp_path, capacity_bytes=0)
    storage = FileStorage(
        tmp_path,
        capacity_bytes=4 * probe.page_file_bytes(SIZE),
        io_threads=2,
        fsync=fsync,  # pyright: ignore[reportArgumentType]
    )
    old = [f"old{i}".encode() for i in range(4)]
    assert all(storage.batch_set(old, pages(old)))
    a_keys = [f"a{i}".encode() for i in range(4)]
    b_keys = [b"b0", b"b1"]
    paused, go = threading.Event(), threading.Event()
    real_write_temp = storage._write_temp

    def slow_write_temp(*args: object, **kwargs: bool) -> object:
        if not paused.is_set():
            paused.set()
            assert go.wait(10), "the test never released batch a"
        return real_write_temp(*args, **kwargs)  # pyright: ignore[reportArgumentType]

    monkeypatch.setattr(storage, "_write_temp", slow_write_temp)
    results: dict[str, list[bool]] = {}

    def set_batch(name: str, keys: list[bytes]) -> None:
        results[name] = storage.batch_set(keys, pages(keys))

    ta = threading.Thread(target=set_batch, args=("a", a_keys))
    ta.start()
    assert paused.wait(10)
    tb = threading.Thread(target=set_batch, args=("b", b_keys))
    tb.start()
    time.sleep(0.1)  # b finds no room: a's reservations hold it all
    go.set()
    ta.join(10)
    tb.join(10)
    assert results == {"a": [True] * 4, "b": [True] * 2}
    assert storage.stats().write_failures == 0
    # b evicted two of a's pages as they were indexed (which two depends on the timing).
    lru = storage.lru_keys()
    assert len(lru) == 4 and set(b_keys) <= set(lru) and set(lru) <= set(a_keys + b_keys)
    storage.check_integrity()


def test_a_page_larger_than_the_room_still_fails_at_once(tmp_path: Path) -> None:
    probe = FileStorage(tmp_path, capacity_bytes=0)
    storage = FileStorage(tmp_path, capacity_bytes=2 * probe.page_file_bytes(SIZE), io_threads=2)
    keys = [b"a", b"b", b"c"]
    assert storage.batch_set(keys, pages(keys)) == [True, True, False]
    storage.check_integrity()


@pytest.mark.parametrize("io_threads", [1, 4])
def test_a_reader_that_found_no_file_does_not_forget_a_page_written_since(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io_threads: int
) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 22, io_threads=io_threads)
    others = [f"x{i}".encode() for i in range(7)]
    assert all(storage.batch_set(others, pages(others)))
    real = file_module._read_payload

    def write_k_first(*args: object, **kwargs: bool) -> bool | None:
        if b"K" not in storage.lru_keys():
            assert storage.batch_set([b"K"], pages([b"K"])) == [True]
        return real(*args, **kwargs)  # pyright: ignore[reportArgumentType]

    monkeypatch.setattr(file_module, "_read_payload", write_k_first)
    outs = [bytearray(SIZE) for _ in range(8)]
    assert storage.batch_get([b"K", *others], outs) == [False] + [True] * 7
    monkeypatch.undo()
    assert b"K" in storage.lru_keys()
    assert storage.stats().used_bytes == 8 * storage.page_file_bytes(SIZE)
    storage.check_integrity()


def test_a_corrupt_page_replaced_by_a_valid_one_is_not_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 22, io_threads=1)
    assert storage.batch_set([b"K"], pages([b"K"])) == [True]
    path = storage._page_path(b"K")
    with open(path, "r+b") as f:  # damage the payload: the checksum fails
        f.seek(-1, os.SEEK_END)
        f.write(b"\xff" if f.read(1) != b"\xff" else b"\x00")
    real = file_module._read_payload

    def replace_then_read(*args: object, **kwargs: bool) -> bool | None:
        ok = real(*args, **kwargs)  # pyright: ignore[reportArgumentType]
        storage.delete([b"K"])  # another writer replaces the damaged page with a valid one
        assert storage.batch_set([b"K"], pages([b"K"])) == [True]
        return ok

    monkeypatch.setattr(file_module, "_read_payload", replace_then_read)
    out = bytearray(SIZE)
    assert storage.batch_get([b"K"], [out]) == [False]
    monkeypatch.undo()
    assert storage.lru_keys() == [b"K"]
    assert storage.stats().used_bytes == storage.page_file_bytes(SIZE)
    storage.check_integrity()
    assert storage.batch_get([b"K"], [out]) == [True] and bytes(out) == page_payload(b"K", SIZE)


@pytest.mark.skipif(file_format.RWF_NOWAIT is None, reason="no RWF_NOWAIT on this platform")
def test_a_nowait_read_that_stops_at_the_payload_end_still_catches_a_long_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Pages whose file ends on a memory-page boundary: a nowait read that stops there may have
    # stopped where the page cache ran out, so only one more read can tell a long file.
    size = 2 * mmap.PAGESIZE - file_module.HEADER_BYTES
    storage = FileStorage(tmp_path, capacity_bytes=1 << 22, io_threads=4)
    storage._nowait = True  # the kernel is faked below
    keys = [b"a", b"b"]
    assert all(storage.batch_set(keys, [page_payload(k, size) for k in keys]))
    with open(storage._page_path(b"a"), "ab") as f:
        f.write(b"x")  # one byte more than its header says
    real_preadv = os.preadv

    def cache_ends_at_the_payload(
        fd: int, buffers: list[memoryview], offset: int, flags: int = 0
    ) -> int:
        if flags and len(buffers) > 1:  # the cache holds the payload, not the page after
            return real_preadv(fd, buffers[:1], offset, flags)
        return real_preadv(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", cache_ends_at_the_payload)
    outs = [bytearray(size) for _ in keys]
    assert storage.batch_get(keys, outs) == [False, True]
    monkeypatch.undo()
    assert outs[1] == page_payload(b"b", size)
    assert storage.stats().corrupt_pages == 1
    assert storage.lru_keys() == [b"b"]
    storage.check_integrity()


def test_a_warm_nowait_read_of_a_page_ending_off_a_boundary_is_one_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SIZE + header ends inside a memory page, so the short read is end of file: no probe.
    assert (file_module.HEADER_BYTES + SIZE) % mmap.PAGESIZE
    storage = FileStorage(tmp_path, capacity_bytes=1 << 22, io_threads=4)
    if not storage._nowait:
        pytest.skip("this file system refuses RWF_NOWAIT reads (e.g. tmpfs)")
    keys = [b"a", b"b"]
    assert all(storage.batch_set(keys, pages(keys)))
    with open(storage._page_path(b"a"), "ab") as f:
        f.write(b"x")  # a long file is still caught by the spare byte of the same read
    real_preadv = os.preadv
    payload_reads: list[int] = []

    def count(fd: int, buffers: list[memoryview], offset: int, flags: int = 0) -> int:
        if offset >= file_module.HEADER_BYTES:
            payload_reads.append(offset)
        return real_preadv(fd, buffers, offset, flags)

    monkeypatch.setattr(os, "preadv", count)
    outs = [bytearray(SIZE) for _ in keys]
    assert storage.batch_get(keys, outs) == [False, True]
    monkeypatch.undo()
    # One payload read per page, no end-of-file probe; then the page that failed is read once
    # more, afresh, to tell corruption (it fails again) from a race.
    assert len(payload_reads) == 3
    assert outs[1] == page_payload(b"b", SIZE)
    assert storage.stats().corrupt_pages == 1


def test_a_delete_between_a_pages_rename_and_its_indexing_leaves_no_stale_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 22, io_threads=2)
    keys = [b"a", b"b", b"c", b"d"]
    target = storage._page_path(b"a")
    real_rename = file_module.rename_noreplace
    deleted: list[int] = []

    def rename_then_delete(src: str, dst: str) -> None:
        real_rename(src, dst)
        if dst == target and not deleted:
            deleted.append(storage.delete([b"a"]))

    monkeypatch.setattr(file_module, "rename_noreplace", rename_then_delete)
    assert all(storage.batch_set(keys, pages(keys)))
    monkeypatch.undo()
    assert deleted == [1]
    assert storage.lru_keys() == keys[1:]
    assert storage.stats().used_bytes == 3 * storage.page_file_bytes(SIZE)
    storage.check_integrity()
