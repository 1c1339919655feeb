"""The fixed-bucket latency histogram every layer keeps (one implementation).

A layer observes durations on its hot path (one bisect and two adds under a lock) and a
Prometheus collector reads `snapshot()` at scrape time. The buckets are the layer's choice: the
storage backends span page-cache hits to a slow disk, the host tier D2H / H2D copies.

```
bounds:   b0        b1        ...   b[n-1]
counts: [<= b0] (b0, b1] ... (b[n-2], b[n-1]] (b[n-1], +Inf)     len(counts) == n + 1
```
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

from kvstrata.core.errors import InvalidHistogramBounds

__all__ = ["HistogramSnapshot", "LatencyHistogram"]


@dataclass(frozen=True, kw_only=True)
class HistogramSnapshot:
    """A histogram at one instant. `counts[i]` counts the observations in bucket i alone (not
    cumulative); the last entry is the +Inf bucket, so `len(counts) == len(bounds) + 1`."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum_seconds: float

    @property
    def count(self) -> int:
        """Number of observations."""
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus-style `(le, cumulative count)` pairs, ending with `("+Inf", count)`: the
        `buckets` argument of `HistogramMetricFamily.add_metric`."""
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out


class LatencyHistogram:
    """Fixed-bucket latency histogram. Thread-safe: `observe` and `snapshot` hold one lock, so
    a snapshot's counts and sum always agree."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        if not bounds or list(bounds) != sorted(set(bounds)):
            raise InvalidHistogramBounds(
                f"histogram bounds must be non-empty and strictly increasing, got {bounds}"
            )
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    @property
    def bounds(self) -> tuple[float, ...]:
        return self._bounds

    def observe(self, seconds: float) -> None:
        """Add one observation (a value equal to a bound lands in that bound's bucket). Mutates
        the bucket counts and the sum; O(log buckets)."""
        slot = bisect.bisect_left(self._bounds, seconds)
        with self._lock:
            self._counts[slot] += 1
            self._sum += seconds

    def snapshot(self) -> HistogramSnapshot:
        """The counts and sum now; later observations do not change the returned snapshot."""
        with self._lock:
            return HistogramSnapshot(
                bounds=self._bounds, counts=tuple(self._counts), sum_seconds=self._sum
            )
