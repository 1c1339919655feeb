"""StoreCore scenarios (no Ray): spill order, leases that hold pages in memory, watermarks,
checksums on commit, expiry, and every error raised before anything changes."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from kvstrata.l3_store.arena import ALIGNMENT, ArenaFile, Extents
from kvstrata.l3_store.core import StoreCore, StoreParams, checksum, copy_checksum
from kvstrata.l3_store.errors import (
    ArenaMismatch,
    InvalidStoreConfig,
    UnknownLease,
    UnknownReservation,
)
from kvstrata.l3_store.routing import group_by_home, home
from kvstrata.storage import FileStorage
from kvstrata.storage.base import WriteResult
from kvstrata.storage.errors import BatchLengthMismatch, InvalidKey, InvalidParameter

A = ALIGNMENT


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def _core(tmp_path: Path, pages: int = 4, *, disk: bool = True, **kw: float) -> StoreCore:
    store = None
    if disk:
        (tmp_path / "disk").mkdir()
        store = FileStorage(tmp_path / "disk", capacity_bytes=1 << 20, io_threads=1)
    params = StoreParams(memory_bytes=pages * A, **kw)
    return StoreCore(params, arena=memoryview(bytearray(pages * A)), disk=store, clock=Clock())


def _page(i: int) -> bytes:
    return bytes([i]) * A


def test_lru_pages_spill_to_disk_and_come_back(tmp_path: Path) -> None:
    core = _core(tmp_path, high_watermark=1.0, low_watermark=1.0)
    keys = [b"k%d" % i for i in range(6)]
    assert core.write(keys[:4], [_page(i) for i in range(4)]) == [WriteResult.WRITTEN] * 4
    core.lease([keys[0]])  # k0 becomes most recently used (and pinned)
    assert core.write(keys[4:], [_page(4), _page(5)]) == [WriteResult.WRITTEN] * 2
    assert core.lru_keys() == [keys[3], keys[0], keys[4], keys[5]]  # k1, k2 spilled: LRU
    stats = core.stats()
    assert stats.spills == 2 and stats.disk_pages == 2 and stats.drops == 0
    assert core.exists(keys) == [True] * 6
    pages, sums = core.read([keys[1]])  # back from disk, into memory
    assert pages == [_page(1)] and sums == [checksum(_page(1))]
    assert core.stats().hits_disk == 1 and core.stats().disk_pages == 2  # k1 left, k3 spilled
    core.check_integrity()


def test_leased_pages_are_never_spilled(tmp_path: Path) -> None:
    core = _core(tmp_path, pages=2, disk=False, high_watermark=1.0, low_watermark=1.0)
    core.write([b"a", b"b"], [_page(1), _page(2)])
    grant = core.lease([b"a", b"b"])
    assert grant.lease_id is not None
    assert core.write([b"c"], [_page(3)]) == [WriteResult.FAILED]  # nothing may go
    assert core.exists([b"a", b"b", b"c"]) == [True, True, False]
    core.release(grant.lease_id)
    assert core.write([b"c"], [_page(3)]) == [WriteResult.WRITTEN]
    assert core.stats().drops == 1  # no disk: the LRU page is dropped
    core.check_integrity()


def test_watermarks_spill_down_to_low(tmp_path: Path) -> None:
    core = _core(tmp_path, pages=10, high_watermark=0.8, low_watermark=0.5)
    keys = [b"w%d" % i for i in range(9)]
    core.write(keys, [_page(i) for i in range(9)])
    assert core.stats().memory_used_bytes == 5 * A  # above 80 %: spilled down to 50 %
    assert core.lru_keys() == keys[4:]
    core.check_integrity()


def test_commit_checks_the_writers_checksum(tmp_path: Path) -> None:
    arena = bytearray(4 * A)
    core = StoreCore(StoreParams(memory_bytes=4 * A), arena=memoryview(arena))
    grant = core.reserve([b"x", b"y"], [100, 100])
    assert grant.reservation_id is not None
    for offset, fill in zip(grant.offsets, (b"x", b"y"), strict=True):
        assert offset is not None
        arena[offset : offset + 100] = fill * 100
    assert core.exists([b"x"]) == [False], "a reserved page is invisible"
    results = core.commit(grant.reservation_id, [checksum(b"x" * 100), 12345])
    assert results == [WriteResult.WRITTEN, WriteResult.FAILED]
    assert core.stats().checksum_failures == 1
    assert core.write([b"x"], [b"x" * 100]) == [WriteResult.PRESENT]
    with pytest.raises(UnknownReservation):
        core.commit(grant.reservation_id, [0, 0])
    core.check_integrity()


def test_write_verified_refuses_damaged_pages(tmp_path: Path) -> None:
    core = _core(tmp_path, disk=False)
    out = core.write_verified([b"p", b"q"], [b"1" * 10, b"2" * 10], [checksum(b"1" * 10), 7])
    assert out == [WriteResult.WRITTEN, WriteResult.FAILED]
    assert core.exists([b"p", b"q"]) == [True, False]


@pytest.mark.parametrize("size", [0, 1, 4095, 300_001])
def test_copy_checksum_copies_and_hashes_what_it_wrote(size: int) -> None:
    src = bytes((i * 7 + 3) % 251 for i in range(size))
    dst = bytearray(size)
    assert copy_checksum(memoryview(dst), memoryview(src)) == checksum(src)
    assert dst == src
    with pytest.raises(BatchLengthMismatch):
        copy_checksum(memoryview(bytearray(size + 1)), memoryview(src))


def test_unverified_commit_trusts_the_writer_and_reads_catch_damage(tmp_path: Path) -> None:
    """A same-node commit takes the writer's checksums without a pass; a page whose bytes do
    not match is published, and a read-out checks it (the client counts it corrupt). A page
    damaged before it spills is not brought back from disk as good."""
    arena = bytearray(2 * A)
    (tmp_path / "disk").mkdir()
    disk = FileStorage(tmp_path / "disk", capacity_bytes=1 << 20, io_threads=1)
    params = StoreParams(memory_bytes=2 * A, high_watermark=1.0, low_watermark=1.0)
    core = StoreCore(params, arena=memoryview(arena), disk=disk)
    grant = core.reserve([b"good", b"torn", b"gone"], [A, A, 10])
    assert grant.reservation_id is not None and grant.offsets[2] is None  # no room: 2 pages
    for offset, fill in zip(grant.offsets[:2], (b"g", b"t"), strict=True):
        assert offset is not None
        arena[offset : offset + A] = fill * A
    results = core.commit(grant.reservation_id, [checksum(b"g" * A), checksum(b"x" * A), 5],
                          verify=False)  # fmt: skip
    assert results == [WriteResult.WRITTEN, WriteResult.WRITTEN, WriteResult.FAILED]
    pages, sums = core.read([b"torn"])
    assert pages[0] is not None and checksum(pages[0]) != sums[0], "the reader sees the damage"
    assert core.write([b"new1", b"new2"], [_page(1), _page(2)]) == [WriteResult.WRITTEN] * 2
    assert core.stats().spills == 2  # good and torn went to disk
    failures = core.stats().checksum_failures
    assert core.lease([b"torn"]).refs == [None], "damaged before it spilled: a miss"
    assert core.stats().checksum_failures == failures + 1
    assert core.exists([b"torn"]) == [False], "and removed from the disk"
    assert core.read([b"good"])[0] == [b"g" * A]
    core.check_integrity()


def test_commit_drops_pages_the_writer_found_damaged() -> None:
    core = StoreCore(StoreParams(memory_bytes=2 * A), arena=memoryview(bytearray(2 * A)))
    grant = core.reserve([b"a", b"b"], [A, A])
    assert grant.reservation_id is not None
    out = core.commit(grant.reservation_id, [None, checksum(bytes(A))], verify=False)
    assert out == [WriteResult.FAILED, WriteResult.WRITTEN]
    assert core.stats().checksum_failures == 1 and core.stats().memory_used_bytes == A
    core.check_integrity()


def test_leases_and_reservations_expire(tmp_path: Path) -> None:
    clock = Clock()
    core = StoreCore(
        StoreParams(memory_bytes=2 * A, lease_s=5.0), arena=memoryview(bytearray(2 * A)),
        clock=clock,
    )  # fmt: skip
    core.write([b"a"], [_page(1)])
    grant = core.lease([b"a"])
    core.reserve([b"b"], [A])
    clock.now = 6.0
    assert core.expire() == 2
    assert core.stats().active_leases == 0 and core.stats().memory_used_bytes == A
    assert grant.lease_id is not None
    with pytest.raises(UnknownLease):
        core.release(grant.lease_id)
    core.check_integrity()


def test_errors_change_nothing(tmp_path: Path) -> None:
    core = _core(tmp_path, disk=False)
    core.write([b"a"], [_page(1)])
    before = core.stats()
    with pytest.raises(InvalidKey):
        core.write([b""], [b"x"])
    with pytest.raises(InvalidKey):
        core.lease(["text"])  # type: ignore[list-item]
    with pytest.raises(BatchLengthMismatch):
        core.reserve([b"a", b"b"], [1])
    with pytest.raises(InvalidParameter):
        core.reserve([b"z"], [-1])
    with pytest.raises(UnknownLease):
        core.release(999)
    after = core.stats()
    assert (after.memory_pages, after.memory_used_bytes, after.pages_written) == (
        before.memory_pages, before.memory_used_bytes, before.pages_written,
    )  # fmt: skip
    with pytest.raises(InvalidStoreConfig):
        StoreParams(memory_bytes=A, low_watermark=0.9, high_watermark=0.5)
    with pytest.raises(InvalidStoreConfig):
        StoreParams(memory_bytes=A, lease_s=0)
    with pytest.raises(InvalidStoreConfig):
        Extents(A + 1)
    with pytest.raises(InvalidStoreConfig):
        StoreCore(StoreParams(memory_bytes=2 * A), arena=memoryview(bytearray(A)))


def test_arena_file_is_shared_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "arena"
    owner = ArenaFile(path, 2 * A, create=True)
    client = ArenaFile(path, 2 * A, create=False)
    owner.view[:5] = b"hello"
    assert bytes(client.view[:5]) == b"hello", "both mappings see the same memory"
    with pytest.raises(ArenaMismatch):
        ArenaFile(path, 4 * A, create=False)
    client.close()
    owner.close()
    owner.unlink()
    assert not path.exists()


def test_arena_file_is_populated_in_the_background() -> None:
    """The store's mapping allocates the whole tmpfs file up front (in a background thread);
    without `populate` nothing is allocated until written."""
    directory = Path(tempfile.mkdtemp(prefix="kvstrata-l3-arena-", dir="/dev/shm"))
    try:
        size = 64 * A
        lazy = ArenaFile(directory / "lazy", size, create=True, populate=False)
        eager = ArenaFile(directory / "eager", size, create=True)
        assert lazy.populated.is_set() and eager.populated.wait(30)
        assert os.stat(directory / "lazy").st_blocks == 0
        assert os.stat(directory / "eager").st_blocks * 512 >= size
        eager.view[:3] = b"abc"  # still an ordinary mapping
        assert bytes(eager.view[:3]) == b"abc"
        for arena in (lazy, eager):
            arena.close()
            arena.unlink()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_rendezvous_moves_only_the_leaving_nodes_share() -> None:
    keys = [b"key-%d" % i for i in range(3000)]
    nodes = ["n0", "n1", "n2", "n3"]
    before = {k: home(k, nodes) for k in keys}
    after = {k: home(k, nodes[:3]) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "n3" for k in moved), "only n3's keys move"
    shares = group_by_home(keys, nodes)
    assert all(600 < len(v) < 900 for v in shares.values()), "about a quarter each"
    assert home(b"k", []) is None and group_by_home(keys, []) == {}
