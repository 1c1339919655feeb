"""FileStorage beyond the shared contract: the on-disk format, damaged files, several processes,
a writer killed mid-write, disk full, fsync policies, the startup scan."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import xxhash

from kvstrata.storage import FileStorage
from kvstrata.storage import file as file_module
from kvstrata.storage.errors import InvalidKey, InvalidParameter, StorageDirectoryError
from kvstrata.storage.file import (
    FORMAT_VERSION,
    HEADER_BYTES,
    MAX_KEY_BYTES,
    encode_header,
    key_id,
    namespace_fingerprint,
)
from kvstrata.testkit.storage import page_payload

SIZE = 256


def page_file(root: Path, key: bytes) -> Path:
    return root / key.hex()[:2] / f"{key.hex()}.page"


def store(storage: FileStorage, *keys: bytes, size: int = SIZE) -> list[bool]:
    return storage.batch_set(list(keys), [page_payload(k, size) for k in keys])


def read(storage: FileStorage, key: bytes, size: int = SIZE) -> bytes | None:
    out = bytearray(size)
    return bytes(out) if storage.batch_get([key], [out])[0] else None


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob(".*.tmp")]


def run_python(code: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args])


# ---------------------------------------------------------------------- construction


def test_missing_directory_or_file_path_fails_at_construction(tmp_path: Path) -> None:
    with pytest.raises(StorageDirectoryError, match="does not exist"):
        FileStorage(tmp_path / "nope", capacity_bytes=1 << 20)
    (tmp_path / "f").write_bytes(b"")
    with pytest.raises(StorageDirectoryError, match="not a directory"):
        FileStorage(tmp_path / "f", capacity_bytes=1 << 20)
    with pytest.raises(InvalidParameter):
        FileStorage(tmp_path, capacity_bytes=1 << 20, fsync="sometimes")  # pyright: ignore


def test_read_only_directory_fails_at_construction(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Permission bits do not stop root, so simulate the read-only mount the probe must catch.
    real_open = os.open

    def read_only(path: str, flags: int, mode: int = 0o777) -> int:
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, "Read-only file system", path)
        return real_open(path, flags, mode)

    monkeypatch.setattr(os, "open", read_only)
    with pytest.raises(StorageDirectoryError, match="read-only"):
        FileStorage(tmp_path, capacity_bytes=1 << 20)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores permission bits")
def test_unwritable_directory_fails_at_construction(tmp_path: Path) -> None:
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(StorageDirectoryError, match="read-only"):
            FileStorage(tmp_path, capacity_bytes=1 << 20)
    finally:
        tmp_path.chmod(0o755)


def test_key_longer_than_a_file_name_allows_is_refused(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 20)
    with pytest.raises(InvalidKey):
        storage.batch_exists([b"k" * (MAX_KEY_BYTES + 1)])


# ---------------------------------------------------------------------- format and damage


def test_page_file_holds_a_msgpack_header_then_the_payload(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 20, namespace="ns")
    store(storage, b"\xab\x01")
    raw = page_file(tmp_path, b"\xab\x01").read_bytes()
    assert len(raw) == storage.page_file_bytes(SIZE)
    assert raw.endswith(page_payload(b"\xab\x01", SIZE))
    assert b"KVSP" in raw[: len(raw) - SIZE]
    assert temp_files(tmp_path) == []


def test_header_is_fixed_width_msgpack_with_an_xxh3_checksum(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 20, namespace="ns")
    for key, size in ((b"\x01small", 3), (b"\x02big", 70_000)):
        store(storage, key, size=size)
        raw = page_file(tmp_path, key).read_bytes()
        payload = page_payload(key, size)
        assert raw[HEADER_BYTES:] == payload
        assert msgpack.unpackb(raw[:HEADER_BYTES]) == [
            b"KVSP",
            FORMAT_VERSION,
            namespace_fingerprint("ns"),
            xxhash.xxh3_128_digest(key),
            size.to_bytes(8, "little"),
            xxhash.xxh3_64_intdigest(payload).to_bytes(8, "little"),
        ]
    # Every field has a fixed width: one header length whatever the numbers in it.
    fingerprint = namespace_fingerprint("ns")
    assert len(encode_header(fingerprint, b"", 0, 0)) == HEADER_BYTES == 64
    assert len(encode_header(fingerprint, b"k" * MAX_KEY_BYTES, 2**64 - 1, 2**64 - 1)) == 64
    assert key_id(b"\x01small") == xxhash.xxh3_128_digest(b"\x01small")


def test_empty_page_round_trips_and_its_damage_is_caught(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 20)
    assert storage.batch_set([b"e"], [b""]) == [True]
    assert storage.batch_get([b"e"], [bytearray()]) == [True]
    with page_file(tmp_path, b"e").open("ab") as f:
        f.write(b"x")  # a byte after a zero-length payload
    assert storage.batch_get([b"e"], [bytearray()]) == [False]
    assert not page_file(tmp_path, b"e").exists()


def _version_1_page(namespace: str, payload: bytes) -> bytes:
    """A page file as format version 1 wrote it: variable-width header, crc32."""
    header = msgpack.packb(
        [
            b"KVSP",
            1,
            namespace_fingerprint(namespace),
            len(payload),
            zlib.crc32(payload).to_bytes(4, "little"),
        ]
    )
    return header + payload


def _other_version_page(namespace: str, payload: bytes) -> bytes:
    """Today's layout, checksum right, but a version number this reader does not know."""
    raw = encode_header(
        namespace_fingerprint(namespace), b"old", len(payload), xxhash.xxh3_64_intdigest(payload)
    )
    assert raw[7] == FORMAT_VERSION
    return raw[:7] + bytes([FORMAT_VERSION + 1]) + raw[8:] + payload


