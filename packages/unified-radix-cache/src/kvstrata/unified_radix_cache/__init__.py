"""One radix tree deciding what every model family keeps, with pluggable state components."""

from __future__ import annotations

__all__: list[str] = []
