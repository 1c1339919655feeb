"""StorageCollector on a private registry (the histogram itself: packages/core/tests)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from kvstrata.storage import FileStorage, MemoryStorage, StorageCollector


def test_collector_exports_counters_gauges_and_histograms(tmp_path: Path) -> None:
    memory = MemoryStorage(capacity_bytes=100)
    files = FileStorage(tmp_path, capacity_bytes=1 << 20)
    memory.batch_set([b"a", b"b"], [b"x" * 40] * 2)
    memory.batch_set([b"c"], [b"x" * 40])  # evicts a
    memory.batch_get([b"b", b"a"], [bytearray(40), bytearray(40)])
    files.batch_set([b"f"], [b"y" * 10])
    registry = CollectorRegistry()
    registry.register(StorageCollector({"l3-mem": memory, "l3-file": files}))

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    expected_mem = {
        "kvstrata_storage_pages": 2,
        "kvstrata_storage_used_bytes": 80,
        "kvstrata_storage_capacity_bytes": 100,
        "kvstrata_storage_written_pages_total": 3,
        "kvstrata_storage_written_bytes_total": 120,
        "kvstrata_storage_read_pages_total": 1,
        "kvstrata_storage_read_bytes_total": 40,
        "kvstrata_storage_hit_pages_total": 1,
        "kvstrata_storage_missed_pages_total": 1,
        "kvstrata_storage_evicted_pages_total": 1,
        "kvstrata_storage_corrupt_pages_total": 0,
        "kvstrata_storage_failed_write_pages_total": 0,
    }
    assert {name: value(name, storage="l3-mem") for name in expected_mem} == expected_mem
    assert value("kvstrata_storage_pages", storage="l3-file") == 1
    assert value("kvstrata_storage_operation_seconds_count", storage="l3-mem", operation="get") == 1
    assert (
        value("kvstrata_storage_operation_seconds_count", storage="l3-file", operation="get") == 0
    )
    inf = value("kvstrata_storage_operation_seconds_bucket",
                storage="l3-mem", operation="set", le="+Inf")  # fmt: skip
    assert inf == 2
    text = generate_latest(registry).decode()
    assert 'kvstrata_storage_operation_seconds_bucket{le="1e-05",operation="set"' in text
    # Read at scrape time: later work shows without re-registering.
    memory.batch_get([b"c"], [bytearray(40)])
    assert value("kvstrata_storage_hit_pages_total", storage="l3-mem") == 2
