"""`build_tiers`: a host tier (and optionally storage) under a built `MemorySystem`.

    MemorySystem.kv_pool ──> MHAHostPool (host mirror) ──> HostSlotAllocator
    MemorySystem.layers  ──> PoolGroup({"full": host}) ──> TierController(storage)
    MemorySystem.tree    ──> HierarchicalCache(tree, controller, host allocator, params)

Full-attention (`mha`) systems only: the hierarchical cache mirrors one Full pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstrata.build.errors import InvalidCapacity, InvalidModel
from kvstrata.build.system import MemorySystem
from kvstrata.hybrid_cache import ControllerParams, PoolGroup, TierController
from kvstrata.pool import MHAKVPool
from kvstrata.pool_host import HostLayout, MHAHostPool
from kvstrata.storage import Storage, open_storage
from kvstrata.unified_radix_cache.hierarchy import HierarchicalCache
from kvstrata.unified_radix_cache.tiers import TierParams


@dataclass(frozen=True, kw_only=True, eq=False)
class TieredSystem:
    """The host mirror, its controller and the hierarchical cache over a `MemorySystem`.
    `close()` stops the controller's workers (and closes the host pool's memory)."""

    system: MemorySystem
    host_pool: MHAHostPool
    controller: TierController
    cache: HierarchicalCache
    storage: Storage | None

    @property
    def host_tokens(self) -> int:
        return self.cache.host_allocator.size

    def check_integrity(self) -> None:
        """Device pools and allocators (the system's check) plus both tiers of the cache."""
        self.system.check_integrity()
        self.cache.check_integrity()

    def close(self) -> None:
        """Wait for every transfer in flight, then stop the workers."""
        self.cache.drain()
        self.controller.close()


def build_tiers(
    system: MemorySystem,
    *,
    host_tokens: int | None = None,
    host_ratio: float | None = None,
    host_bytes: int | None = None,
    storage_url: str | None = None,
    params: TierParams | None = None,
    controller_params: ControllerParams | None = None,
) -> TieredSystem:
    """Add a host tier of `host_tokens`, `host_ratio` x the device capacity, or `host_bytes`
    (at most one; default ratio 2.0) and, with `storage_url` (`memory://...`, `file:///...`),
    an L3 tier. Raises InvalidModel for a family other than mha and InvalidCapacity for more
    than one size, before anything is allocated."""
    if system.family != "mha" or not isinstance(system.kv_pool, MHAKVPool):
        raise InvalidModel(f"tiers need a full-attention (mha) system, got {system.family!r}")
    sizes = [s for s in (host_tokens, host_ratio, host_bytes) if s is not None]
    if len(sizes) > 1:
        raise InvalidCapacity("give at most one of host_tokens, host_ratio, host_bytes")
    if any(s <= 0 for s in sizes):
        raise InvalidCapacity(f"the host size must be positive, got {sizes[0]}")
    pool = system.kv_pool
    layout = HostLayout.page_first
    if host_tokens is not None:
        host = MHAHostPool(pool, layout=layout, size=host_tokens)
    elif host_bytes is not None:
        host = MHAHostPool(pool, layout=layout, size_bytes=host_bytes)
    else:
        host = MHAHostPool(pool, layout=layout, ratio=host_ratio or 2.0)
    storage = open_storage(storage_url) if storage_url else None
    controller = TierController(
        PoolGroup(system.layers, {"full": host}), storage=storage, params=controller_params
    )
    cache = HierarchicalCache(
        system.tree,
        controller=controller,
        host_allocator=host.make_allocator(),
        params=params,
    )
    return TieredSystem(
        system=system, host_pool=host, controller=controller, cache=cache, storage=storage
    )
