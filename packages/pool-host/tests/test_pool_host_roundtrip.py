"""Device -> host -> (L3 bytes) -> host -> device round trips, bit-exact, for every family,
layout and dtype; page views and page I/O against the device pool's flat page format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.pool_host import (
    HostLayout,
    HostPool,
    LayerCompletion,
    MHAHostPool,
    PagePlan,
    vouched_pages,
)
from kvstrata.pool_host.errors import PoolMismatch
from kvstrata.testkit.host_pools import (
    DTYPES,
    FAMILIES,
    HOST_CLASSES,
    DevicePool,
    Family,
    fill_random,
    make_device_pool,
    page_tokens,
    read_flat,
    zero_pool,
)
from kvstrata.testkit.pools import DEVICES

PAGE_FIRST = (HostLayout.page_first, HostLayout.page_first_direct)


def make_host(
    family: Family, device_pool: DevicePool, layout: HostLayout, num_pages: int = 10
) -> HostPool[DevicePool]:
    cls = HOST_CLASSES[family]
    return cls(device_pool, layout=layout, size=num_pages * device_pool.page_size)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", list(HostLayout), ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_is_bit_identical(
    family: Family, layout: HostLayout, dtype: torch.dtype, device: str
) -> None:
    """On CUDA the host memory is pinned, the backup has an event and the per-layer
    completion makes the current stream wait for each layer's copy."""
    # KV families as a pipeline stage holding global layers 2..4: loads report global ids.
    start_layer = 0 if family == "mamba" else 2
    pool = make_device_pool(family, dtype=dtype, start_layer=start_layer, device=device)
    fill_random(pool, seed=1)
    host = make_host(family, pool, layout)
    host.check_integrity()
    cuda = device == "cuda"
    assert host.allocator.pinned == cuda
    P = pool.page_size
    device_pages = [3, 4, 5, 9, 1, 11]  # runs (3..5), then singles
    host_pages = [0, 1, 2, 6, 7, 3]
    expected = read_flat(pool, device_pages)
    transfer = host.backup(
        pool, page_tokens(device_pages, P).to(device), page_tokens(host_pages, P)
    )
    assert (transfer.event is not None) == cuda
    transfer.wait()
    assert transfer.done()
    assert transfer.num_pages == 6
    assert transfer.num_bytes == 6 * pool.page_size_bytes
    if layout is not HostLayout.layer_first:
        for page, row in zip(host_pages, expected, strict=True):
            assert bytes(host.page_view(page)) == row.numpy().tobytes()

    zero_pool(pool)  # every byte that lands from now on must come from the host
    targets = [2, 7, 8, 10, 12, 1]
    completion = LayerCompletion(host.layer_ids)
    loads = host.load_layers(
        pool, page_tokens(host_pages, P), page_tokens(targets, P), completion=completion
    )
    for layer in host.layer_ids:
        completion.wait(layer)  # on CUDA the current stream now waits for that layer's event
    if cuda:
        torch.cuda.current_stream().synchronize()
    assert [load.layer_id for load in loads] == list(host.layer_ids)
    assert host.layer_ids == (range(3) if family == "mamba" else range(2, 5))
    assert torch.equal(read_flat(pool, targets), expected)
    untouched = sorted(set(range(1, pool.num_pages)) - set(targets))
    assert not read_flat(pool, untouched).any()


