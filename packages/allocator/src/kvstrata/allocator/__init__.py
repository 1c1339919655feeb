"""Device KV slot allocators: token, paged, sliding-window, Mamba state."""

from __future__ import annotations

__all__: list[str] = []
