"""The one latency histogram: bucket edges, snapshots, Prometheus pairs, bad bounds, threads."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.core.errors import InvalidHistogramBounds
from kvstrata.core.histogram import LatencyHistogram


def test_buckets_are_upper_bounds() -> None:
    hist = LatencyHistogram((0.001, 0.01))
    for seconds in (0.0005, 0.001, 0.002, 0.5):
        hist.observe(seconds)
    snap = hist.snapshot()
    assert snap.counts == (2, 1, 1)  # 0.001 lands in its own bucket (le), 0.5 in +Inf
    assert snap.count == 4
    assert snap.cumulative() == [("0.001", 2), ("0.01", 3), ("+Inf", 4)]
    assert snap.sum_seconds == pytest.approx(0.5035)


def test_snapshot_is_frozen_in_time() -> None:
    hist = LatencyHistogram((1.0,))
    hist.observe(0.5)
    before = hist.snapshot()
    hist.observe(2.0)
    assert before.counts == (1, 0)
    assert hist.snapshot().counts == (1, 1)
    assert hist.bounds == (1.0,)


@pytest.mark.parametrize("bounds", [(), (0.1, 0.01), (0.1, 0.1)])
def test_bad_bounds_are_refused(bounds: tuple[float, ...]) -> None:
    with pytest.raises(InvalidHistogramBounds, match="strictly increasing"):
        LatencyHistogram(bounds)


def test_concurrent_observers_lose_nothing() -> None:
    hist = LatencyHistogram((0.5,))

    def work() -> None:
        for _ in range(2000):
            hist.observe(0.25)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = hist.snapshot()
    assert snap.counts == (8000, 0)
    assert snap.sum_seconds == pytest.approx(2000.0)


@given(st.lists(st.floats(min_value=0, max_value=20, allow_nan=False), max_size=50))
def test_counts_match_a_direct_count(values: list[float]) -> None:
    bounds = (1e-3, 0.1, 1.0, 10.0)
    hist = LatencyHistogram(bounds)
    for v in values:
        hist.observe(v)
    snap = hist.snapshot()
    edges = (*bounds, float("inf"))
    expected = [
        sum(1 for v in values if v <= hi and (i == 0 or v > edges[i - 1]))
        for i, hi in enumerate(edges)
    ]
    assert list(snap.counts) == expected
    assert snap.cumulative()[-1] == ("+Inf", len(values))
