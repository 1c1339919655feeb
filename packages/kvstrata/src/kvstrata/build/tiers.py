"""`build_tiers`: a host tier (and optionally storage) under a built `MemorySystem`.

    MemorySystem pools ──> one host mirror per pool ──> HostSlotAllocator per mirror
    MemorySystem.layers ──> PoolGroup(members) ──> TierController(storage)
    MemorySystem.tree ──> HierarchicalCache(tree, controller, host allocators, params)

Members of the pool group, by family:

    mha    "full": MHAHostPool(kv_pool)
    mla    "full": MLAHostPool(kv_pool) (the latent + rope rows of every layer)
    mamba  "full": MHAHostPool(kv_pool), "mamba": MambaHostPool(mamba_pool) (host state slots)
    swa    "full": MHAHostPool(kv_pool.full_pool), "swa": MHAHostPool(kv_pool.swa_pool)

Every mirror is sized by the same rule, so the host keeps the device's proportions: a ratio
applies to each pool; `host_tokens` fixes the full mirror and sets the ratio of the others;
`host_bytes` is split between the mirrors in proportion to their device pools' bytes.
Whether a family may have storage is the hierarchical cache's call (all three may since
unified-radix-cache wired SWA storage): a refusal surfaces as `TiersUnsupported`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvstrata.build.errors import InvalidCapacity, InvalidModel, TiersUnsupported
from kvstrata.build.system import MemorySystem
from kvstrata.hybrid_cache import ControllerParams, PoolGroup, TierController
from kvstrata.hybrid_cache.group import AnyHostPool
from kvstrata.pool import MambaPool, MHAKVPool, MLAKVPool, SWAKVPool
from kvstrata.pool_host import HostLayout, MambaHostPool, MHAHostPool, MLAHostPool
from kvstrata.storage import Storage, open_storage
from kvstrata.unified_radix_cache.errors import InvalidConfig
from kvstrata.unified_radix_cache.hierarchy import HierarchicalCache
from kvstrata.unified_radix_cache.tiers import TierParams

#: The ratio used when no host size is given.
DEFAULT_HOST_RATIO = 2.0


@dataclass(frozen=True, kw_only=True, eq=False)
class TieredSystem:
    """The host mirrors, their controller and the hierarchical cache over a `MemorySystem`.
    `host_pool` is the full-attention mirror (MHA, or MLA's latent pool); `host_pools` maps
    every pool group member ("full", and "mamba" or "swa") to its mirror. `close()` stops the
    controller's workers."""

    system: MemorySystem
    host_pool: MHAHostPool | MLAHostPool
    host_pools: Mapping[str, AnyHostPool]
    controller: TierController
    cache: HierarchicalCache
    storage: Storage | None

    @property
    def host_tokens(self) -> int:
        """Token slots of the full-attention host mirror."""
        return self.cache.host_allocator.size

    @property
    def host_state_slots(self) -> int | None:
        """Host Mamba state slots (None without Mamba layers)."""
        allocator = self.cache.component_hosts.get("mamba")
        return None if allocator is None else allocator.size

    @property
    def host_swa_tokens(self) -> int | None:
        """Host sliding-window token slots (None without sliding-window layers)."""
        allocator = self.cache.component_hosts.get("swa")
        return None if allocator is None else allocator.size

    def check_integrity(self) -> None:
        """Device pools and allocators (the system's check) plus both tiers of the cache."""
        self.system.check_integrity()
        self.cache.check_integrity()

    def close(self) -> None:
        """Wait for every transfer in flight, then stop the workers."""
        self.cache.drain()
        self.controller.close()


def build_host_pools(
    system: MemorySystem,
    *,
    host_tokens: int | None = None,
    host_ratio: float | None = None,
    host_bytes: int | None = None,
    layout: HostLayout = HostLayout.page_first,
) -> dict[str, AnyHostPool]:
    """One host mirror (in `layout`) per pool group member of `system`, sized as the module
    docstring says: `host_tokens` full-attention slots (the other mirrors in the same
    proportion, whole slots), `host_ratio` x each device pool, or `host_bytes` in all (at most
    one; default ratio 2.0). The mirrors only: `build_tiers` adds the controller and the cache.

    Raises InvalidCapacity for more than one size or a non-positive one and InvalidModel for a
    system of another layout, before anything is allocated; HostPoolError (a mirror under one
    page, more than the host holds) while allocating the mirrors.
    """
    sizes = [s for s in (host_tokens, host_ratio, host_bytes) if s is not None]
    if len(sizes) > 1:
        raise InvalidCapacity("give at most one of host_tokens, host_ratio, host_bytes")
    if any(s <= 0 for s in sizes):
        raise InvalidCapacity(f"the host size must be positive, got {sizes[0]}")
    devices = _device_pools(system)
    full = devices["full"]
    assert isinstance(full, MHAKVPool | MLAKVPool), "the full member is an MHA or MLA pool"
    bytes_of = {name: _device_bytes(pool) for name, pool in devices.items()}
    total_bytes = sum(bytes_of.values())
    hosts: dict[str, AnyHostPool] = {}
    for name, pool in devices.items():
        # Exactly one of the three is set for each mirror (see the module docstring).
        size: int | None = None
        ratio: float | None = None
        nbytes: int | None = None
        if host_bytes is not None:
            nbytes = host_bytes * bytes_of[name] // total_bytes
        elif host_tokens is not None:
            # Integer proportion: a float ratio can land a hair under a whole slot.
            size = host_tokens * pool.size // full.size
        else:
            ratio = host_ratio or DEFAULT_HOST_RATIO
        if isinstance(pool, MambaPool):
            hosts[name] = MambaHostPool(
                pool, layout=layout, size=size, ratio=ratio, size_bytes=nbytes
            )
        elif isinstance(pool, MLAKVPool):
            hosts[name] = MLAHostPool(
                pool, layout=layout, size=size, ratio=ratio, size_bytes=nbytes
            )
        else:
            hosts[name] = MHAHostPool(
                pool, layout=layout, size=size, ratio=ratio, size_bytes=nbytes
            )
    return hosts


def build_tiers(
    system: MemorySystem,
    *,
    host_tokens: int | None = None,
    host_ratio: float | None = None,
    host_bytes: int | None = None,
    storage_url: str | None = None,
    storage: Storage | None = None,
    params: TierParams | None = None,
    controller_params: ControllerParams | None = None,
    host_layout: HostLayout = HostLayout.page_first,
) -> TieredSystem:
    """Add a host tier of `host_tokens` (full-attention slots), `host_ratio` x each device
    pool, or `host_bytes` in all (at most one; default ratio 2.0; mirrors in `host_layout`,
    see `build_host_pools`) and, with `storage_url` (`memory://...`, `file:///...`) or an
    opened `storage` (at most one), an L3 tier, for an mha, mla, swa or mamba system whose
    tree is still empty. Mutates `system.tree` (the cache attaches its host tier to it).

    Raises InvalidCapacity for more than one size or a non-positive one, TiersUnsupported for
    both `storage_url` and `storage`, and InvalidModel for a system of another layout, before
    anything is allocated; HostPoolError (a mirror under one
    page, more than the host holds) while allocating the mirrors; TiersUnsupported when the
    hierarchical cache refuses the combination (its InvalidConfig), after
    stopping the controller it started and before the tree is touched.
    """
    if storage_url and storage is not None:
        raise TiersUnsupported("give at most one of storage_url and storage")
    hosts = build_host_pools(
        system,
        host_tokens=host_tokens,
        host_ratio=host_ratio,
        host_bytes=host_bytes,
        layout=host_layout,
    )
    if storage_url:
        storage = open_storage(storage_url)
    controller = TierController(
        PoolGroup(system.layers, hosts), storage=storage, params=controller_params
    )
    try:
        cache = HierarchicalCache(
            system.tree,
            controller=controller,
            host_allocator=hosts["full"].make_allocator(),
            params=params,
            # The pool group's members besides "full" are the tree's other components.
            component_hosts={n: h.make_allocator() for n, h in hosts.items() if n != "full"},
        )
    except InvalidConfig as exc:
        controller.close()
        raise TiersUnsupported(
            f"the {system.family} family cannot have these tiers"
            f"{' (storage)' if storage is not None else ''}: {exc}"
        ) from exc
    host_full = hosts["full"]
    assert isinstance(host_full, MHAHostPool | MLAHostPool), "the full mirror is MHA or MLA"
    return TieredSystem(
        system=system,
        host_pool=host_full,
        host_pools=hosts,
        controller=controller,
        cache=cache,
        storage=storage,
    )


def _device_pools(system: MemorySystem) -> dict[str, MHAKVPool | MLAKVPool | MambaPool]:
    """The device pool of every pool group member, by member name. InvalidModel for a system
    whose pools do not form one of the layouts the hierarchical cache knows."""
    pool = system.kv_pool
    if isinstance(pool, SWAKVPool):
        return {"full": pool.full_pool, "swa": pool.swa_pool}
    if isinstance(pool, MLAKVPool):
        if system.mamba_pool is not None:
            raise InvalidModel("tiers of an MLA pool with Mamba state are not wired")
        return {"full": pool}
    if not isinstance(pool, MHAKVPool):
        raise InvalidModel(f"tiers need an MHA, MLA or SWA KV pool, got {type(pool).__name__}")
    if system.mamba_pool is not None:
        return {"full": pool, "mamba": system.mamba_pool}
    return {"full": pool}


def _device_bytes(pool: MHAKVPool | MLAKVPool | MambaPool) -> int:
    return sum(b.numel() * b.element_size() for b in pool.layer_buffers())
