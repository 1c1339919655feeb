"""The CUDA paths: pinned memory, the copy stream, per-layer events. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from kvstrata.pool import MHAKVPool, MHASpec
from kvstrata.pool_host import (
    CopyStrategy,
    HostLayout,
    LayerCompletion,
    MHAHostPool,
    MLAHostPool,
    SharedHostAllocator,
)
from kvstrata.testkit.host_pools import (
    DTYPES,
    FAMILIES,
    HOST_CLASSES,
    Family,
    fill_random,
    make_device_pool,
    page_tokens,
    read_flat,
    zero_pool,
)

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(HostLayout), ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_round_trip_is_bit_identical(
    family: Family, layout: HostLayout, dtype: torch.dtype
) -> None:
    pool = make_device_pool(family, dtype=dtype, device="cuda")
    fill_random(pool, seed=1)
    host = HOST_CLASSES[family](pool, layout=layout, size=10 * pool.page_size)
    assert host.allocator.pinned
    P = pool.page_size
    device_pages = [3, 4, 5, 9, 1, 11]
    host_pages = [0, 1, 2, 6, 7, 3]
    expected = read_flat(pool, device_pages)
    transfer = host.backup(pool, page_tokens(device_pages, P).cuda(), page_tokens(host_pages, P))
    assert transfer.event is not None
    transfer.wait()
    assert transfer.done()
    if layout is not HostLayout.layer_first:
        for page, row in zip(host_pages, expected, strict=True):
            assert bytes(host.page_view(page)) == row.numpy().tobytes()
    zero_pool(pool)
    completion = LayerCompletion(host.layer_ids)
    host.load_layers(
        pool,
        page_tokens(host_pages, P),
        page_tokens([2, 7, 8, 10, 12, 1], P),
        completion=completion,
    )
    for layer in host.layer_ids:
        completion.wait(layer)  # the current stream now waits for that layer's event
    torch.cuda.current_stream().synchronize()
    assert torch.equal(read_flat(pool, [2, 7, 8, 10, 12, 1]), expected)


@pytest.mark.parametrize("layout", list(HostLayout), ids=str)
def test_cuda_long_runs_and_scattered_pages(layout: HostLayout) -> None:
    spec = MHASpec(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    pool = MHAKVPool(spec, 64 * 64, 64, "cuda")  # pages of 512 KiB: 128 KiB per buffer
    fill_random(pool, seed=2)
    host = MHAHostPool(pool, layout=layout, size=64 * 64)
    expected = read_flat(pool, list(range(1, 65)))
    long = host.backup(pool, page_tokens(list(range(1, 33)), 64), page_tokens(list(range(32)), 64))
    scattered_dev = [60, 34, 50, 40, 33, 64]
    scattered_host = [63, 40, 55, 33, 32, 50]
    host.backup(pool, page_tokens(scattered_dev, 64), page_tokens(scattered_host, 64)).wait()
    long.wait()
    assert long.strategy in (CopyStrategy.runs, CopyStrategy.direct)
    zero_pool(pool)
    host.load_layers(
        pool,
        page_tokens([*range(32), *scattered_host], 64),
        page_tokens([*range(1, 33), *scattered_dev], 64),
    )
    torch.cuda.synchronize()
    moved = [*range(1, 33), *scattered_dev]
    assert torch.equal(read_flat(pool, moved), expected[[m - 1 for m in moved]])


def test_cuda_load_orders_after_compute_and_consumer_waits_on_event() -> None:
    pool = make_device_pool("mha", device="cuda", num_layers=2)
    fill_random(pool, seed=3)
    host = MHAHostPool(pool, size=16)
    host.backup(pool, page_tokens([1], 4).cuda(), page_tokens([0], 4)).wait()
    key_bytes = pool.spec.key_bytes_per_token * 4
    expected_k0 = read_flat(pool, [1])[0, :key_bytes]  # K of layer 0 leads the flat page
    zero_pool(pool)  # queued on the current stream: the load's copy stream must wait for it
    completion = LayerCompletion(host.layer_ids)
    load = host.load(pool, page_tokens([0], 4), page_tokens([2], 4), 0, completion=completion)
    assert load.event is not None
    completion.wait(0)
    # work queued on the current stream after wait() sees the loaded layer
    k = pool.get_key_buffer(0)[8:12].clone()
    torch.cuda.current_stream().synchronize()
    assert torch.equal(k.view(torch.uint8).cpu().reshape(-1), expected_k0)
    stats = host.stats()
    assert stats.h2d.calls == 1 and stats.d2h.calls == 1
    assert stats.d2h.latency.count == 1  # harvested once the event fired


def test_cuda_shared_pinned_pool() -> None:
    pool = make_device_pool("mla", device="cuda")
    fill_random(pool, seed=4)
    host = MLAHostPool(pool, size=16, allocator=SharedHostAllocator(pin=True))
    assert host.shared_name is not None
    host.backup(pool, page_tokens([2], 4).cuda(), page_tokens([1], 4)).wait()
    assert bytes(host.page_view(1)) == read_flat(pool, [2]).numpy().tobytes()
    host.close()
