"""The Storage contract, run against every backend (and the fault wrapper with no faults)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.storage import FaultInjectingStorage, FileStorage, MemoryStorage, Storage
from kvstrata.storage.base import WriteResult
from kvstrata.storage.errors import (
    BatchLengthMismatch,
    BufferSizeMismatch,
    InvalidBuffer,
    InvalidKey,
    InvalidParameter,
)
from kvstrata.testkit.storage import page_cost, page_payload

Factory = Callable[[int], Storage]


@pytest.fixture(params=["memory", "file", "file-1-thread", "faults-over-memory"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Factory:
    """make(capacity_bytes) -> a fresh storage of the parametrised backend ("file" spreads a
    batch's I/O over its default threads, "file-1-thread" does it all in the caller)."""

    def factory(capacity_bytes: int) -> Storage:
        if request.param == "memory":
            return MemoryStorage(capacity_bytes=capacity_bytes)
        if request.param.startswith("file"):
            threads = 1 if request.param == "file-1-thread" else 4
            return FileStorage(
                tmp_path, capacity_bytes=capacity_bytes, namespace="contract", io_threads=threads
            )
        return FaultInjectingStorage(MemoryStorage(capacity_bytes=capacity_bytes))

    return factory


def lru(storage: Storage) -> list[bytes]:
    inner = storage.inner if isinstance(storage, FaultInjectingStorage) else storage
    assert isinstance(inner, MemoryStorage | FileStorage)
    return inner.lru_keys()


def put(storage: Storage, *keys: bytes, size: int = 64) -> list[bool]:
    return storage.batch_set(list(keys), [page_payload(k, size) for k in keys])


def read(storage: Storage, key: bytes, size: int = 64) -> bytes | None:
    out = bytearray(size)
    return bytes(out) if storage.batch_get([key], [out])[0] else None


def test_empty_storage_has_nothing(make: Factory) -> None:
    storage = make(1 << 20)
    assert storage.batch_exists([b"a", b"b"]) == 0
    assert storage.batch_exists([]) == 0
    assert storage.batch_get([b"a"], [bytearray(8)]) == [False]
    assert storage.delete([b"a"]) == 0
    stats = storage.stats()
    assert (stats.num_pages, stats.used_bytes, stats.hits, stats.misses) == (0, 0, 0, 1)
    storage.check_integrity()


def test_round_trip_is_bit_identical_for_every_buffer_kind(make: Factory) -> None:
    storage = make(1 << 20)
    gen = torch.Generator().manual_seed(0)
    sources: list[object] = [
        bytearray(page_payload(b"ba", 96)),
        np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32),
        torch.randn(3, 8, generator=gen).to(torch.bfloat16),
        torch.randint(0, 255, (2, 40), generator=gen, dtype=torch.uint8),
        memoryview(bytearray(page_payload(b"mv", 200)))[50:150],
    ]
    keys = [b"bytearray", b"numpy", b"bf16", b"u8", b"slice"]
    assert storage.batch_set(keys, sources) == [True] * 5  # pyright: ignore[reportArgumentType]
    outs: list[object] = [
        bytearray(96),
        np.zeros((4, 6), np.float32),
        torch.zeros(3, 8, dtype=torch.bfloat16),
        torch.zeros(2, 40, dtype=torch.uint8),
        memoryview(bytearray(300))[100:200],
    ]
    assert storage.batch_get(keys, outs) == [True] * 5  # pyright: ignore[reportArgumentType]
    assert outs[0] == sources[0]
    np.testing.assert_array_equal(outs[1], sources[1])  # pyright: ignore[reportArgumentType]
    assert torch.equal(outs[2].view(torch.int16), sources[2].view(torch.int16))  # pyright: ignore
    assert torch.equal(outs[3], sources[3])  # pyright: ignore[reportArgumentType]
    assert bytes(outs[4]) == bytes(sources[4])  # pyright: ignore[reportArgumentType]
    storage.check_integrity()


