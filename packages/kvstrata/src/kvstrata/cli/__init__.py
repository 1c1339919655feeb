"""The `kvstrata` command: the main job (`replay`), the benchmarks (`bench`) and `version`."""

from __future__ import annotations

from kvstrata.cli.main import main

__all__ = ["main"]
