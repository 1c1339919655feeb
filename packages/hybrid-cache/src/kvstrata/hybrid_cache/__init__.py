"""Per-layer routing across pools and the tier controller moving pages L1 <-> L2 <-> L3."""

from __future__ import annotations

__all__: list[str] = []
