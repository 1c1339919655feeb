"""Issue 17: errors leave state unchanged, one capacity per storage directory, no false
corruption. One regression test per item (2-6) and a short multi-process soak."""

from __future__ import annotations

import os
import threading
import warnings
from pathlib import Path

import pytest
import torch

from kvstrata.storage import FileStorage, PageKeyer, soak
from kvstrata.storage.base import WriteResult
from kvstrata.storage.errors import InvalidBuffer, InvalidParameter
from kvstrata.testkit.storage import page_payload

SIZE = 256


def _path(storage: FileStorage, key: bytes) -> Path:
    return Path(storage._page_path(key))


def _flip_payload_byte(path: Path) -> None:
    with path.open("r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))


# ---------------------------------------------------------------------- item 2


def test_a_flipped_payload_byte_is_not_present_to_a_set_it_is_rewritten(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 20)
    assert storage.batch_set([b"k"], [page_payload(b"k", SIZE)]) == [True]
    _flip_payload_byte(_path(storage, b"k"))
    assert storage.batch_set_results([b"k"], [page_payload(b"k", SIZE)]) == [WriteResult.WRITTEN]
    out = bytearray(SIZE)
    assert storage.batch_get([b"k"], [out]) == [True] and bytes(out) == page_payload(b"k", SIZE)
    assert storage.stats().corrupt_pages == 1
    storage.check_integrity()


def test_a_directory_at_a_page_path_is_not_present(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 20)
    _path(storage, b"k").mkdir(parents=True)
    assert storage.batch_set_results([b"k"], [page_payload(b"k", SIZE)]) == [WriteResult.FAILED]
    assert storage.batch_get([b"k"], [bytearray(SIZE)]) == [False]
    assert _path(storage, b"k").is_dir()
    assert storage.stats().used_bytes == 0
    storage.check_integrity()


# ---------------------------------------------------------------------- item 3


@pytest.mark.parametrize("op", ["get", "exists", "set"])
def test_a_fifo_at_a_page_path_is_a_miss_not_a_hang(tmp_path: Path, op: str) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 20)
    fifo = _path(storage, b"k")
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    result: list[object] = []

    def call() -> None:
        if op == "get":
            result.append(storage.batch_get([b"k"], [bytearray(SIZE)]))
        elif op == "exists":
            result.append(storage.batch_exists([b"k"]))
        else:
            result.append(storage.batch_set([b"k"], [page_payload(b"k", SIZE)]))

    worker = threading.Thread(target=call, daemon=True)
    worker.start()
    worker.join(timeout=10)
    if worker.is_alive():  # unblock the hung open so the thread can end, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"{op} hangs on a FIFO")
    assert result == [{"get": [False], "exists": 0, "set": [False]}[op]]
    assert storage.stats().corrupt_pages == 0


# ---------------------------------------------------------------------- item 4


def test_check_integrity_allows_a_page_another_process_evicted(tmp_path: Path) -> None:
    ours = FileStorage(tmp_path, capacity_bytes=1 << 20)
    theirs = FileStorage(tmp_path, capacity_bytes=1 << 20)
    assert ours.batch_set([b"a", b"b"], [page_payload(b"a", SIZE), page_payload(b"b", SIZE)])
    assert theirs.batch_exists([b"a"]) == 1
    assert theirs.delete([b"a"]) == 1
    ours.check_integrity()  # was a bare FileNotFoundError
    assert ours.batch_get([b"a"], [bytearray(SIZE)]) == [False]
    assert ours.stats().used_bytes == ours.page_file_bytes(SIZE)


