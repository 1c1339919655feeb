"""Layer loads, index validation (before any copy), pool checks and the completion signal."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kvstrata.pool import MHASpec, SWAKVPool, SWASpec, native
from kvstrata.pool_host import (
    CopyStrategy,
    HostLayout,
    LayerCompletion,
    MambaHostPool,
    MHAHostPool,
    MLAHostPool,
    base,
)
from kvstrata.pool_host.errors import (
    DuplicateIndex,
    IndexLengthMismatch,
    IndexOutOfRange,
    InvalidIndices,
    LayerAlreadyLoaded,
    LayerIdOutOfRange,
    LayerLoadFailed,
    LayerWaitTimeout,
    MisalignedIndex,
    NonIntegerIndex,
    PageNotContiguous,
    PoolMismatch,
    ReservedIndex,
)
from kvstrata.testkit.host_pools import (
    buffer_pages,
    fill_random,
    make_device_pool,
    page_tokens,
    read_flat,
    snapshot,
    zero_pool,
)


@pytest.mark.parametrize("layout", list(HostLayout), ids=str)
def test_mha_layer_load_changes_only_that_layer(layout: HostLayout) -> None:
    pool = make_device_pool("mha", num_layers=3, start_layer=5)
    fill_random(pool, seed=1)
    host = MHAHostPool(pool, layout=layout, size=40)
    host.backup(pool, page_tokens([2, 3], 4), page_tokens([0, 1], 4))
    src_rows = snapshot(pool)
    fill_random(pool, seed=2)
    before = snapshot(pool)
    load = host.load(pool, page_tokens([0, 1], 4), page_tokens([7, 9], 4), 6)
    assert load.layer_id == 6
    spec = pool.spec
    assert load.num_bytes == 2 * (spec.key_bytes_per_token + spec.value_bytes_per_token) * 4
    after = snapshot(pool)
    for i, (old, new) in enumerate(zip(before, after, strict=True)):
        if i in (1, 4):  # K and V of layer 6 = local layer 1 of 3
            assert torch.equal(new[[7, 9]], src_rows[i][[2, 3]])
            keep = [p for p in range(old.shape[0]) if p not in (7, 9)]
            assert torch.equal(new[keep], old[keep])
        else:
            assert torch.equal(new, old), f"buffer {i} of another layer changed"


def test_mla_and_mamba_layer_buffers() -> None:
    mla = MLAHostPool(make_device_pool("mla", start_layer=2), size=8)
    assert mla.layer_ids == range(2, 5)
    assert mla.layer_buffer_ids(3) == (1,)
    mamba = MambaHostPool(make_device_pool("mamba"), size=4)
    assert mamba.layer_ids == range(3)
    assert mamba.layer_buffer_ids(2) == (4, 5)
    with pytest.raises(LayerIdOutOfRange):
        mla.layer_buffer_ids(5)
    with pytest.raises(LayerIdOutOfRange):
        mamba.layer_buffer_ids(-1)
    with pytest.raises(LayerIdOutOfRange):
        mla.layer_buffer_ids(3.0)  # type: ignore[arg-type]  # `3.0 in range(...)` is True


def test_mamba_layer_load_moves_conv_and_ssm_of_one_layer() -> None:
    pool = make_device_pool("mamba", num_pages=6)
    fill_random(pool, seed=3)
    host = MambaHostPool(pool, size=6)
    host.backup(pool, torch.tensor([2, 5]), torch.tensor([0, 1]))
    saved = snapshot(pool)
    zero_pool(pool)
    host.load(pool, torch.tensor([0, 1]), torch.tensor([4, 3]), 1)
    for i, buf in enumerate(pool.layer_buffers()):
        rows = buffer_pages(buf, 1)
        if i in (2, 3):
            assert torch.equal(rows[[4, 3]], saved[i][[2, 5]])
            assert not rows[[0, 1, 2, 5, 6]].any()
        else:
            assert not rows.any()


def test_swa_builds_one_host_pool_per_sub_pool() -> None:
    mha = MHASpec(num_layers=2, num_kv_heads=2, head_dim=4)
    spec = SWASpec(full=mha, swa=mha, full_layer_ids=(0, 2), swa_layer_ids=(1, 3), sliding_window=8)
    pool = SWAKVPool(spec, size=32, swa_size=16, page_size=4)
    fill_random(pool.full_pool, seed=4)
    fill_random(pool.swa_pool, seed=5)
    full_host = MHAHostPool(pool.full_pool, size=32)
    swa_host = MHAHostPool(pool.swa_pool, size=16)
    full_host.backup(pool.full_pool, page_tokens([1, 2], 4), page_tokens([0, 1], 4))
    swa_host.backup(pool.swa_pool, page_tokens([3], 4), page_tokens([2], 4))
    full_expected = read_flat(pool.full_pool, [1, 2])
    swa_expected = read_flat(pool.swa_pool, [3])
    zero_pool(pool.full_pool)
    zero_pool(pool.swa_pool)
    full_host.load_layers(pool.full_pool, page_tokens([0, 1], 4), page_tokens([5, 6], 4))
    swa_host.load_layers(pool.swa_pool, page_tokens([2], 4), page_tokens([1], 4))
    assert torch.equal(read_flat(pool.full_pool, [5, 6]), full_expected)
    assert torch.equal(read_flat(pool.swa_pool, [1]), swa_expected)
    with pytest.raises(PoolMismatch):
        full_host.backup(pool.swa_pool, page_tokens([1], 4), page_tokens([0], 4))


BAD_BACKUPS: list[tuple[str, type[InvalidIndices], Callable[[], tuple[list[int], list[int]]]]] = [
    ("misaligned device", MisalignedIndex, lambda: ([5, 6, 7, 8], [0, 1, 2, 3])),
    ("out-of-order page", MisalignedIndex, lambda: ([5, 4, 6, 7], [0, 1, 2, 3])),
    ("partial page", IndexLengthMismatch, lambda: ([4, 5, 6], [0, 1, 2])),
    ("length mismatch", IndexLengthMismatch, lambda: ([4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 6, 7])),
    ("device page 0", ReservedIndex, lambda: ([0, 1, 2, 3, 4, 5, 6, 7], list(range(8)))),
    ("device out of range", IndexOutOfRange, lambda: ([52, 53, 54, 55], [0, 1, 2, 3])),
    ("host out of range", IndexOutOfRange, lambda: ([4, 5, 6, 7], [40, 41, 42, 43])),
    ("negative host", IndexOutOfRange, lambda: ([4, 5, 6, 7], [-4, -3, -2, -1])),
    ("duplicate host page", DuplicateIndex, lambda: ([4, 5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 3] * 2)),
]


@pytest.mark.parametrize("case", BAD_BACKUPS, ids=[c[0] for c in BAD_BACKUPS])
@pytest.mark.parametrize("layout", list(HostLayout), ids=str)
def test_bad_backup_indices_are_rejected_before_any_copy(
    case: tuple[str, type[InvalidIndices], Callable[[], tuple[list[int], list[int]]]],
    layout: HostLayout,
) -> None:
    _, error, make = case
    src = make_device_pool("mha", num_pages=12)  # pages 1..12, page size 4
    fill_random(src, seed=6)
    host = MHAHostPool(src, layout=layout, size=40)
    sentinel = bytes([0xA5]) * host.page_size_bytes
    for page in range(host.num_pages):
        host.write_page_from(page, sentinel)
    device_idx, host_idx = make()
    # a valid first page followed by the bad part must not copy the valid page either
    with pytest.raises(error):
        host.backup(src, torch.tensor(device_idx), torch.tensor(host_idx))
    buf = bytearray(host.page_size_bytes)
    for page in range(host.num_pages):
        host.read_page_into(page, buf)
        assert bytes(buf) == sentinel, f"host page {page} changed by a refused backup"
    assert host.stats().d2h.calls == 0


def test_bad_load_indices_are_rejected_before_any_copy() -> None:
    dst = make_device_pool("mha", num_pages=12)
    host = MHAHostPool(dst, size=40)
    fill_random(dst, seed=7)
    before = snapshot(dst)
    cases = [
        (page_tokens([0, 1], 4), page_tokens([3, 3], 4), DuplicateIndex),
        (page_tokens([0, 1], 4), page_tokens([0, 3], 4), ReservedIndex),
        (page_tokens([0, 10], 4), page_tokens([2, 3], 4), IndexOutOfRange),
        (page_tokens([0], 4), page_tokens([2, 3], 4), IndexLengthMismatch),
        (torch.tensor([0.0, 1.0, 2.0, 3.0]), page_tokens([2], 4), MisalignedIndex),
    ]
    for host_idx, device_idx, error in cases:
        with pytest.raises(error):
            host.load(dst, host_idx, device_idx, 0)
        with pytest.raises(error):
            host.load_layers(dst, host_idx, device_idx)
    with pytest.raises(LayerIdOutOfRange):
        host.load(dst, page_tokens([0], 4), page_tokens([2], 4), 3)
    after = snapshot(dst)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    assert host.stats().h2d.calls == 0


def test_mismatched_device_pool_is_refused() -> None:
    src = make_device_pool("mha", num_layers=3)
    host = MHAHostPool(src, size=16)
    with pytest.raises(PoolMismatch):
        host.backup(make_device_pool("mha", num_layers=2), page_tokens([1], 4), page_tokens([0], 4))
    with pytest.raises(PoolMismatch):
        host.load(make_device_pool("mha", page_size=2), page_tokens([0], 4), page_tokens([1], 4), 0)
    # even a pool of the same geometry: a host pool mirrors one device pool
    with pytest.raises(PoolMismatch):
        host.backup(make_device_pool("mha", num_layers=3), page_tokens([1], 4), page_tokens([0], 4))


def test_empty_transfers_are_no_ops() -> None:
    src = make_device_pool("mla")
    host = MLAHostPool(src, size=8)
    empty = torch.empty(0, dtype=torch.int64)
    t = host.backup(src, empty, empty)
    assert (t.num_pages, t.num_copies, t.strategy) == (0, 0, CopyStrategy.empty)
    completion = LayerCompletion(host.layer_ids)
    host.load_layers(src, empty, empty, completion=completion)
    assert completion.num_loaded == len(host.layer_ids)


def test_page_ids_must_be_integers() -> None:
    host = MHAHostPool(make_device_pool("mha"), size=16)
    assert len(host.page_views(torch.tensor([1, 3], dtype=torch.int32))) == 2
    numpy_page = np.int64(2)  # NumPy integers index like ints
    assert bytes(host.page_view(numpy_page)) == bytes(host.page_view(2))  # pyright: ignore[reportArgumentType]
    with pytest.raises(NonIntegerIndex):
        host.page_views(torch.tensor([1.5]))  # not rounded down to page 1
    for bad in (1.5, "1", None):
        with pytest.raises(IndexOutOfRange):
            host.page_view(bad)  # type: ignore[arg-type]
        with pytest.raises(IndexOutOfRange):
            host.read_page_into(bad, bytearray(host.page_size_bytes))  # type: ignore[arg-type]


def test_page_views_check_every_page_before_making_any() -> None:
    host = MHAHostPool(make_device_pool("mha"), size=16)
    pages = host.num_pages
    views = host.page_views([3, 0, pages - 1])
    assert [bytes(v) for v in views] == [bytes(host.page_view(p)) for p in (3, 0, pages - 1)]
    views[0][:4] = b"abcd"  # writable, zero-copy
    assert bytes(host.page_view(3)[:4]) == b"abcd"
    for bad in ([0, pages], [-1, 2], [1, 2.0], [1, None]):
        with pytest.raises(IndexOutOfRange):
            host.page_views(bad)
    assert host.page_views([]) == []


def test_layer_first_has_no_page_view() -> None:
    host = MHAHostPool(make_device_pool("mha"), layout=HostLayout.layer_first, size=8)
    with pytest.raises(PageNotContiguous):
        host.page_view(0)
    with pytest.raises(PageNotContiguous):
        host.page_offset(0)
    with pytest.raises(PageNotContiguous):
        host.page_views([0])
    with pytest.raises(IndexOutOfRange):
        host.read_page_into(2, bytearray(host.page_size_bytes))


def test_consumer_waits_for_each_layer_while_a_worker_loads() -> None:
    pool = make_device_pool("mha", num_layers=4)
    fill_random(pool, seed=8)
    host = MHAHostPool(pool, size=16)
    host.backup(pool, page_tokens([1, 2], 4), page_tokens([0, 1], 4))
    expected = read_flat(pool, [1, 2])
    zero_pool(pool)
    completion = LayerCompletion(host.layer_ids)
    release = threading.Event()
    seen: list[int] = []

    def worker() -> None:
        for layer in host.layer_ids:
            if layer == 2:
                release.wait(timeout=30)  # hold layer 2 back until the consumer checked
            host.load(
                pool, page_tokens([0, 1], 4), page_tokens([3, 4], 4), layer, completion=completion
            )

    thread = threading.Thread(target=worker)
    thread.start()
    completion.wait(0, timeout=30)
    completion.wait(1, timeout=30)
    seen.extend(layer for layer in host.layer_ids if completion.is_loaded(layer))
    assert seen == [0, 1]
    with pytest.raises(LayerWaitTimeout):
        completion.wait(2, timeout=0.05)
    release.set()
    completion.wait(3, timeout=30)
    thread.join()
    assert completion.num_loaded == 4
    assert torch.equal(read_flat(pool, [3, 4]), expected)


def test_failed_load_wakes_waiters_with_an_error() -> None:
    src = make_device_pool("mha", num_layers=2)
    host = MHAHostPool(src, size=16)
    completion = LayerCompletion(host.layer_ids)
    host.load(src, page_tokens([0], 4), page_tokens([1], 4), 0, completion=completion)
    completion.fail(RuntimeError("copy engine on fire"))
    completion.wait(0)  # arrived before the failure: still fine
    with pytest.raises(LayerLoadFailed, match="layer 1"):
        completion.wait(1)
    with pytest.raises(LayerIdOutOfRange):
        completion.wait(7)


def test_load_layers_fails_the_completion_when_a_copy_raises(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src = make_device_pool("mha", num_layers=3)
    with native.disabled():  # the per-layer NumPy path (the compiled one: copy_native tests)
        host = MHAHostPool(src, size=16)
    completion = LayerCompletion(host.layer_ids)
    calls = 0
    real_copy_rows = base.copy_rows

    def copy_rows_failing_on_layer_1(*args: Any, **kwargs: Any) -> int:
        nonlocal calls
        calls += 1
        if calls == 3:  # an MHA layer is 2 buffers: call 3 is layer 1's K
            raise RuntimeError("copy engine on fire")
        return real_copy_rows(*args, **kwargs)

    monkeypatch.setattr(base, "copy_rows", copy_rows_failing_on_layer_1)
    with pytest.raises(RuntimeError, match="on fire"):
        host.load_layers(src, page_tokens([0], 4), page_tokens([1], 4), completion=completion)
    completion.wait(0, timeout=1)  # landed before the failure
    for layer in (1, 2):  # the failed layer and the one never started both wake with the error
        with pytest.raises(LayerLoadFailed, match=f"layer {layer}") as failed:
            completion.wait(layer, timeout=1)
        assert isinstance(failed.value.__cause__, RuntimeError)
    assert completion.num_loaded == 1


def test_a_completion_that_does_not_expect_the_layers_is_refused_before_any_copy() -> None:
    src = make_device_pool("mha", num_layers=2)
    fill_random(src, seed=9)
    host = MHAHostPool(src, size=16)
    host.backup(src, page_tokens([2], 4), page_tokens([0], 4))
    fill_random(src, seed=10)
    before = snapshot(src)
    args = (src, page_tokens([0], 4), page_tokens([1], 4))

    other = LayerCompletion([0])  # layer 1 is not part of it
    with pytest.raises(LayerIdOutOfRange):
        host.load_layers(*args, completion=other)
    with pytest.raises(LayerIdOutOfRange):
        host.load(*args, 1, completion=other)
    assert other.num_loaded == 0, "layer 0 was loaded and marked before the refusal"

    marked = LayerCompletion(host.layer_ids)
    marked.mark_loaded(1)
    with pytest.raises(LayerAlreadyLoaded):
        host.load_layers(*args, completion=marked)
    with pytest.raises(LayerAlreadyLoaded):
        host.load(*args, 1, completion=marked)
    with pytest.raises(LayerAlreadyLoaded, match="twice"):
        host.load_layers(*args, completion=LayerCompletion([0, 1]), layer_ids=[0, 0])

    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(src), strict=True))
    assert host.stats().h2d.calls == 0
