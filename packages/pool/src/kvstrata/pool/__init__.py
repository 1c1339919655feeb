"""Device KV-cache and SSM-state pools (L1)."""

from __future__ import annotations

__all__: list[str] = []
