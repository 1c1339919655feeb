"""Tier names of the index and the default weights `PrefixIndex.score` gives them."""

from __future__ import annotations

from collections.abc import Mapping

DEVICE = "device"
HOST = "host"
STORAGE = "storage"

#: llm-d's ordering: a device hit saves more than a host hit, which beats storage.
DEFAULT_TIER_WEIGHTS: Mapping[str, float] = {DEVICE: 1.0, HOST: 0.8, STORAGE: 0.5}


def tier_of_medium(medium: str | None) -> str:
    """An engine's `medium` string as an index tier: None or a GPU/device medium is the device,
    a CPU/host medium (vLLM "CPU", SGLang "CPU_PINNED") is the host, anything else (DISK,
    EXTERNAL, LMCACHE, ...) is storage."""
    if medium is None:
        return DEVICE
    upper = medium.upper()
    if "GPU" in upper or "HBM" in upper or "DEVICE" in upper or "CUDA" in upper:
        return DEVICE
    if "CPU" in upper or "HOST" in upper:
        return HOST
    return STORAGE
