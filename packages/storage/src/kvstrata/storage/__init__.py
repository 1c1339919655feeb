"""L3 storage backends and the chained page key scheme."""

from __future__ import annotations

__all__: list[str] = []