@pytest.mark.parametrize("make_page", [_version_1_page, _other_version_page])
@pytest.mark.parametrize("op", ["get", "exists"])
def test_page_of_another_format_version_is_a_miss_and_is_removed(
    tmp_path: Path, make_page: Callable[[str, bytes], bytes], op: str
) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 20, namespace="ns")
    store(storage, b"good")
    path = page_file(tmp_path, b"old")
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(make_page("ns", page_payload(b"old", SIZE)))
    # A restart indexes it like any page file (it takes disk space until it is found out).
    storage = FileStorage(tmp_path, capacity_bytes=1 << 20, namespace="ns")
    assert sorted(storage.lru_keys()) == [b"good", b"old"]
    if op == "get":
        out = bytearray(SIZE)
        assert storage.batch_get([b"good", b"old"], [bytearray(SIZE), out]) == [True, False]
    else:
        assert storage.batch_exists([b"good", b"old"]) == 1
    assert not path.exists()
    assert storage.lru_keys() == [b"good"]
    assert storage.stats().corrupt_pages == 1
    assert storage.stats().used_bytes == storage.page_file_bytes(SIZE)
    storage.check_integrity()
    assert store(storage, b"old") == [True]  # written again in today's format
    assert read(storage, b"old") == page_payload(b"old", SIZE)


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "garbage_header", "extend"])
def test_damaged_page_is_a_miss_and_is_removed(tmp_path: Path, damage: str) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 20)
    store(storage, b"good", b"bad")
    path = page_file(tmp_path, b"bad")
    raw = bytearray(path.read_bytes())
    if damage == "flip_payload":
        raw[-10] ^= 0x01
    elif damage == "truncate":
        del raw[-1:]
    elif damage == "garbage_header":
        raw[:8] = b"\x00" * 8
    else:
        raw += b"\x00"
    path.write_bytes(bytes(raw))
    out = bytearray(SIZE)
    assert storage.batch_get([b"good", b"bad"], [bytearray(SIZE), out]) == [True, False]
    assert not path.exists()
    assert storage.stats().corrupt_pages == 1
    assert storage.batch_exists([b"good", b"bad"]) == 1
    storage.check_integrity()
    assert store(storage, b"bad") == [True]  # and it can be written again
    assert read(storage, b"bad") == page_payload(b"bad", SIZE)


def test_a_page_file_of_another_key_is_a_miss_and_is_removed(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 20)
    store(storage, b"a")
    # b's name holding a's whole, valid page: a misplaced file, or a recycled inode read late.
    misplaced = page_file(tmp_path, b"b")
    misplaced.parent.mkdir(exist_ok=True)
    misplaced.write_bytes(page_file(tmp_path, b"a").read_bytes())
    assert read(storage, b"b") is None
    assert not misplaced.exists()
    assert storage.stats().corrupt_pages == 1
    assert read(storage, b"a") == page_payload(b"a", SIZE)


# ---------------------------------------------------------------------- recycling


def test_a_full_store_recycles_the_evicted_file_for_the_new_page(tmp_path: Path) -> None:
    probe = FileStorage(tmp_path, capacity_bytes=0)
    storage = FileStorage(tmp_path, capacity_bytes=2 * probe.page_file_bytes(SIZE))
    store(storage, b"a", b"b")
    inode_a = page_file(tmp_path, b"a").stat().st_ino
    assert store(storage, b"c") == [True]  # evicts a, the least recently used
    assert not page_file(tmp_path, b"a").exists()
    assert page_file(tmp_path, b"c").stat().st_ino == inode_a
    assert read(storage, b"c") == page_payload(b"c", SIZE)
    assert read(storage, b"b") == page_payload(b"b", SIZE)
    assert temp_files(tmp_path) == []
    assert storage.stats().evictions == 1
    storage.check_integrity()


