"""AllocatorCollector: gauges and counters read from the allocators at scrape time."""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest

import kvstrata.allocator.metrics  # noqa: F401  (importing must register nothing)
from kvstrata.allocator import AllocatorCollector
from kvstrata.testkit.allocators import idx, make_mamba, make_paged, make_swa


def test_collector_reads_usage_and_counters() -> None:
    paged, swa, mamba = make_paged(), make_swa(), make_mamba()
    registry = CollectorRegistry()
    registry.register(AllocatorCollector({"kv": paged, "hybrid": swa, "ssm": mamba}))
    held = paged.alloc(8)
    assert held is not None and paged.alloc(1000) is None
    paged.free(held[:4])
    assert swa.alloc(12) is not None
    assert mamba.alloc(3) is not None

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("kvstrata_allocator_capacity_slots", allocator="kv", pool="kv") == 64
    assert value("kvstrata_allocator_used_slots", allocator="kv", pool="kv") == 4
    assert value("kvstrata_allocator_available_slots", allocator="kv", pool="kv") == 60
    assert value("kvstrata_allocator_alloc_calls_total", allocator="kv") == 2
    assert value("kvstrata_allocator_failed_allocs_total", allocator="kv") == 1
    assert value("kvstrata_allocator_allocated_slots_total", allocator="kv") == 8
    assert value("kvstrata_allocator_free_calls_total", allocator="kv") == 1
    assert value("kvstrata_allocator_freed_slots_total", allocator="kv") == 4
    assert value("kvstrata_allocator_used_slots", allocator="hybrid", pool="full") == 12
    assert value("kvstrata_allocator_available_slots", allocator="hybrid", pool="swa") == 20
    assert value("kvstrata_allocator_used_slots", allocator="ssm", pool="state") == 3

    paged.free(idx([8]))  # read live at the next scrape
    assert value("kvstrata_allocator_used_slots", allocator="kv", pool="kv") == 0
    text = generate_latest(registry).decode()
    assert "# TYPE kvstrata_allocator_alloc_calls_total counter" in text
    assert "# TYPE kvstrata_allocator_used_slots gauge" in text


def test_nothing_registered_globally() -> None:
    names = {metric.name for metric in REGISTRY.collect()}
    assert not any(name.startswith("kvstrata_allocator") for name in names)
