"""Counters of the tier controller and the Prometheus collector that reads them at scrape time.

The controller updates plain integers and floats in a `ControllerStats` under the stats lock (a
worker thread and the caller's thread both count); the collector copies them out with
`snapshot()` when Prometheus scrapes, so the hot path pays an integer add and nothing else.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvstrata.hybrid_cache.ops import AckStatus, OpKind


class Direction(StrEnum):
    """Which way pages moved."""

    D2H = "d2h"  # write: device -> host
    H2D = "h2d"  # load: host -> device
    STORAGE_GET = "storage_get"  # prefetch: storage -> host
    STORAGE_SET = "storage_set"  # backup: host -> storage


class FaultReason(StrEnum):
    """Why a storage call ended a prefetch or a backup early."""

    MISS = "miss"  # batch_exists said present, batch_get then returned False (evicted, corrupt)
    CORRUPT = "corrupt"  # batch_get returned a page whose bytes fail their stored checksum
    TIMEOUT = "timeout"  # the call took longer than `storage_call_timeout_s`
    ERROR = "error"  # the call raised
    WRITE_FAILED = "write_failed"  # batch_set returned False for a page


@dataclass(frozen=True, kw_only=True)
class StatsSnapshot:
    """A consistent copy of every counter (see `ControllerStats` for their meaning)."""

    submitted: dict[OpKind, int]
    finished: dict[tuple[OpKind, AckStatus], int]
    merged: dict[OpKind, int]
    worker_errors: dict[OpKind, int]
    pages: dict[Direction, int]
    bytes: dict[Direction, int]
    transfer_seconds: dict[Direction, float]
    storage_faults: dict[FaultReason, int]
    prefetch_refused: int
    backup_skipped_pages: int
    waits: int
    wait_seconds: float


@dataclass
class ControllerStats:
    """Counters since the controller was built. Every update goes through one method here.

    submitted[kind]            ops accepted by a submit
    finished[kind, status]     acks issued, by status
    merged[kind]               ops that rode in another op's transfer (batch size - 1)
    worker_errors[kind]        batches whose run raised (their ops were failed and acked)
    pages / bytes / transfer_seconds[direction]   what moved and how long the copies took
    storage_faults[reason]     storage calls that ended a prefetch or backup early
    prefetch_refused           prefetch submits refused: in-flight pages would pass the share
    backup_skipped_pages       pages a backup found already stored
    waits / wait_seconds       caller time blocked in wait() and LoadHandle.wait_layer()
    """

    submitted: dict[OpKind, int] = field(default_factory=lambda: dict.fromkeys(OpKind, 0))
    finished: dict[tuple[OpKind, AckStatus], int] = field(
        default_factory=lambda: {(k, s): 0 for k in OpKind for s in AckStatus}
    )
    merged: dict[OpKind, int] = field(default_factory=lambda: dict.fromkeys(OpKind, 0))
    worker_errors: dict[OpKind, int] = field(default_factory=lambda: dict.fromkeys(OpKind, 0))
    pages: dict[Direction, int] = field(default_factory=lambda: dict.fromkeys(Direction, 0))
    bytes: dict[Direction, int] = field(default_factory=lambda: dict.fromkeys(Direction, 0))
    transfer_seconds: dict[Direction, float] = field(
        default_factory=lambda: dict.fromkeys(Direction, 0.0)
    )
    storage_faults: dict[FaultReason, int] = field(
        default_factory=lambda: dict.fromkeys(FaultReason, 0)
    )
    prefetch_refused: int = 0
    backup_skipped_pages: int = 0
    waits: int = 0
    wait_seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count_submitted(self, kind: OpKind) -> None:
        with self._lock:
            self.submitted[kind] += 1

    def count_finished(self, kind: OpKind, status: AckStatus) -> None:
        with self._lock:
            self.finished[kind, status] += 1

    def count_merged(self, kind: OpKind, num_ops: int) -> None:
        with self._lock:
            self.merged[kind] += num_ops

    def count_worker_error(self, kind: OpKind) -> None:
        with self._lock:
            self.worker_errors[kind] += 1

    def count_transfer(
        self, direction: Direction, *, num_pages: int, num_bytes: int, seconds: float
    ) -> None:
        with self._lock:
            self.pages[direction] += num_pages
            self.bytes[direction] += num_bytes
            self.transfer_seconds[direction] += seconds

    def count_fault(self, reason: FaultReason, num: int = 1) -> None:
        with self._lock:
            self.storage_faults[reason] += num

    def count_prefetch_refused(self) -> None:
        with self._lock:
            self.prefetch_refused += 1

    def count_backup_skipped(self, num_pages: int) -> None:
        with self._lock:
            self.backup_skipped_pages += num_pages

    def count_wait(self, seconds: float) -> None:
        with self._lock:
            self.waits += 1
            self.wait_seconds += seconds

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            return StatsSnapshot(
                submitted=dict(self.submitted),
                finished=dict(self.finished),
                merged=dict(self.merged),
                worker_errors=dict(self.worker_errors),
                pages=dict(self.pages),
                bytes=dict(self.bytes),
                transfer_seconds=dict(self.transfer_seconds),
                storage_faults=dict(self.storage_faults),
                prefetch_refused=self.prefetch_refused,
                backup_skipped_pages=self.backup_skipped_pages,
                waits=self.waits,
                wait_seconds=self.wait_seconds,
            )


@dataclass(frozen=True, kw_only=True)
class ControllerReading:
    """What the collector reads from one controller at scrape time."""

    stats: StatsSnapshot
    queue_depth: dict[OpKind, int]
    prefetch_inflight_pages: dict[str, int]


class ReadsMetrics(Protocol):
    """What the collector needs of a controller (structural, so metrics.py imports no
    controller code)."""

    def metrics_reading(self) -> ControllerReading: ...


def _counter(name: str, doc: str, *labels: str) -> CounterMetricFamily:
    """An empty `kvstrata_tier_<name>` counter family labelled by controller, then `labels`."""
    return CounterMetricFamily(f"kvstrata_tier_{name}", doc, labels=["controller", *labels])


def _gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
    """The gauge counterpart of `_counter`."""
    return GaugeMetricFamily(f"kvstrata_tier_{name}", doc, labels=["controller", *labels])


class TierControllerCollector(Collector):
    """Exports the counters of named controllers (label `controller`) as `kvstrata_tier_*`.

    Register it on a registry of your choosing; nothing is registered at import:

        registry = CollectorRegistry()
        registry.register(TierControllerCollector({"engine0": controller}))
    """

    def __init__(self, controllers: Mapping[str, ReadsMetrics]) -> None:
        self._controllers = dict(controllers)

    def collect(self) -> Iterator[Metric]:
        submitted = _counter("ops_submitted", "Operations accepted", "kind")
        finished = _counter("ops_finished", "Operations acknowledged, by status", "kind", "status")
        merged = _counter(
            "ops_merged", "Operations merged into another operation's transfer", "kind"
        )
        errors = _counter(
            "worker_errors",
            "Worker batches that raised (their operations were acknowledged as failed)",
            "kind",
        )
        pages = _counter("transfer_pages", "Pages moved", "direction")
        moved = _counter("transfer_bytes", "Bytes moved", "direction")
        seconds = _counter(
            "transfer_seconds", "Time spent in copies and storage calls", "direction"
        )
        faults = _counter(
            "storage_faults", "Storage calls that ended a prefetch or backup early", "reason"
        )
        refused = _counter(
            "prefetch_refused",
            "Prefetches refused because in-flight pages would pass the host share",
        )
        skipped = _counter("backup_skipped_pages", "Pages a backup found already in storage")
        waits = _counter("waits", "Caller waits on operations and layers")
        wait_seconds = _counter(
            "wait_seconds", "Caller time blocked waiting on operations and layers"
        )
        depth = _gauge("queue_depth", "Operations waiting in a queue", "kind")
        inflight = _gauge(
            "prefetch_inflight_pages", "Host pages held by prefetches in flight", "member"
        )
        for name, controller in self._controllers.items():
            r = controller.metrics_reading()
            s = r.stats
            for kind in OpKind:
                submitted.add_metric([name, kind.value], s.submitted[kind])
                merged.add_metric([name, kind.value], s.merged[kind])
                errors.add_metric([name, kind.value], s.worker_errors[kind])
                depth.add_metric([name, kind.value], r.queue_depth.get(kind, 0))
                for status in AckStatus:
                    finished.add_metric([name, kind.value, status.value], s.finished[kind, status])
            for d in Direction:
                pages.add_metric([name, d.value], s.pages[d])
                moved.add_metric([name, d.value], s.bytes[d])
                seconds.add_metric([name, d.value], s.transfer_seconds[d])
            for reason in FaultReason:
                faults.add_metric([name, reason.value], s.storage_faults[reason])
            refused.add_metric([name], s.prefetch_refused)
            skipped.add_metric([name], s.backup_skipped_pages)
            waits.add_metric([name], s.waits)
            wait_seconds.add_metric([name], s.wait_seconds)
            for member, num in r.prefetch_inflight_pages.items():
                inflight.add_metric([name, member], num)
        yield from (submitted, finished, merged, errors, pages, moved, seconds, faults)
        yield from (refused, skipped, waits, wait_seconds, depth, inflight)