def test_a_recycled_file_takes_the_length_of_the_new_page(tmp_path: Path) -> None:
    probe = FileStorage(tmp_path, capacity_bytes=0)
    storage = FileStorage(tmp_path, capacity_bytes=probe.page_file_bytes(4096))
    for key, size in ((b"big", 4096), (b"small", 100), (b"big-again", 4096)):
        assert store(storage, key, size=size) == [True]  # each evicts the one before
        assert page_file(tmp_path, key).stat().st_size == storage.page_file_bytes(size)
        assert read(storage, key, size) == page_payload(key, size)
        assert storage.lru_keys() == [key]
    assert storage.stats().evictions == 2
    storage.check_integrity()


def test_a_reader_of_a_recycled_file_gets_a_miss_not_the_new_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = FileStorage(tmp_path, capacity_bytes=0)
    writer = FileStorage(tmp_path, capacity_bytes=2 * probe.page_file_bytes(SIZE))
    store(writer, b"a", b"b")
    reader = FileStorage(tmp_path, capacity_bytes=1 << 20)
    real_read_payload = file_module._read_payload

    def recycle_first(*args: object, **kwargs: bool) -> bool | None:
        # The reader has opened a and checked its header; now a is evicted and its inode
        # rewritten as c (same size, same offsets) before the reader reads the payload.
        assert store(writer, b"c") == [True]
        monkeypatch.setattr(file_module, "_read_payload", real_read_payload)
        return real_read_payload(*args, **kwargs)  # pyright: ignore[reportArgumentType]

    monkeypatch.setattr(file_module, "_read_payload", recycle_first)
    out = bytearray(SIZE)
    assert reader.batch_get([b"a"], [out]) == [False]
    assert bytes(out) == page_payload(b"c", SIZE)  # it did read c's bytes, and refused them
    assert read(reader, b"c") == page_payload(b"c", SIZE)  # c was not judged corrupt
    assert page_file(tmp_path, b"c").exists()
    reader.check_integrity()
    writer.check_integrity()


def test_exists_removes_a_page_with_a_bad_header(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 20)
    store(storage, b"a", b"b")
    page_file(tmp_path, b"b").write_bytes(b"not a page")
    assert storage.batch_exists([b"a", b"b"]) == 1
    assert not page_file(tmp_path, b"b").exists()
    assert storage.stats().corrupt_pages == 1


def test_foreign_namespace_page_is_a_miss_and_is_removed(tmp_path: Path) -> None:
    writer = FileStorage(tmp_path, capacity_bytes=1 << 20, namespace="llama-8b/bf16/p64")
    store(writer, b"k")
    reader = FileStorage(tmp_path, capacity_bytes=1 << 20, namespace="llama-8b/fp8/p64")
    assert read(reader, b"k") is None
    assert not page_file(tmp_path, b"k").exists()
    assert reader.stats().corrupt_pages == 1


# ---------------------------------------------------------------------- persistence and scan


def age_files(directory: Path, ages_s: dict[bytes, int]) -> None:
    """Set each key's page file's access and modification times `ages_s[key]` seconds back."""
    now = time.time()
    for key, age in ages_s.items():
        os.utime(page_file(directory, key), (now - age, now - age))


def test_reopening_sees_old_pages_in_lru_order_of_file_times(tmp_path: Path) -> None:
    first = FileStorage(tmp_path, capacity_bytes=1 << 20)
    store(first, b"a", b"b", b"c")
    age_files(tmp_path, {b"b": 300, b"c": 200, b"a": 100})
    again = FileStorage(tmp_path, capacity_bytes=1 << 20)
    assert again.lru_keys() == [b"b", b"c", b"a"]
    assert again.batch_exists([b"a", b"b", b"c"]) == 3
    assert read(again, b"c") == page_payload(b"c", SIZE)
    assert again.stats().used_bytes == 3 * again.page_file_bytes(SIZE)
    again.check_integrity()


def test_reopening_with_a_smaller_capacity_evicts_the_oldest(tmp_path: Path) -> None:
    first = FileStorage(tmp_path, capacity_bytes=1 << 20)
    store(first, b"a", b"b", b"c")
    age_files(tmp_path, {b"a": 300, b"b": 200, b"c": 100})
    small = FileStorage(tmp_path, capacity_bytes=2 * first.page_file_bytes(SIZE))
    assert small.lru_keys() == [b"b", b"c"]
    assert not page_file(tmp_path, b"a").exists()
    small.check_integrity()