@pytest.mark.parametrize("layout", list(HostLayout), ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_round_trip_through_l3_bytes_lands_identically(family: Family, layout: HostLayout) -> None:
    """Page bytes leave one host pool (as L3 would store them) and enter another host pool of
    another layout; loaded back to a device they equal the original device pages."""
    pool = make_device_pool(family, dtype=torch.float8_e4m3fn)
    fill_random(pool, seed=2)
    P = pool.page_size
    expected = read_flat(pool, [4, 5, 6])
    host = make_host(family, pool, layout)
    host.backup(pool, page_tokens([4, 5, 6], P), page_tokens([2, 3, 4], P)).wait()
    stored: dict[bytes, bytes] = {}
    for i, host_page in enumerate([2, 3, 4]):
        buf = bytearray(host.page_size_bytes)
        host.read_page_into(host_page, buf)
        stored[b"key%d" % i] = bytes(buf)

    other_layout = HostLayout.layer_first if layout in PAGE_FIRST else HostLayout.page_first
    other = make_host(family, pool, other_layout)
    for i, host_page in enumerate([7, 8, 9]):
        other.write_page_from(host_page, stored[b"key%d" % i])
    zero_pool(pool)
    other.load_layers(pool, page_tokens([7, 8, 9], P), page_tokens([1, 2, 3], P))
    assert torch.equal(read_flat(pool, [1, 2, 3]), expected)


@pytest.mark.parametrize("layout", PAGE_FIRST, ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_page_views_equal_device_read_pages(family: Family, layout: HostLayout) -> None:
    src = make_device_pool(family, dtype=torch.bfloat16)
    fill_random(src, seed=3)
    P = src.page_size
    host = make_host(family, src, layout)
    host.backup(src, page_tokens([8, 2, 3], P), page_tokens([5, 0, 1], P)).wait()
    expected = read_flat(src, [8, 2, 3])
    views = host.page_views(torch.tensor([5, 0, 1]))
    for view, row in zip(views, expected, strict=True):
        assert len(view) == host.page_size_bytes
        assert bytes(view) == row.numpy().tobytes()
    assert host.page_offset(5) == 5 * host.page_size_bytes


@pytest.mark.parametrize("layout", PAGE_FIRST, ids=str)
def test_page_view_is_zero_copy_and_writable(layout: HostLayout) -> None:
    src = make_device_pool("mha")
    fill_random(src, seed=4)
    host = make_host("mha", src, layout)
    view = host.page_view(3)
    view[:] = bytes(range(256)) * (len(view) // 256) + bytes(len(view) % 256)
    again = bytearray(host.page_size_bytes)
    host.read_page_into(3, again)
    assert bytes(again) == bytes(view)
    # and the bytes written through the view reach the device on load
    host.load_layers(src, page_tokens([3], src.page_size), page_tokens([6], src.page_size))
    assert read_flat(src, [6]).numpy().tobytes() == bytes(view)


@pytest.mark.parametrize("family", FAMILIES)
def test_read_page_into_matches_read_pages_for_layer_first(family: Family) -> None:
    src = make_device_pool(family, dtype=torch.float16)
    fill_random(src, seed=5)
    P = src.page_size
    host = make_host(family, src, HostLayout.layer_first)
    host.backup(src, page_tokens([7], P), page_tokens([9], P))
    buf = bytearray(host.page_size_bytes)
    host.read_page_into(9, buf)
    assert bytes(buf) == read_flat(src, [7]).numpy().tobytes()


@pytest.mark.parametrize("layout", list(HostLayout), ids=str)
def test_long_runs_and_scattered_pages_give_the_same_bytes(layout: HostLayout) -> None:
    """Big pages take the one-copy-per-run path, tiny scattered ones the gather/scatter path;
    both must move exactly the same bytes."""
    from kvstrata.pool import MHAKVPool, MHASpec

    spec = MHASpec(num_layers=2, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    src = MHAKVPool(spec, 16 * 16, 16, "cpu")  # 16 pages of 128 KiB; 32 KiB per buffer
    fill_random(src, seed=6)
    expected = read_flat(src, range(1, 17))
    host = MHAHostPool(src, layout=layout, size=16 * 16)
    runs = host.backup(src, page_tokens(list(range(1, 9)), 16), page_tokens(list(range(8)), 16))
    scattered = host.backup(
        src, page_tokens([16, 10, 14, 12], 16), page_tokens([15, 8, 13, 11], 16)
    )
    assert str(runs.strategy) in ("runs", "direct")
    assert runs.num_copies <= 4  # one run, per buffer (4 buffers) or one direct call
    zero_pool(src)
    host.load_layers(
        src,
        page_tokens([*range(8), 15, 8, 13, 11], 16),
        page_tokens([*range(1, 9), 16, 10, 14, 12], 16),
    )
    moved = [*range(1, 9), 16, 10, 14, 12]
    assert torch.equal(read_flat(src, moved), expected[[m - 1 for m in moved]])
    assert not read_flat(src, [9, 11, 13, 15]).any()
    assert scattered.num_pages == 4


@pytest.mark.parametrize("layout", list(HostLayout), ids=str)
@pytest.mark.parametrize("family", FAMILIES)
def test_planned_transfers_move_what_the_checked_ones_move(
    family: Family, layout: HostLayout
) -> None:
    """`backup_planned` / `load_layers_planned` (the trusted path: a plan of `plan_d2h` /
    `plan_h2d`, or of `vouched_pages`) land the same bytes as `backup` / `load_layers`."""
    pool = make_device_pool(family, dtype=torch.float16)
    fill_random(pool, seed=5)
    host = make_host(family, pool, layout)
    P = pool.page_size
    device_pages, host_pages, targets = [3, 4, 9, 1], [5, 6, 0, 2], [2, 7, 8, 10]
    expected = read_flat(pool, device_pages)
    plan = host.plan_d2h(page_tokens(device_pages, P), page_tokens(host_pages, P))
    assert plan.src_pages.tolist() == device_pages and plan.dst_pages.tolist() == host_pages
    host.backup_planned(pool, plan).wait()
    zero_pool(pool)
    vouched = PagePlan(
        vouched_pages(page_tokens(host_pages, P), P), vouched_pages(page_tokens(targets, P), P)
    )
    loads = host.load_layers_planned(pool, vouched)
    assert [load.layer_id for load in loads] == list(host.layer_ids)
    assert torch.equal(read_flat(pool, targets), expected)
    # The pool's identity is still checked on the trusted path.
    other = make_device_pool(family, dtype=torch.float16)
    with pytest.raises(PoolMismatch):
        host.backup_planned(other, plan)
    with pytest.raises(PoolMismatch):
        host.load_layers_planned(other, vouched)


def test_vouched_pages_reads_page_ids_of_any_integer_dtype() -> None:
    tokens = page_tokens([4, 1, 7], 4)
    assert vouched_pages(tokens, 4).tolist() == [4, 1, 7]
    assert vouched_pages(tokens.to(torch.int32), 4).dtype == np.int64
    assert vouched_pages(torch.tensor([3, 9]), 1).tolist() == [3, 9]
