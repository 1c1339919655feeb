"""PoolCollector: exported families and values, read from a fresh registry."""

from __future__ import annotations

import prometheus_client
import torch
from prometheus_client import CollectorRegistry, generate_latest

from kvstrata.pool import PoolCollector, native
from kvstrata.testkit.pools import (
    make_mamba_pool,
    make_mha_pool,
    make_req_to_token_pool,
    make_swa_pool,
)


def test_collector_reads_the_pools_at_scrape_time() -> None:
    kv = make_mha_pool(size=32, page_size=4)
    swa = make_swa_pool(size=32, swa_size=16, page_size=4)
    mamba = make_mamba_pool(size=8)
    table = make_req_to_token_pool(size=8)
    registry = CollectorRegistry()
    registry.register(PoolCollector({"kv": kv, "hybrid": swa, "mamba": mamba, "req": table}))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("kvstrata_pool_capacity_tokens", pool="kv") == 32
    assert value("kvstrata_pool_capacity_tokens", pool="hybrid.full") == 32
    assert value("kvstrata_pool_capacity_tokens", pool="hybrid.swa") == 16
    assert value("kvstrata_pool_capacity_slots", pool="mamba") == 8
    assert value("kvstrata_pool_capacity_tokens", pool="mamba") is None
    assert value("kvstrata_pool_size_bytes", pool="kv") == kv.size_bytes
    assert value("kvstrata_pool_size_bytes", pool="req") == table.size_bytes
    assert value("kvstrata_pool_page_size_bytes", pool="mamba") == mamba.page_size_bytes
    assert value("kvstrata_pool_native_page_copies", pool="kv") == int(kv.native_page_copies)
    assert kv.native_page_copies == (native.native_copies() is not None)
    assert value("kvstrata_pool_page_io_bytes_total", pool="kv", direction="read") == 0

    out = torch.empty((3, kv.page_size_bytes), dtype=torch.uint8)
    kv.read_pages(torch.tensor([1, 2, 3]), out)
    kv.write_pages(torch.tensor([4]), out[:1])
    rows = table.alloc(3)
    assert rows is not None

    read_bytes = value("kvstrata_pool_page_io_bytes_total", pool="kv", direction="read")
    assert read_bytes == 3 * kv.page_size_bytes
    assert value("kvstrata_pool_page_io_pages_total", pool="kv", direction="write") == 1
    assert value("kvstrata_pool_page_io_pages_total", pool="hybrid.swa", direction="read") == 0
    assert value("kvstrata_pool_request_rows", pool="req", state="used") == 3
    assert value("kvstrata_pool_request_rows", pool="req", state="free") == 5
    text = generate_latest(registry).decode()
    assert "# TYPE kvstrata_pool_page_io_bytes_total counter" in text


def test_nothing_registers_globally() -> None:
    PoolCollector({"kv": make_mha_pool()})
    names = {m.name for m in prometheus_client.REGISTRY.collect()}
    assert not any(n.startswith("kvstrata_pool") for n in names)
