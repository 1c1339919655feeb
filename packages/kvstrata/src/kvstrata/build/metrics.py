"""`collectors(system, tiers=None)`: the Prometheus collectors of everything a build wired.

Each layer ships its own collector, reading the structure's counters at scrape time; this
module only names the parts of one `MemorySystem` (and its `TieredSystem`) for them:

    device pools   PoolCollector        "kv", "mamba", "req_to_token"
    allocators     AllocatorCollector   "kv", "mamba"
    tree           RadixCacheCollector
    host mirrors   HostPoolCollector    the pool group's members, with their host allocators
    controller     TierControllerCollector "tiers"
    storage        StorageCollector     "l3"
    tiered cache   TierCacheCollector

Nothing is registered: a library never picks the registry (`registry.register(c)` for each).
"""

from __future__ import annotations

from prometheus_client.registry import Collector

from kvstrata.allocator import AllocatorCollector
from kvstrata.allocator.base import SlotAllocator
from kvstrata.build.system import MemorySystem
from kvstrata.build.tiers import TieredSystem
from kvstrata.hybrid_cache import TierControllerCollector
from kvstrata.pool import PoolCollector
from kvstrata.pool.metrics import PoolLike
from kvstrata.pool_host import HostPoolCollector, HostSlotAllocator
from kvstrata.storage import StorageCollector
from kvstrata.unified_radix_cache import RadixCacheCollector
from kvstrata.unified_radix_cache.tier_metrics import TierCacheCollector


def collectors(system: MemorySystem, tiers: TieredSystem | None = None) -> list[Collector]:
    """Collectors of `system`'s pools, allocators and tree, and of `tiers`' host mirrors,
    controller, storage and cache when given. Labels: `{"family": system.family}` on the
    tree's and the tiered cache's series."""
    pools: dict[str, PoolLike] = {"kv": system.kv_pool}
    allocators: dict[str, SlotAllocator] = {"kv": system.kv_allocator}
    if system.mamba_pool is not None:
        pools["mamba"] = system.mamba_pool
    if system.mamba_allocator is not None:
        allocators["mamba"] = system.mamba_allocator
    if system.req_to_token is not None:
        pools["req_to_token"] = system.req_to_token
    labels = {"family": system.family}
    found: list[Collector] = [
        PoolCollector(pools),
        AllocatorCollector(allocators),
        RadixCacheCollector(system.tree, labels=labels),
    ]
    if tiers is None:
        return found
    cache = tiers.cache
    host_allocators: dict[str, HostSlotAllocator] = {
        name: allocator
        for name, allocator in cache.component_hosts.items()
        if name in tiers.host_pools
    }
    host_allocators["full"] = cache.host_allocator
    found.append(HostPoolCollector(dict(tiers.host_pools), allocators=host_allocators))
    found.append(TierControllerCollector({"tiers": tiers.controller}))
    if tiers.storage is not None:
        found.append(StorageCollector({"l3": tiers.storage}))
    found.append(TierCacheCollector(cache, labels=labels))
    return found
