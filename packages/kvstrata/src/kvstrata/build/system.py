"""`MemorySystem`: everything an engine needs to keep KV and state for one model, built as one.

The construction layer. `build_memory_system(family=..., capacity_tokens=...)` turns a model
config and a capacity into allocators, device pools, the layer router, tree components and the
tree, wired so that the tree frees into the same allocators the engine allocates from:

    model config ──> pool specs ──> pools ──> HybridPool (layer_id -> pool)
    capacity     ──> allocators ─┬─> tree components ──> UnifiedRadixCache
                                 └─> engine: alloc / free

Each family lives in its own module (`mha`, `swa`, `mamba`) with its model config and its
builder; `factory.build_memory_system` dispatches on the family name through one table. This
module holds what they share: the parameters of a build, the system they return, and
`assemble_system`, which every builder ends with (the tree over its components, and the system).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from kvstrata.allocator import MambaSlotAllocator, PagedAllocator, SWAAllocator
from kvstrata.hybrid_cache import HybridPool, LayerKind
from kvstrata.pool import MambaPool, MHAKVPool, MLAKVPool, ReqToTokenPool, SWAKVPool
from kvstrata.unified_radix_cache import DeviceCache, TreeComponent, UnifiedRadixCache


@dataclass(frozen=True, kw_only=True)
class BuildParams:
    """The budget and the knobs of one build, validated by `build_memory_system`.

    `capacity_tokens`: usable device KV slots of the full-attention pool (rounded down to whole
    pages). `swa_ratio`: SWA slots per full slot (SGLang's `swa_full_tokens_ratio`).
    `mamba_slots`: Mamba state slots (None: `capacity_tokens // 64`, at least 4).
    """

    capacity_tokens: int
    page_size: int
    policy: str
    device: torch.device
    swa_ratio: float
    mamba_slots: int | None
    enable_events: bool


@dataclass(frozen=True, kw_only=True, eq=False)
class MemorySystem:
    """One model's device memory: allocators, pools, layer router and radix tree.

    The allocators are the only source of slots: the engine allocates from them, and the tree's
    components free into them (eviction, duplicates). `layers` routes every global layer id to
    its pool (attention: `set_kv`, `get_key_buffer`; Mamba: `mamba_state`). `kv_allocator` hands
    out full-pool slots (an `SWAAllocator` hands out SWA slots in step with them).
    """

    family: str
    model: object
    page_size: int
    capacity_tokens: int
    device: torch.device
    kv_allocator: PagedAllocator | SWAAllocator
    kv_pool: MHAKVPool | SWAKVPool | MLAKVPool
    mamba_allocator: MambaSlotAllocator | None
    mamba_pool: MambaPool | None
    layers: HybridPool
    tree: UnifiedRadixCache
    #: The request-to-token table (`build` from a model spec sizes one; None otherwise).
    req_to_token: ReqToTokenPool | None = None
    #: Models whose layers hold attention KV and a Mamba state at once (Falcon-H1's parallel
    #: hybrid blocks): the state of such a model layer i is routed as layer id
    #: `parallel_state_offset + i` (the number of model layers), its KV as layer i. None for
    #: every other model. `state_layer_id` maps a model layer to its state's id.
    parallel_state_offset: int | None = None

    def state_layer_id(self, layer_id: int) -> int:
        """The router's layer id of model layer `layer_id`'s Mamba state: itself for a Mamba
        layer, `parallel_state_offset + layer_id` for a parallel hybrid layer (KeyError for a
        layer without state)."""
        mamba = self.mamba_layer_ids
        if layer_id in mamba:
            return layer_id
        offset = self.parallel_state_offset
        if offset is not None and offset + layer_id in mamba:
            return offset + layer_id
        raise KeyError(f"model layer {layer_id} has no Mamba state")

    @cached_property
    def cache(self) -> DeviceCache:
        """The engine-facing prefix cache (`unified_radix_cache.PrefixCache`) of this system
        without lower tiers: the tree and the allocators it frees into (one per system)."""
        return DeviceCache(
            self.tree, kv_allocator=self.kv_allocator, state_allocator=self.mamba_allocator
        )

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """Global ids of the attention layers, ascending."""
        return tuple(i for i in self.layers.layer_ids if self.layers.kind(i) is LayerKind.ATTENTION)

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        """Global ids of the Mamba layers, ascending (empty unless the family is mamba)."""
        return tuple(i for i in self.layers.layer_ids if self.layers.kind(i) is LayerKind.MAMBA)

    @property
    def sliding_window(self) -> int | None:
        """Tokens a sliding-window layer attends to, or None for a model without SWA layers."""
        pool = self.kv_pool
        return pool.sliding_window if isinstance(pool, SWAKVPool) else None

    @property
    def swa_allocator(self) -> SWAAllocator | None:
        allocator = self.kv_allocator
        return allocator if isinstance(allocator, SWAAllocator) else None

    def check_integrity(self, held: Mapping[str, int] | None = None) -> None:
        """Verify the allocators, the pools' geometry and the tree (free + evictable +
        protected + `held` == capacity per pool; `held`: what running requests hold outside
        the tree, e.g. `kvstrata.allocation.BatchAllocator.held()`). Costs O(tree nodes +
        free-list length); for tests and the end of a replay. Raises the failing layer's
        IntegrityError."""
        self.kv_allocator.check_integrity()
        if self.mamba_allocator is not None:
            self.mamba_allocator.check_integrity()
        self.kv_pool.check_integrity()
        if self.mamba_pool is not None:
            self.mamba_pool.check_integrity()
        if self.req_to_token is not None:
            self.req_to_token.check_integrity()
        self.tree.check_integrity(held)

    def reset(self) -> None:
        """Empty the tree, returning every slot it holds to the allocators. Refused by the tree
        (TreeLocked) while a request holds a lock. Pool contents are left as they are: a slot's
        bytes mean nothing until the next writer fills it."""
        self.tree.reset()


def assemble_system(
    family: str,
    model: object,
    params: BuildParams,
    components: Sequence[TreeComponent],
    *,
    kv_allocator: PagedAllocator | SWAAllocator,
    kv_pool: MHAKVPool | SWAKVPool | MLAKVPool,
    layers: HybridPool,
    mamba_allocator: MambaSlotAllocator | None = None,
    mamba_pool: MambaPool | None = None,
) -> MemorySystem:
    """The tree over `components` (the build's page size, policy and events) and the system of
    a family builder's allocators, pools and router. Builders call it once everything is
    validated and allocated: it checks nothing (the tree refuses only a bad page size or
    policy, which `build_memory_system` checked first)."""
    tree = UnifiedRadixCache(
        components, params.page_size, params.policy, enable_events=params.enable_events
    )
    return MemorySystem(
        family=family,
        model=model,
        page_size=params.page_size,
        capacity_tokens=params.capacity_tokens,
        device=params.device,
        kv_allocator=kv_allocator,
        kv_pool=kv_pool,
        mamba_allocator=mamba_allocator,
        mamba_pool=mamba_pool,
        layers=layers,
        tree=tree,
    )
