"""TierControllerCollector reads the controller's counters at scrape time."""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry

from kvstrata.hybrid_cache import (
    BackupOp,
    LoadOp,
    PageMove,
    TierController,
    TierControllerCollector,
    WriteOp,
)
from kvstrata.storage import MemoryStorage, PageKeyer
from kvstrata.testkit.tiers import make_tiers, page_indices


def test_collector_exports_counters_with_base_units() -> None:
    tiers = make_tiers("full")
    registry = CollectorRegistry()
    storage = MemoryStorage(capacity_bytes=1 << 22)
    with TierController(tiers.group, storage=storage) as controller:
        registry.register(TierControllerCollector({"engine0": controller}))
        assert (
            registry.get_sample_value(
                "kvstrata_tier_ops_submitted_total", {"controller": "engine0", "kind": "write"}
            )
            == 0
        )
        move = {"full": PageMove(device=page_indices([1, 2], 4), host=page_indices([0, 1], 4))}
        controller.wait(controller.submit_write(WriteOp(moves=move)), 10)
        handle = controller.submit_load(LoadOp(moves=move))
        assert handle.wait_all(10)
        controller.wait(handle.op_id, 10)
        keys = PageKeyer(page_size=4).page_keys(torch.arange(8).numpy())
        controller.wait(
            controller.submit_backup(BackupOp(keys=keys, host_pages={"full": [0, 1]})), 10
        )

        def value(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, {"controller": "engine0", **labels})

        page_bytes = tiers.hosts["full"].page_size_bytes
        assert value("kvstrata_tier_ops_submitted_total", kind="write") == 1
        assert value("kvstrata_tier_ops_finished_total", kind="load", status="done") == 1
        assert value("kvstrata_tier_transfer_pages_total", direction="d2h") == 2
        assert value("kvstrata_tier_transfer_bytes_total", direction="h2d") == 2 * page_bytes
        assert (
            value("kvstrata_tier_transfer_bytes_total", direction="storage_set") == 2 * page_bytes
        )
        seconds = value("kvstrata_tier_transfer_seconds_total", direction="d2h")
        assert seconds is not None and seconds > 0
        assert value("kvstrata_tier_queue_depth", kind="prefetch") == 0
        assert value("kvstrata_tier_prefetch_inflight_pages", member="full") == 0
        assert value("kvstrata_tier_storage_faults_total", reason="corrupt") == 0
        waits = value("kvstrata_tier_waits_total")
        assert waits is not None and waits >= 4
        assert value("kvstrata_tier_wait_seconds_total") is not None
        assert value("kvstrata_tier_worker_errors_total", kind="write") == 0