def test_exists_counts_consecutive_pages_from_the_first(make: Factory) -> None:
    storage = make(1 << 20)
    put(storage, b"k1", b"k2", b"k4")
    assert storage.batch_exists([b"k1", b"k2", b"k3", b"k4"]) == 2
    assert storage.batch_exists([b"k3", b"k1"]) == 0
    assert storage.batch_exists([b"k4", b"k1", b"k2"]) == 3


def test_wrong_buffer_size_raises_before_any_buffer_is_written(make: Factory) -> None:
    storage = make(1 << 20)
    put(storage, b"a", b"b", size=32)
    order = lru(storage)
    first, second = bytearray(b"\x07" * 32), bytearray(b"\x07" * 31)
    with pytest.raises(BufferSizeMismatch):
        storage.batch_get([b"a", b"b"], [first, second])
    assert first == b"\x07" * 32 and second == b"\x07" * 31
    assert lru(storage) == order
    assert storage.stats().hits == 0


def test_argument_errors_change_nothing(make: Factory) -> None:
    storage = make(1 << 20)
    with pytest.raises(BatchLengthMismatch):
        storage.batch_set([b"a", b"b"], [b"x"])
    with pytest.raises(InvalidKey):
        storage.batch_set(["a"], [b"x"])  # pyright: ignore[reportArgumentType]
    with pytest.raises(InvalidKey):
        storage.batch_exists([b""])
    with pytest.raises(InvalidBuffer):
        storage.batch_set([b"a"], [np.zeros((4, 4), np.uint8)[:, ::2]])
    with pytest.raises(InvalidBuffer):
        storage.batch_set([b"a"], [object()])  # pyright: ignore[reportArgumentType]
    with pytest.raises(InvalidBuffer, match="CPU"):
        storage.batch_set([b"a"], [torch.empty(4, device="meta")])  # pyright: ignore
    with pytest.raises(InvalidBuffer, match="contiguous"):
        storage.batch_set([b"a"], [torch.zeros(4, 4).t()])  # pyright: ignore
    put(storage, b"a", size=8)
    with pytest.raises(InvalidBuffer):
        storage.batch_get([b"a"], [b"\x00" * 8])  # read-only
    assert storage.stats().num_pages == 1
    assert storage.stats().pages_written == 1


def test_set_of_a_stored_key_keeps_the_stored_page(make: Factory) -> None:
    storage = make(1 << 20)
    assert put(storage, b"a", size=16) == [True]
    assert storage.batch_set([b"a"], [b"\xff" * 16]) == [True]
    assert read(storage, b"a", 16) == page_payload(b"a", 16)
    assert storage.stats().pages_written == 1


def test_delete_and_clear(make: Factory) -> None:
    storage = make(1 << 20)
    put(storage, b"a", b"b", b"c")
    assert storage.delete([b"a", b"zz", b"c"]) == 2
    assert storage.batch_exists([b"b"]) == 1 and storage.batch_exists([b"a"]) == 0
    storage.clear()
    assert storage.batch_exists([b"b"]) == 0
    assert storage.stats().num_pages == 0 and storage.stats().used_bytes == 0
    assert put(storage, b"a") == [True]
    storage.check_integrity()


def cost_of(make: Factory, payload_bytes: int) -> int:
    """What one page of `payload_bytes` costs against the capacity of `make`'s backend."""
    probe = make(1 << 20)
    cost = page_cost(
        probe.inner if isinstance(probe, FaultInjectingStorage) else probe, payload_bytes
    )
    probe.clear()
    return cost


def test_capacity_evicts_least_recently_used(make: Factory) -> None:
    cost = cost_of(make, 64)
    storage = make(3 * cost)
    put(storage, b"a", b"b", b"c")
    assert read(storage, b"a") is not None  # a is now the most recently used
    assert lru(storage) == [b"b", b"c", b"a"]
    assert put(storage, b"d") == [True]
    assert lru(storage) == [b"c", b"a", b"d"]
    assert storage.batch_exists([b"b"]) == 0
    assert storage.stats().evictions == 1
    assert storage.stats().used_bytes == 3 * cost
    storage.check_integrity()


