"""What every benchmark shares: timing statistics and the JSON line it prints."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

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
