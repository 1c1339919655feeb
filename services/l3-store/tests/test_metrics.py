"""StoreCollector: names and values read from a live StoreCore (no Ray)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvstrata.l3_store.arena import ALIGNMENT
from kvstrata.l3_store.core import StoreCore, StoreParams
from kvstrata.l3_store.metrics import StoreCollector


def _scrape(core: StoreCore) -> dict[str, float]:
    registry = CollectorRegistry()
    registry.register(StoreCollector(core.stats))
    out: dict[str, float] = {}
    for line in generate_latest(registry).decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_values_follow_the_store() -> None:
    core = StoreCore(
        StoreParams(memory_bytes=4 * ALIGNMENT), arena=memoryview(bytearray(4 * ALIGNMENT))
    )
    core.write([b"page-key-0000000", b"page-key-0000001"], [bytes(ALIGNMENT)] * 2)
    core.read([b"page-key-0000000", b"page-key-missing"])
    got = _scrape(core)
    assert got['kvstrata_l3_store_pages{medium="memory"}'] == 2
    assert got['kvstrata_l3_store_pages{medium="disk"}'] == 0
    assert got['kvstrata_l3_store_capacity_bytes{medium="memory"}'] == 4 * ALIGNMENT
    assert got['kvstrata_l3_store_used_bytes{medium="memory"}'] == 2 * ALIGNMENT
    assert got['kvstrata_l3_store_hit_pages_total{medium="memory"}'] == 1
    assert got["kvstrata_l3_store_missed_pages_total"] == 1
    assert got["kvstrata_l3_store_written_pages_total"] == 2
    assert got['kvstrata_l3_store_transfer_bytes_total{direction="storage_set"}'] == 2 * ALIGNMENT
    assert got['kvstrata_l3_store_transfer_bytes_total{direction="storage_get"}'] == ALIGNMENT
    assert not [name for name in got if "node=" in name]


def test_reference_collectors_build_without_ray() -> None:
    (collector,) = StoreCollector.reference_collectors()
    names = {family.name for family in collector.collect()}
    assert "kvstrata_l3_store_used_bytes" in names
    assert "kvstrata_l3_store_transfer_bytes" in names
