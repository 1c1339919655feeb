"""Host-memory mirror (L2) of the device pools, with device-host copies."""

from __future__ import annotations

from kvstrata.pool_host.base import DevicePagePool, HostPool, KVHostPool
from kvstrata.pool_host.completion import LayerCompletion, LayerLoad, Transfer
from kvstrata.pool_host.layout import HostLayout
from kvstrata.pool_host.mamba import MambaHostPool
from kvstrata.pool_host.memory import (
    HostRegion,
    HostTensorAllocator,
    PinnedHostAllocator,
    PlainHostAllocator,
    SharedHostAllocator,
    attach_shared,
    host_memory,
)
from kvstrata.pool_host.metrics import HostPoolCollector
from kvstrata.pool_host.mha import MHAHostPool
from kvstrata.pool_host.mla import MLAHostPool
from kvstrata.pool_host.slots import HostSlotAllocator
from kvstrata.pool_host.stats import HostPoolStats
from kvstrata.pool_host.transfer import CopyStrategy, PagePlan, vouched_pages

__all__: list[str] = [
    "CopyStrategy",
    "DevicePagePool",
    "HostLayout",
    "HostPool",
    "KVHostPool",
    "HostPoolCollector",
    "HostPoolStats",
    "HostRegion",
    "HostSlotAllocator",
    "HostTensorAllocator",
    "LayerCompletion",
    "LayerLoad",
    "MHAHostPool",
    "MLAHostPool",
    "MambaHostPool",
    "PagePlan",
    "PinnedHostAllocator",
    "PlainHostAllocator",
    "SharedHostAllocator",
    "Transfer",
    "attach_shared",
    "host_memory",
    "vouched_pages",
]
