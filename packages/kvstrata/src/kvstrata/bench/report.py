"""What every benchmark shares: timing statistics and the JSON line it prints."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch


def pin_threads(num_threads: int = 1) -> None:
    """One torch thread, as the SGLang peer scripts run: on 2 shared cores, two OpenMP threads
    make small torch calls slow and bimodal."""
    torch.set_num_threads(num_threads)


def median_seconds(fn: Callable[[], object], *, repeats: int, warmup: int = 1) -> float:
    """Median wall time of `repeats` calls of fn after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


class PairedTimes(NamedTuple):
    """Timings of an operation and its baseline measured alternately (see paired_medians)."""

    ours_seconds: float  # median
    baseline_seconds: float  # median
    ratio: float  # median over pairs of baseline / ours time (= ours rate / baseline rate)


def paired_medians(
    ours: Callable[[], object],
    baseline: Callable[[], object],
    *,
    repeats: int,
    sync: Callable[[], object] | None = None,
) -> PairedTimes:
    """Time `ours` and `baseline` alternately, `repeats` pairs after one untimed warm-up each;
    `sync` (e.g. a CUDA synchronise) runs inside every timed call. On a shared box the load
    drifts between moments, so besides the two medians this gives the median of the per-pair
    ratios, each pair measured back to back."""
    ours()
    baseline()
    if sync is not None:
        sync()
    ours_s: list[float] = []
    base_s: list[float] = []
    for _ in range(repeats):
        for fn, samples in ((ours, ours_s), (baseline, base_s)):
            start = time.perf_counter()
            fn()
            if sync is not None:
                sync()
            samples.append(time.perf_counter() - start)
    pair_ratios = [b / o for o, b in zip(ours_s, base_s, strict=True)]
    return PairedTimes(
        statistics.median(ours_s), statistics.median(base_s), statistics.median(pair_ratios)
    )


def ratio(ours: float, baseline: float) -> float | None:
    """ours / baseline, or None when the baseline is zero (nothing to compare against)."""
    return round(ours / baseline, 4) if baseline else None


def environment() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }


def emit(record: Mapping[str, Any], *, stream: Any = None) -> None:
    """Print one JSON line (and flush, so a long benchmark shows progress)."""
    out = stream if stream is not None else sys.stdout
    out.write(json.dumps(dict(record), sort_keys=False) + "\n")
    out.flush()
