"""What a host pool counts: the totals `HostPool.stats()` returns and the collector exports.

Kept apart from `metrics.py` so that `base.py` (which fills these) and `metrics.py` (which reads
them through `HostPool.stats()`) import this module, not each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.core.histogram import HistogramSnapshot

#: Upper bounds (seconds) of the D2H / H2D latency buckets: 10 us .. 10 s, roughly x3 apart.
LATENCY_BOUNDS: tuple[float, ...] = (
    1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0,
)  # fmt: skip


@dataclass(frozen=True, kw_only=True)
class TransferCounters:
    """Totals of one direction of copies since the pool was built."""

    calls: int
    pages: int
    bytes: int
    latency: HistogramSnapshot


@dataclass(frozen=True, kw_only=True)
class HostPoolStats:
    """What a host pool reports at scrape time."""

    family: str
    layout: str
    page_size: int
    capacity_tokens: int
    capacity_bytes: int
    d2h: TransferCounters
    h2d: TransferCounters
