"""Benchmarks, run as `kvstrata bench <name> [options]`.

Each benchmark is a module `kvstrata.bench.<name>` with a `main(argv: list[str]) -> int` that
parses its own options, measures, and prints JSON lines (one per configuration), every figure
beside a baseline measured in the same run and the ratio between them. A benchmark never asserts
a time: the machine is shared and noisy, so it reports medians and ratios.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from typing import cast

BenchMain = Callable[[list[str]], int]

#: Modules of this package that are support code, not benchmarks.
_SUPPORT = frozenset({"gather_ref", "l3_peer", "report", "trace_input"})


def available() -> list[str]:
    """Names of the benchmarks installed in this package, sorted."""
    return sorted(
        m.name
        for m in pkgutil.iter_modules(__path__)
        if not m.name.startswith("_") and m.name not in _SUPPORT
    )


def load(name: str) -> BenchMain:
    """The `main` of benchmark `name`; KeyError naming the choices when there is none."""
    if name not in available():
        raise KeyError(f"no benchmark {name!r}; available: {', '.join(available()) or 'none'}")
    module = importlib.import_module(f"{__name__}.{name}")
    return cast(BenchMain, module.main)