def test_a_batch_never_evicts_its_own_pages(make: Factory) -> None:
    cost = cost_of(make, 64)
    storage = make(2 * cost)
    put(storage, b"old")
    assert put(storage, b"x", b"y", b"z") == [True, True, False]
    assert storage.batch_exists([b"x", b"y"]) == 2
    assert storage.batch_exists([b"old"]) == 0
    assert storage.stats().write_failures == 1
    storage.check_integrity()


def test_page_larger_than_capacity_is_refused_alone(make: Factory) -> None:
    storage = make(1000)
    big, small = b"\x01" * 5000, b"\x02" * 10
    assert storage.batch_set([b"big", b"small"], [big, small]) == [False, True]
    assert storage.batch_exists([b"small"]) == 1 and storage.batch_exists([b"big"]) == 0


def test_stats_count_pages_bytes_hits_and_misses(make: Factory) -> None:
    storage = make(1 << 20)
    put(storage, b"a", b"b", size=100)
    storage.batch_get([b"a", b"b", b"c"], [bytearray(100) for _ in range(3)])
    stats = storage.stats()
    assert (stats.pages_written, stats.bytes_written) == (2, 200)
    assert (stats.pages_read, stats.bytes_read, stats.hits, stats.misses) == (2, 200, 2, 1)
    assert stats.latency["set"].count == 1 and stats.latency["get"].count == 1
    assert stats.num_pages == 2


def test_stats_count_only_the_bytes_of_pages_written_or_hit(make: Factory) -> None:
    storage = make(1000)
    put(storage, b"old", size=30)
    results = storage.batch_set_results(
        [b"old", b"big", b"new"], [b"\x01" * 30, b"\x02" * 5000, b"\x03" * 70]
    )
    assert results == [WriteResult.PRESENT, WriteResult.FAILED, WriteResult.WRITTEN]
    stats = storage.stats()
    assert (stats.pages_written, stats.bytes_written, stats.write_failures) == (2, 100, 1)
    found = storage.batch_get(
        [b"new", b"big", b"old"], [bytearray(70), bytearray(5000), bytearray(30)]
    )
    assert found == [True, False, True]
    assert (storage.stats().pages_read, storage.stats().bytes_read) == (2, 100)


class _TruthyFlags(MemoryStorage):
    """A backend whose `_get_into` flags hits with `1` / numpy's `True` instead of `True`
    (truthy, equal to True, not the same object)."""

    def __init__(self, flag: object) -> None:
        super().__init__(capacity_bytes=1 << 20)
        self.flag = flag

    def _get_into(self, keys: Sequence[bytes], views: list[memoryview]) -> list[bool]:
        return [self.flag if ok else 0 for ok in super()._get_into(keys, views)]  # type: ignore[misc]


@pytest.mark.parametrize("flag", [1, np.True_], ids=["int", "numpy"])
def test_bytes_read_counts_hits_a_backend_flags_with_truthy_values(flag: object) -> None:
    storage = _TruthyFlags(flag)
    put(storage, b"a", size=30)
    found = storage.batch_get([b"a", b"gone"], [bytearray(30), bytearray(70)])
    assert found == [True, False]
    stats = storage.stats()
    assert (stats.hits, stats.pages_read, stats.bytes_read) == (1, 1, 30)


def test_negative_capacity_is_refused(make: Factory) -> None:
    with pytest.raises(InvalidParameter):
        make(-1)


def test_concurrent_threads_read_only_whole_pages(make: Factory) -> None:
    cost = cost_of(make, 512)
    storage = make(40 * cost)  # smaller than the key space: evictions race with reads
    keys = [f"key-{i}".encode() for i in range(60)]
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(150):
            batch = [keys[i] for i in rng.choice(len(keys), size=4, replace=False)]
            if rng.random() < 0.5:
                storage.batch_set(batch, [page_payload(k, 512) for k in batch])
            else:
                outs = [bytearray(512) for _ in batch]
                for key, out, ok in zip(batch, outs, storage.batch_get(batch, outs), strict=True):
                    if ok and bytes(out) != page_payload(key, 512):
                        errors.append(f"torn page {key!r}")

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    storage.check_integrity()
    assert storage.stats().used_bytes <= 40 * cost
