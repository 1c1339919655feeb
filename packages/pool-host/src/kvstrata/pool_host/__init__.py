"""Host-memory mirror (L2) of the device pools, with device-host copies."""

from __future__ import annotations

__all__: list[str] = []