def test_scan_removes_orphaned_temp_files_only(tmp_path: Path) -> None:
    sub = tmp_path / "ab"
    sub.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, check=True)  # fmt: skip
    orphan = sub / f".abcd.{int(dead.stdout)}.0.tmp"
    live = sub / f".abcd.{os.getpid()}.0.tmp"
    old = sub / f".abcd.{os.getpid()}.1.tmp"
    for p in (orphan, live, old):
        p.write_bytes(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    storage = FileStorage(tmp_path, capacity_bytes=1 << 20)
    assert not orphan.exists() and not old.exists() and live.exists()
    assert storage.stats().num_pages == 0


# ---------------------------------------------------------------------- several processes

_WRITER = """
    import sys
    from kvstrata.storage import FileStorage
    from kvstrata.testkit.storage import page_payload
    root, size, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    storage = FileStorage(root, capacity_bytes=1 << 40, namespace="mp")
    keys = [f"page-{i}".encode() for i in range(rounds)]
    for key in keys:
        storage.batch_set([key], [page_payload(key, size)])
    print("done", flush=True)
"""


def test_a_second_process_sees_the_pages(tmp_path: Path) -> None:
    proc = run_python(_WRITER, str(tmp_path), str(SIZE), "5")
    assert proc.wait(timeout=60) == 0
    reader = FileStorage(tmp_path, capacity_bytes=1 << 20, namespace="mp")
    keys = [f"page-{i}".encode() for i in range(5)]
    assert reader.batch_exists(keys) == 5
    assert all(read(reader, k) == page_payload(k, SIZE) for k in keys)


def test_pages_written_by_another_process_after_startup_are_adopted(tmp_path: Path) -> None:
    reader = FileStorage(tmp_path, capacity_bytes=1 << 20, namespace="mp")
    proc = run_python(_WRITER, str(tmp_path), str(SIZE), "3")
    assert proc.wait(timeout=60) == 0
    assert reader.batch_exists([b"page-0", b"page-1", b"page-2"]) == 3
    assert sorted(reader.lru_keys()) == [b"page-0", b"page-1", b"page-2"]
    reader.check_integrity()


def test_a_page_removed_by_another_process_is_written_again(tmp_path: Path) -> None:
    ours = FileStorage(tmp_path, capacity_bytes=1 << 20)
    theirs = FileStorage(tmp_path, capacity_bytes=1 << 20)
    store(ours, b"k")
    assert theirs.delete([b"k"]) == 1
    assert store(ours, b"k") == [True]
    assert page_file(tmp_path, b"k").exists()
    ours.check_integrity()


def test_two_processes_writing_the_same_keys_leave_whole_pages(tmp_path: Path) -> None:
    size, rounds = 64 * 1024, 40
    procs = [run_python(_WRITER, str(tmp_path), str(size), str(rounds)) for _ in range(2)]
    reader = FileStorage(tmp_path, capacity_bytes=1 << 40, namespace="mp")
    keys = [f"page-{i}".encode() for i in range(rounds)]
    while any(p.poll() is None for p in procs):  # read while they write
        for key in keys:
            out = bytearray(size)
            if reader.batch_get([key], [out])[0]:
                assert bytes(out) == page_payload(key, size)
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    assert reader.batch_exists(keys) == rounds
    assert all(read(reader, k, size) == page_payload(k, size) for k in keys)
    assert temp_files(tmp_path) == []
    assert reader.stats().corrupt_pages == 0


_ENDLESS_WRITER = """
    import sys
    from kvstrata.storage import FileStorage
    from kvstrata.testkit.storage import page_payload
    storage = FileStorage(sys.argv[1], capacity_bytes=1 << 40, namespace="kill")
    i = 0
    while True:
        key = f"page-{i}".encode()
        storage.batch_set([key], [page_payload(key, 4 << 20)])
        i += 1
        if i == 3:
            print("started", flush=True)
"""


def test_writer_killed_mid_write_leaves_no_visible_partial_page(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_ENDLESS_WRITER), str(tmp_path)],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline() == b"started\n"
    # Wait until a temp file exists, so the kill lands in the middle of a page.
    deadline = time.monotonic() + 10
    while not temp_files(tmp_path) and time.monotonic() < deadline:
        time.sleep(0.001)
    proc.send_signal(signal.SIGKILL)
    assert time.monotonic() < deadline, "the writer never had a page in flight"
    proc.wait(timeout=30)
    proc.stdout.close()
    storage = FileStorage(tmp_path, capacity_bytes=1 << 40, namespace="kill")
    assert temp_files(tmp_path) == []  # the orphan of the dead writer is gone
    keys = storage.lru_keys()
    assert len(keys) >= 3
    for key in keys:
        assert read(storage, key, 4 << 20) == page_payload(key, 4 << 20)
    assert storage.stats().corrupt_pages == 0