def test_a_page_recycled_by_another_process_mid_read_is_a_race_not_corruption(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvstrata.storage import file as file_module

    reader = FileStorage(tmp_path, capacity_bytes=1 << 20, io_threads=1)
    writer = FileStorage(tmp_path, capacity_bytes=1 << 20, io_threads=1)
    assert writer.batch_set([b"a"], [page_payload(b"a", SIZE)]) == [True]
    real = file_module._read_payload

    def evict_then_read(*args: object, **kwargs: object) -> bool | None:
        # Another process evicts the page and reuses its file between our header and payload.
        os.rename(_path(writer, b"a"), _path(writer, b"a").with_suffix(".gone"))
        with open(_path(writer, b"a").with_suffix(".gone"), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            f.write(b"\x00\x01")
        return real(*args, **kwargs)  # pyright: ignore[reportArgumentType]

    monkeypatch.setattr(file_module, "_read_payload", evict_then_read)
    assert reader.batch_get([b"a"], [bytearray(SIZE)]) == [False]
    monkeypatch.undo()
    stats = reader.stats()
    assert (stats.corrupt_pages, stats.race_misses) == (0, 1)


# ---------------------------------------------------------------------- item 5


def test_capacity_holds_for_the_directory_across_storages(tmp_path: Path) -> None:
    page = FileStorage.page_file_bytes(SIZE)
    storages = [FileStorage(tmp_path, capacity_bytes=4 * page) for _ in range(3)]
    for i, storage in enumerate(storages):
        keys = [f"{i}-{j}".encode() for j in range(4)]
        assert all(storage.batch_set(keys, [page_payload(k, SIZE) for k in keys]))
    on_disk = list(tmp_path.rglob("*.page"))
    assert len(on_disk) == 4  # was 12: each process counted only its own
    for storage in storages:
        storage.check_integrity()
        assert storage.stats().used_bytes == 4 * page


def test_a_short_three_process_soak_meets_the_bar(tmp_path: Path) -> None:
    report = soak.run(tmp_path, seconds=2.0, processes=3, capacity_pages=20)
    assert soak.ok(report), report
    assert int(str(report["writes"])) > 0 and int(str(report["hits"])) > 0


# ---------------------------------------------------------------------- item 6


@pytest.mark.parametrize("capacity", ["1GiB", None, 1.5, True])
def test_capacity_of_the_wrong_type_is_refused(tmp_path: Path, capacity: object) -> None:
    with pytest.raises(InvalidParameter, match="capacity_bytes"):
        FileStorage(tmp_path, capacity_bytes=capacity)  # pyright: ignore[reportArgumentType]
    assert list(tmp_path.iterdir()) == []


def test_a_relative_path_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "rel").mkdir()
    with pytest.raises(InvalidParameter, match="absolute"):
        FileStorage("rel", capacity_bytes=1 << 20)
    assert list((tmp_path / "rel").iterdir()) == []


@pytest.mark.parametrize("field", ["extra_key", "cache_salt"])
@pytest.mark.parametrize("value", [3, [1, 2], 1.0])
def test_keyer_fields_of_the_wrong_type_are_refused(field: str, value: object) -> None:
    keyer = PageKeyer(page_size=2)
    with pytest.raises(InvalidParameter, match=field):
        keyer.page_keys([1, 2], **{field: value})  # pyright: ignore[reportArgumentType]
    with pytest.raises(InvalidParameter, match="namespace"):
        PageKeyer(page_size=2, namespace=3)  # pyright: ignore[reportArgumentType]


def test_a_list_extra_key_cannot_collide_with_bytes() -> None:
    keyer = PageKeyer(page_size=2)
    with pytest.raises(InvalidParameter):
        keyer.page_keys([1, 2], extra_key=[1, 2])  # pyright: ignore[reportArgumentType]
    assert keyer.page_keys([1, 2], extra_key=b"\x01\x02") != keyer.page_keys([1, 2])


def test_batch_get_refuses_a_tensor_over_immutable_bytes(tmp_path: Path) -> None:
    storage = FileStorage(tmp_path, capacity_bytes=1 << 20)
    assert storage.batch_set([b"k"], [page_payload(b"k", 16)]) == [True]
    frozen = bytes(16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about the non-writable buffer
        tensor = torch.frombuffer(frozen, dtype=torch.uint8)
    with pytest.raises(InvalidBuffer, match="immutable"):
        storage.batch_get([b"k"], [tensor])
    assert frozen == bytes(16)
    assert storage.stats().hits == 0
