"""`build_memory_system`: one entry point, one dispatch table from family name to builder."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

import torch

from kvstrata.build.errors import (
    DeviceUnavailable,
    InvalidCapacity,
    UnknownFamily,
    UnknownPolicy,
)
from kvstrata.build.mamba import build_mamba_system
from kvstrata.build.mha import build_mha_system
from kvstrata.build.swa import build_swa_system
from kvstrata.build.system import BuildParams, MemorySystem

#: A family's builder: its model config (None: the family default) and the budget -> a system.
Builder = Callable[[object | None, BuildParams], MemorySystem]

BUILDERS: Mapping[str, Builder] = MappingProxyType(
    {"mha": build_mha_system, "swa": build_swa_system, "mamba": build_mamba_system}
)
#: Model families `build_memory_system` knows, in the order the CLI lists them.
FAMILIES: tuple[str, ...] = tuple(BUILDERS)
#: Eviction policies of the tree (the tree validates them too; this list feeds CLI choices).
POLICIES: tuple[str, ...] = ("lru", "lfu", "fifo", "mru", "filo", "priority")


def build_memory_system(
    *,
    family: str,
    capacity_tokens: int,
    page_size: int = 16,
    policy: str = "lru",
    device: torch.device | str = "cpu",
    model: object | None = None,
    swa_ratio: float = 0.8,
    mamba_slots: int | None = None,
    enable_events: bool = False,
) -> MemorySystem:
    """The memory system of `family` ("mha", "swa" or "mamba") for `model` (None: the family's
    small default config, `MHAModel()`, `SWAModel()` or `MambaModel()`).

    `capacity_tokens`: full-attention KV slots, rounded down to whole pages. `swa_ratio`: SWA
    slots per full slot (swa only). `mamba_slots`: state slots (mamba only; None:
    `capacity_tokens // 64`, at least 4). `enable_events`: the tree queues KV events.

    Validates everything before allocating anything: UnknownFamily, UnknownPolicy,
    InvalidCapacity (page size < 1, capacity below one page, swa_ratio outside (0, 1],
    mamba_slots < 2), InvalidModel (a config of another family), DeviceUnavailable (no such
    device here). The pools are allocated zeroed on `device`; cost O(capacity x bytes/token).
    """
    builder = BUILDERS.get(family)
    if builder is None:
        raise UnknownFamily(f"unknown model family {family!r}; choose from {', '.join(FAMILIES)}")
    if policy not in POLICIES:
        raise UnknownPolicy(
            f"unknown eviction policy {policy!r}; choose from {', '.join(POLICIES)}"
        )
    if page_size < 1:
        raise InvalidCapacity(f"page_size must be >= 1, got {page_size}")
    if capacity_tokens < page_size:
        raise InvalidCapacity(
            f"capacity_tokens must hold at least one page ({page_size} tokens), "
            f"got {capacity_tokens}"
        )
    if not 0.0 < swa_ratio <= 1.0:
        raise InvalidCapacity(f"swa_ratio must be in (0, 1], got {swa_ratio}")
    if mamba_slots is not None and mamba_slots < 2:
        raise InvalidCapacity(
            f"mamba_slots must be >= 2 (a running request and a cached state), got {mamba_slots}"
        )
    params = BuildParams(
        capacity_tokens=capacity_tokens - capacity_tokens % page_size,
        page_size=page_size,
        policy=policy,
        device=check_device(device),
        swa_ratio=swa_ratio,
        mamba_slots=mamba_slots,
        enable_events=enable_events,
    )
    return builder(model, params)


def check_device(device: torch.device | str) -> torch.device:
    """`device` parsed, and present on this machine (DeviceUnavailable otherwise)."""
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise DeviceUnavailable(f"not a device: {device!r} ({exc})") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"device {device!r}: no CUDA device on this machine")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise DeviceUnavailable(
                f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s)"
            )
    return resolved
