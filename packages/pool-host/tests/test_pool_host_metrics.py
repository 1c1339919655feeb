"""HostPoolCollector: the pools' counters as Prometheus metrics, read at scrape time."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from kvstrata.pool_host import HostLayout, HostPoolCollector, MHAHostPool
from kvstrata.pool_host.errors import UnknownPoolName
from kvstrata.testkit.host_pools import make_device_pool, page_tokens


def test_collector_reports_transfers_capacity_and_allocator_use() -> None:
    pool = make_device_pool("mha", page_size=4, num_layers=3)
    host = MHAHostPool(pool, layout=HostLayout.page_first, size=40)
    allocator = host.make_allocator()
    registry = CollectorRegistry()
    registry.register(HostPoolCollector({"l2": host}, allocators={"l2": allocator}))
    labels = {"pool": "l2", "family": "mha", "layout": "page_first"}

    def value(name: str, direction: str | None = None) -> float | None:
        extra = {} if direction is None else {"direction": direction}
        return registry.get_sample_value(name, {**labels, **extra})

    assert value("kvstrata_host_transfer_bytes_total", "d2h") == 0
    assert value("kvstrata_host_pool_free_tokens") == 40
    pages = allocator.alloc_pages(3)
    assert pages is not None
    host.backup(pool, page_tokens([1, 2, 3], 4), page_tokens(pages, 4))
    host.load_layers(pool, page_tokens(pages[:2], 4), page_tokens([5, 6], 4))

    assert value("kvstrata_host_transfer_bytes_total", "d2h") == 3 * pool.page_size_bytes
    assert value("kvstrata_host_transfer_calls_total", "d2h") == 1
    assert value("kvstrata_host_transfer_pages_total", "d2h") == 3
    assert value("kvstrata_host_transfer_bytes_total", "h2d") == 2 * pool.page_size_bytes
    assert value("kvstrata_host_transfer_calls_total", "h2d") == 3  # one per layer
    assert value("kvstrata_host_transfer_pages_total", "h2d") == 6
    assert value("kvstrata_host_transfer_seconds_count", "d2h") == 1
    assert value("kvstrata_host_transfer_seconds_count", "h2d") == 3
    seconds = value("kvstrata_host_transfer_seconds_sum", "h2d")
    assert seconds is not None and seconds > 0
    assert value("kvstrata_host_pool_capacity_tokens") == 40
    assert value("kvstrata_host_pool_capacity_bytes") == host.size_bytes
    assert value("kvstrata_host_pool_used_tokens") == 12
    assert value("kvstrata_host_pool_free_tokens") == 28
    text = generate_latest(registry).decode()
    inf_bucket = 'kvstrata_host_transfer_seconds_bucket{direction="d2h",family="mha",'
    assert inf_bucket + 'layout="page_first",le="+Inf",pool="l2"} 1.0' in text


def test_allocator_of_an_unknown_pool_is_refused() -> None:
    host = MHAHostPool(make_device_pool("mha"), size=8)
    with pytest.raises(UnknownPoolName, match="l3"):
        HostPoolCollector({"l2": host}, allocators={"l3": host.make_allocator()})


def test_nothing_is_registered_globally() -> None:
    from prometheus_client import REGISTRY

    host = MHAHostPool(make_device_pool("mha"), size=8)
    HostPoolCollector({"l2": host})  # built but never registered by the library itself
    assert not [m for m in REGISTRY.collect() if m.name.startswith("kvstrata_host")]
