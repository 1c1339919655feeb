"""The whole-batch paths of `Storage` and `MemoryStorage`: batch-wide checks of flat views and
keys, and the copy-and-insert of a batch of new pages that fits. Each must give exactly the
page-by-page answers and errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata.storage import FileStorage, MemoryStorage
from kvstrata.storage.base import WriteResult, flat_views, page_view
from kvstrata.storage.errors import BatchLengthMismatch, InvalidBuffer, InvalidKey
from kvstrata.storage.keys import SEED_CACHE_ENTRIES, PageKeyer


def _keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def test_flat_views_pass_flat_memoryviews_through_and_check_the_rest_page_by_page() -> None:
    region = bytearray(range(64))
    views = [memoryview(region)[i * 16 : (i + 1) * 16] for i in range(4)]
    got = flat_views(views, writable=True)
    assert got == views
    region[0] = 99  # views of the same memory, no copy
    assert got[0][0] == 99
    plain: list[object] = [views[0], bytes(16), bytearray(16)]
    got = flat_views(plain, writable=False)  # pyright: ignore[reportArgumentType]
    assert [bytes(v) for v in got] == [bytes(p) for p in plain]  # pyright: ignore[reportArgumentType]
    with pytest.raises(InvalidBuffer):  # bytes are read-only: not for a get
        flat_views(plain, writable=True)  # pyright: ignore[reportArgumentType]
    mixed: list[object] = [*views, bytearray(16), np.zeros(4, dtype=np.int32)]
    got = flat_views(mixed, writable=True)  # pyright: ignore[reportArgumentType]
    assert [bytes(v) for v in got] == [bytes(page_view(b, writable=True)) for b in mixed]  # pyright: ignore[reportArgumentType]
    assert all(v.format == "B" and v.ndim == 1 for v in got)


def test_flat_views_casts_views_of_other_formats_and_shapes_like_page_view() -> None:
    ints = memoryview(bytearray(range(16))).cast("i")  # 1-D, format "i"
    square = np.arange(16, dtype=np.uint8).reshape(4, 4).data  # 2-D, contiguous
    batch: list[object] = [memoryview(bytearray(8)), ints, b"abcd", square]
    got = flat_views(batch, writable=False)  # pyright: ignore[reportArgumentType]
    assert all(v.format == "B" and v.ndim == 1 and v.c_contiguous for v in got)
    assert [bytes(v) for v in got] == [bytes(page_view(b, writable=False)) for b in batch]  # pyright: ignore[reportArgumentType]
    assert [v.nbytes for v in got] == [8, 16, 4, 16]


@pytest.mark.parametrize(
    "bad",
    [
        memoryview(bytes(16)),  # read-only, for a get
        memoryview(bytearray(32))[::2],  # strided
        np.zeros((4, 4), dtype=np.uint8)[:, :2].data,  # 2-D, not contiguous
    ],
)
def test_a_bad_view_in_a_batch_of_views_fails_the_get_before_any_copy(bad: memoryview) -> None:
    store = MemoryStorage(capacity_bytes=1 << 20)
    keys = _keys(3)
    assert store.batch_set(keys, [bytes([i]) * 16 for i in range(3)]) == [True] * 3
    outs = [bytearray(16), bytearray(16)]
    with pytest.raises(InvalidBuffer):
        store.batch_get(keys, [memoryview(outs[0]), bad, memoryview(outs[1])])
    assert outs == [bytearray(16), bytearray(16)]  # nothing written
    assert store.stats().hits == 0


def test_a_batch_of_bytes_is_refused_for_a_get_and_taken_for_a_set() -> None:
    store = MemoryStorage(capacity_bytes=1 << 20)
    assert store.batch_set(_keys(2), [b"a" * 8, b"b" * 8]) == [True, True]
    with pytest.raises(InvalidBuffer):
        store.batch_get(_keys(2), [b"x" * 8, b"y" * 8])


def test_a_multidimensional_view_is_flattened_like_page_view() -> None:
    store = MemoryStorage(capacity_bytes=1 << 20)
    array = np.arange(12, dtype=np.int32).reshape(3, 4)
    assert store.batch_set([b"m"], [array.data]) == [True]
    out = np.zeros(12, dtype=np.int32)
    assert store.batch_get([b"m"], [out.data]) == [True]
    assert out.tolist() == list(range(12))


@pytest.mark.parametrize(
    ("keys", "error"),
    [
        ([b"a", b"", b"c"], InvalidKey),
        ([b"a", "b", b"c"], InvalidKey),
        ([b"a", bytearray(b"b")], InvalidKey),
    ],
)
def test_batch_wide_key_checks_raise_before_anything_is_stored(
    keys: list[bytes], error: type[Exception]
) -> None:
    store = MemoryStorage(capacity_bytes=1 << 20)
    with pytest.raises(error):
        store.batch_set(keys, [b"x"] * len(keys))
    with pytest.raises(error):
        store.batch_exists(keys)
    assert store.stats().num_pages == 0


def test_a_length_mismatch_raises_before_anything_is_stored() -> None:
    store = MemoryStorage(capacity_bytes=1 << 20)
    with pytest.raises(BatchLengthMismatch):
        store.batch_set(_keys(3), [memoryview(b"x")] * 2)
    assert store.stats().num_pages == 0


def test_a_batch_of_new_pages_that_fits_is_written_in_order_as_copies() -> None:
    store = MemoryStorage(capacity_bytes=1 << 20)
    region = bytearray(range(256)) * 2
    views = [memoryview(region)[i * 64 : (i + 1) * 64] for i in range(8)]
    keys = _keys(8)
    assert store.batch_set_results(keys, views) == [WriteResult.WRITTEN] * 8
    assert store.lru_keys() == keys  # in batch order, as page by page
    expected = [bytes(v) for v in views]
    region[:] = bytes(len(region))  # the store holds copies: the caller may reuse its buffers
    outs = [bytearray(64) for _ in keys]
    assert store.batch_get(keys[::-1], [memoryview(o) for o in outs]) == [True] * 8
    assert [bytes(o) for o in outs] == expected[::-1]
    assert store.lru_keys() == keys[::-1]  # each hit became the most recently used
    stats = store.stats()
    assert (stats.pages_written, stats.bytes_written, stats.used_bytes) == (8, 512, 512)
    assert (stats.hits, stats.bytes_read) == (8, 512)
    store.check_integrity()


def test_a_batch_with_a_stored_or_repeated_key_gives_the_page_by_page_results() -> None:
    store = MemoryStorage(capacity_bytes=1 << 20)
    assert store.batch_set([b"b"], [b"B" * 4]) == [True]
    results = store.batch_set_results([b"a", b"b", b"a", b"c"], [b"1" * 4] * 4)
    assert results == [
        WriteResult.WRITTEN,
        WriteResult.PRESENT,
        WriteResult.PRESENT,
        WriteResult.WRITTEN,
    ]
    assert store.lru_keys() == [b"b", b"a", b"c"]
    assert store.stats().pages_written == 3
    store.check_integrity()


def test_a_batch_that_needs_evictions_or_has_spares_takes_the_page_by_page_path() -> None:
    store = MemoryStorage(capacity_bytes=40)
    assert store.batch_set(_keys(4), [b"x" * 10] * 4) == [True] * 4
    # Full: the next batch evicts the two oldest pages (never its own) ...
    assert store.batch_set(_keys(2, "n"), [b"y" * 10] * 2) == [True, True]
    assert store.lru_keys() == [b"k2", b"k3", b"n0", b"n1"]
    assert store.stats().evictions == 2
    # ... a delete leaves a spare, which the next batch reuses rather than allocating.
    assert store.delete([b"k2"]) == 1
    assert store.batch_set([b"s"], [b"z" * 10]) == [True]
    assert store.lru_keys() == [b"k3", b"n0", b"n1", b"s"]
    # A page larger than the capacity fails alone.
    assert store.batch_set_results([b"big", b"t"], [b"q" * 41, b"w" * 10]) == [
        WriteResult.FAILED,
        WriteResult.WRITTEN,
    ]
    assert store.stats().write_failures == 1
    store.check_integrity()


def test_a_torch_tensor_batch_still_goes_through_page_view() -> None:
    store = MemoryStorage(capacity_bytes=1 << 20)
    pages = [torch.full((4,), float(i)) for i in range(3)]
    assert store.batch_set(_keys(3), pages) == [True] * 3
    outs = [torch.zeros(4) for _ in range(3)]
    assert store.batch_get(_keys(3), outs) == [True] * 3
    assert [o.tolist() for o in outs] == [[float(i)] * 4 for i in range(3)]


def test_the_seed_cache_gives_the_uncached_seed_and_stays_bounded() -> None:
    keyer = PageKeyer(page_size=2)
    fresh = PageKeyer(page_size=2)
    tokens = np.arange(6, dtype=np.int64)
    for salt in [None, "a", b"a", "a", None]:
        assert keyer.page_keys(tokens, cache_salt=salt) == fresh.page_keys(tokens, cache_salt=salt)
        assert keyer.seed(cache_salt=salt) == fresh.seed(cache_salt=salt)
    assert keyer.seed(cache_salt="a") != keyer.seed(cache_salt=b"a")
    for i in range(SEED_CACHE_ENTRIES + 5):
        keyer.seed(extra_key=str(i))
    assert len(keyer._seeds) <= SEED_CACHE_ENTRIES
    assert keyer.seed(extra_key="7") == fresh.seed(extra_key="7")


def test_zero_length_pages_leave_no_spare_behind() -> None:
    store = MemoryStorage(capacity_bytes=1000)
    for _ in range(50):
        assert store.batch_set([b"z"], [b""]) == [True]
        assert store.delete([b"z"]) == 1
    assert store._spares == {}  # pyright: ignore[reportPrivateUsage]
    store.check_integrity()


def test_a_copy_failing_mid_batch_leaves_the_store_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kvstrata.storage.memory as memory

    made = 0

    def failing_copy(view: memoryview) -> bytearray:
        nonlocal made
        made += 1
        if made == 3:
            raise MemoryError
        return bytearray(view)

    store = MemoryStorage(capacity_bytes=1000)
    monkeypatch.setattr(memory, "bytearray", failing_copy, raising=False)
    with pytest.raises(MemoryError):
        store.batch_set(_keys(3), [b"1" * 10, b"2" * 10, b"3" * 10])
    assert store.stats().num_pages == 0 and store.stats().used_bytes == 0
    store.check_integrity()


def test_keys_as_a_numpy_array_are_refused_as_not_bytes() -> None:
    store = MemoryStorage(capacity_bytes=1000)
    with pytest.raises(InvalidKey, match="must be bytes"):
        store.batch_set(np.array([b"a", b"b"]), [b"x", b"y"])  # pyright: ignore[reportArgumentType]


def test_a_released_view_after_a_strided_one_raises_the_first_error_in_order() -> None:
    released = memoryview(bytearray(8))
    released.release()
    with pytest.raises(InvalidBuffer, match="C-contiguous"):
        flat_views([memoryview(bytearray(8))[::2], released], writable=False)


class _ShortKeys(MemoryStorage):
    max_key_bytes = 4


@pytest.mark.parametrize("backend", ["memory", "file"])
def test_trusted_calls_give_the_checked_answers_and_counters(backend: str, tmp_path: Path) -> None:
    """`trusted=True` (the tiers' path: bytes keys, flat byte memoryviews) skips the key and
    buffer checks and nothing else: the same results, pages and counters as the checked call,
    on every backend (a file store reads and writes the caller's views as they are)."""
    pages = [bytes([i]) * 8 for i in range(5)]

    def make(trusted: bool) -> MemoryStorage | FileStorage:
        if backend == "memory":
            return MemoryStorage(capacity_bytes=1 << 20)
        root = tmp_path / str(trusted)
        root.mkdir()
        return FileStorage(root, capacity_bytes=1 << 20, namespace="trusted")

    stores = {trusted: make(trusted) for trusted in (False, True)}
    for trusted, store in stores.items():
        assert (
            store.batch_set(_keys(3), list(map(memoryview, pages[:3])), trusted=trusted)
            == [True] * 3
        )
        results = store.batch_set_results(_keys(5), list(map(memoryview, pages)), trusted=trusted)
        assert results == [WriteResult.PRESENT] * 3 + [WriteResult.WRITTEN] * 2
        assert store.batch_exists([*_keys(2), b"nope", b"k4"], trusted=trusted) == 2
        out = [memoryview(bytearray(8)) for _ in range(3)]
        assert store.batch_get([b"k4", b"nope", b"k0"], out, trusted=trusted) == [
            True,
            False,
            True,
        ]
        assert bytes(out[0]) == pages[4] and bytes(out[2]) == pages[0]
    checked, trusted_stats = (stores[t].stats() for t in (False, True))
    assert [s.latency["set"].count for s in (checked, trusted_stats)] == [2, 2]
    assert trusted_stats.latency["exists"].count == checked.latency["exists"].count == 1
    assert trusted_stats.latency["get"].count == 1
    assert (trusted_stats.pages_written, trusted_stats.hits, trusted_stats.misses) == (
        checked.pages_written,
        checked.hits,
        checked.misses,
    )
    assert stores[True].lru_keys() == stores[False].lru_keys()


def test_trusted_calls_still_check_lengths_and_the_backend_key_limit() -> None:
    store = _ShortKeys(capacity_bytes=1 << 20)
    with pytest.raises(BatchLengthMismatch):
        store.batch_set([b"a", b"b"], [memoryview(b"x")], trusted=True)
    with pytest.raises(BatchLengthMismatch):
        store.batch_get([b"a"], [], trusted=True)
    with pytest.raises(InvalidKey, match="at most 4"):
        store.batch_set([b"a", b"toolong"], [memoryview(b"x")] * 2, trusted=True)
    with pytest.raises(InvalidKey, match="at most 4"):
        store.batch_exists([b"toolong"], trusted=True)
    with pytest.raises(InvalidKey, match="at most 4"):
        store.batch_get([b"toolong"], [memoryview(bytearray(1))], trusted=True)
    assert store.stats().num_pages == 0
    assert store.batch_set([b"abcd"], [memoryview(b"x")], trusted=True) == [True]