# ---------------------------------------------------------------------- I/O errors


class _DiskFull:
    """Makes writes of the temp files of chosen keys fail with ENOSPC after a partial write."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, keys: set[bytes], *, at: str) -> None:
        self.hex = {k.hex()[:32] for k in keys}
        self.fds: set[int] = set()
        self.real_open, self.real_writev = os.open, os.writev
        self.at = at
        monkeypatch.setattr(os, "open", self.open)
        monkeypatch.setattr(os, "writev", self.writev)

    def chosen(self, path: str) -> bool:
        name = os.path.basename(path)
        return name.endswith(".tmp") and name.split(".")[1] in self.hex

    def open(self, path: str, flags: int, mode: int = 0o777) -> int:
        if self.at == "open" and self.chosen(path):
            raise OSError(errno.ENOSPC, "No space left on device", path)
        fd = self.real_open(path, flags, mode)
        if self.chosen(path):
            self.fds.add(fd)
        return fd

    def writev(self, fd: int, buffers: list[memoryview]) -> int:
        if fd in self.fds:
            os.write(fd, bytes(buffers[0][:10]))  # a partial page reaches the disk first
            self.fds.discard(fd)
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.real_writev(fd, buffers)


@pytest.mark.parametrize("at", ["open", "write"])
@pytest.mark.parametrize("fsync", ["never", "page", "batch"])
def test_disk_full_fails_only_the_pages_concerned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: str, fsync: str
) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 20, fsync=fsync)  # pyright: ignore
    _DiskFull(monkeypatch, {b"k2", b"k4"}, at=at)
    keys = [b"k1", b"k2", b"k3", b"k4", b"k5"]
    assert store(storage, *keys) == [True, False, True, False, True]
    monkeypatch.undo()
    assert storage.batch_exists(keys) == 1
    assert [read(storage, k) == page_payload(k, SIZE) for k in keys] == [
        True, False, True, False, True,
    ]  # fmt: skip
    assert not page_file(tmp_path, b"k2").exists()
    assert temp_files(tmp_path) == []
    stats = storage.stats()
    assert stats.write_failures == 2 and stats.pages_written == 3
    assert stats.used_bytes == 3 * storage.page_file_bytes(SIZE)
    storage.check_integrity()


@pytest.mark.parametrize("at", ["open", "write"])
@pytest.mark.parametrize("io_threads", [1, 4])
def test_disk_full_while_recycling_fails_only_that_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, at: str, io_threads: int
) -> None:
    probe = FileStorage(tmp_path, capacity_bytes=0)
    storage = FileStorage(
        tmp_path, capacity_bytes=2 * probe.page_file_bytes(SIZE), io_threads=io_threads
    )
    store(storage, b"a", b"b")
    _DiskFull(monkeypatch, {b"c"}, at=at)
    # c evicts a, recycles its file and fails. A batch reserves every page's room before it
    # writes any (whatever io_threads is), so d evicted b, and c's room is left free.
    assert store(storage, b"c", b"d") == [False, True]
    monkeypatch.undo()
    assert [page_file(tmp_path, k).exists() for k in (b"a", b"b", b"c", b"d")] == [
        False, False, False, True,
    ]  # fmt: skip
    assert read(storage, b"d") == page_payload(b"d", SIZE)
    assert temp_files(tmp_path) == []
    assert storage.stats().used_bytes == storage.page_file_bytes(SIZE)
    assert storage.stats().evictions == 2
    storage.check_integrity()
    assert store(storage, b"c") == [True]


@pytest.mark.parametrize(
    ("fsync", "file_syncs", "dir_syncs"), [("never", 0, 0), ("page", 3, 3), ("batch", 3, 2)]
)
def test_fsync_policy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: str, file_syncs: int, dir_syncs: int
) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 20, fsync=fsync)  # pyright: ignore
    synced: list[bool] = []
    real_fsync = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.path.isdir(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", spy)
    # b"\x01a" and b"\x01b" share a fan-out directory, b"\x02c" has its own.
    assert store(storage, b"\x01a", b"\x01b", b"\x02c") == [True] * 3
    assert synced.count(False) == file_syncs
    assert synced.count(True) == dir_syncs
    assert read(storage, b"\x02c") == page_payload(b"\x02c", SIZE)
