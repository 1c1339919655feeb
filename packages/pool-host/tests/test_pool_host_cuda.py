"""The CUDA paths: pinned memory, the copy stream, per-layer events. Skipped without a GPU.
(The round trip of every family, layout and dtype runs on CUDA too: test_pool_host_roundtrip,
parametrised over the devices.)"""

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
    fill_random,
    make_device_pool,
    page_tokens,
    read_flat,
    zero_pool,
)

pytestmark = pytest.mark.cuda


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
