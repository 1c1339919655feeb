"""Helpers for tests of kvstrata.storage and of the tiers above it."""

from __future__ import annotations

import hashlib

from kvstrata.storage import FileStorage, Storage


def page_cost(storage: Storage, payload_bytes: int) -> int:
    """Bytes one page of `payload_bytes` takes against the storage's capacity (a FileStorage
    counts its header too)."""
    if isinstance(storage, FileStorage):
        return storage.page_file_bytes(payload_bytes)
    return payload_bytes


def page_payload(key: bytes, size: int) -> bytes:
    """Deterministic content for a key, so any process can check what it reads."""
    block = hashlib.sha256(key).digest()
    return (block * (size // len(block) + 1))[:size]
