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
from pathlib import Path

import pytest

from kvstrata.storage import FileStorage
from kvstrata.storage.errors import InvalidKey, InvalidParameter, StorageDirectoryError
from kvstrata.storage.file import MAX_KEY_BYTES
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


def test_reopening_sees_old_pages_in_lru_order_of_file_times(tmp_path: Path) -> None:
    first = FileStorage(tmp_path, capacity_bytes=1 << 20)
    store(first, b"a", b"b", b"c")
    now = time.time()
    for age, key in ((300, b"b"), (200, b"c"), (100, b"a")):
        os.utime(page_file(tmp_path, key), (now - age, now - age))
    again = FileStorage(tmp_path, capacity_bytes=1 << 20)
    assert again.lru_keys() == [b"b", b"c", b"a"]
    assert again.batch_exists([b"a", b"b", b"c"]) == 3
    assert read(again, b"c") == page_payload(b"c", SIZE)
    assert again.stats().used_bytes == 3 * again.page_file_bytes(SIZE)
    again.check_integrity()


def test_reopening_with_a_smaller_capacity_evicts_the_oldest(tmp_path: Path) -> None:
    first = FileStorage(tmp_path, capacity_bytes=1 << 20)
    store(first, b"a", b"b", b"c")
    now = time.time()
    for age, key in ((300, b"a"), (200, b"b"), (100, b"c")):
        os.utime(page_file(tmp_path, key), (now - age, now - age))
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
