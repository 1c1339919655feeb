"""Factories for radix trees (kvstrata.unified_radix_cache) over real allocators and pools.

`make_tree(family, ...)` builds a Full, Full+SWA or Full+Mamba tree on CPU with the real slot
allocators (TokenAllocator at page size 1, PagedAllocator above; SWAAllocator; a
MambaSlotAllocator and a small MambaPool), small enough for property tests. The returned
`TreeKit` allocates Full slots for a test and checks every invariant in one call.
`lru_prefix_hits` replays token sequences through a Full-only LRU tree of bounded size (as
`kvstrata bench radix` drives one) and counts the hit tokens.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvstrata.allocator import (
    MambaSlotAllocator,
    PagedAllocator,
    SlotCounter,
    SWAAllocator,
    TokenAllocator,
)
from kvstrata.allocator.base import SlotAllocator
from kvstrata.pool import MambaPool
from kvstrata.pool.native import disabled
from kvstrata.testkit.pools import make_mamba_pool
from kvstrata.unified_radix_cache import (
    ComponentInsert,
    EvictRequest,
    FullComponent,
    InsertResult,
    MambaComponent,
    MambaInsert,
    RadixKey,
    SWAComponent,
    TreeComponent,
    UnifiedRadixCache,
)

#: The component mixes every tree test is parametrised over.
TREE_FAMILIES: tuple[str, ...] = ("full", "swa", "mamba")


@dataclass(kw_only=True)
class TreeKit:
    """A tree and what it frees into. `full` is the Full allocator (an SWAAllocator for the swa
    family); `mamba`/`mamba_pool` exist for the mamba family only."""

    tree: UnifiedRadixCache
    family: str
    full: SlotAllocator
    mamba: MambaSlotAllocator | None = None
    mamba_pool: MambaPool | None = None

    def alloc(self, num_tokens: int) -> torch.Tensor:
        """`num_tokens` Full slots (whole pages); fails the test if the pool is out."""
        slots = self.full.alloc(num_tokens)
        assert slots is not None, f"{self.family} test pool exhausted ({num_tokens} tokens asked)"
        return slots

    def alloc_state(self) -> torch.Tensor:
        assert self.mamba is not None, "alloc_state() on a tree without Mamba"
        slot = self.mamba.alloc(1)
        assert slot is not None, "Mamba test pool exhausted"
        return slot

    def put(
        self,
        tokens: list[int],
        *,
        extra_key: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> tuple[InsertResult, torch.Tensor]:
        """Insert `tokens` with fresh slots as an engine would: whole pages allocated, a Mamba
        state for an aligned key, then the caller's duplicates, unaligned tail and unadopted
        state freed. Returns the insert result and the slots the key was given."""
        page = self.tree.page_size
        key = RadixKey(tokens, extra_key, cache_salt)
        # Whole pages; an unaligned tail shares its page with unused slots, which the paged
        # free of the tail below releases with it.
        slots = self.alloc(-(-len(tokens) // page) * page)[: len(tokens)]
        inputs: dict[str, ComponentInsert] | None = None
        state: torch.Tensor | None = None
        if self.family == "mamba" and tokens and len(tokens) % page == 0:
            state = self.alloc_state()
            inputs = {"mamba": MambaInsert(slot=int(state))}
        result = self.tree.insert(key, slots, inputs=inputs, priority=priority)
        duplicates = result.duplicates(slots)
        if len(duplicates):
            self.full.free(duplicates)
        kept = result.prefix_len + result.inserted_len
        if kept < len(tokens):
            self.full.free(slots[kept:])
        if state is not None and "mamba" not in result.adopted_states:
            assert self.mamba is not None
            self.mamba.free(state)
        return result, slots

    def check(self, held: dict[str, int] | None = None) -> None:
        """Tree and allocator invariants (free + evictable + protected + held == capacity)."""
        self.tree.check_integrity(held)
        self.full.check_integrity()
        if self.mamba is not None:
            self.mamba.check_integrity()


def make_full_allocator(*, size: int, page_size: int) -> SlotAllocator:
    if page_size == 1:
        return TokenAllocator(size=size, device="cpu")
    return PagedAllocator(size=size, page_size=page_size, device="cpu")


def make_tree(
    family: str = "full",
    *,
    size: int = 512,
    page_size: int = 1,
    policy: str = "lru",
    swa_size: int | None = None,
    sliding_window: int = 4,
    mamba_slots: int = 16,
    enable_events: bool = False,
    disable: bool = False,
    python_paths: bool = False,
) -> TreeKit:
    """A CPU tree of `family` ("full", "swa", "mamba") with `size` Full slots.
    `python_paths`: made inside `kvstrata.pool.native.disabled()`, so the tree runs its
    pure-Python paths for good (A/B tests against the compiled core)."""
    if python_paths:
        with disabled():
            return make_tree(
                family,
                size=size,
                page_size=page_size,
                policy=policy,
                swa_size=swa_size,
                sliding_window=sliding_window,
                mamba_slots=mamba_slots,
                enable_events=enable_events,
                disable=disable,
            )
    components: list[TreeComponent]
    if family == "full":
        full = make_full_allocator(size=size, page_size=page_size)
        components = [FullComponent(full)]
        kit_mamba = kit_pool = None
    elif family == "swa":
        full = SWAAllocator(size=size, swa_size=swa_size or size, page_size=page_size, device="cpu")
        components = [FullComponent(full), SWAComponent(full, sliding_window=sliding_window)]
        kit_mamba = kit_pool = None
    elif family == "mamba":
        full = make_full_allocator(size=size, page_size=page_size)
        kit_mamba = MambaSlotAllocator(size=mamba_slots, device="cpu")
        # The pools factory's small state shape, one layer, float32 throughout (exact values).
        kit_pool = make_mamba_pool(num_layers=1, conv_dtype=torch.float32, size=mamba_slots)
        components = [FullComponent(full), MambaComponent(kit_mamba, kit_pool)]
    else:
        raise ValueError(f"unknown tree family {family!r}; choose from {TREE_FAMILIES}")
    tree = UnifiedRadixCache(
        components,
        page_size=page_size,
        eviction_policy=policy,
        enable_events=enable_events,
        disable=disable,
    )
    return TreeKit(tree=tree, family=family, full=full, mamba=kit_mamba, mamba_pool=kit_pool)


def lru_prefix_hits(
    requests: Iterable[array], *, page_size: int, capacity_tokens: int | None = None
) -> int:
    """Hit tokens of a Full-only UnifiedRadixCache (LRU eviction, fresh slot numbers that never
    run out) driven as `kvstrata bench radix` drives it: per request (whole pages of tokens),
    match the whole key, lock the match, evict what the new tokens need beyond
    `capacity_tokens` (None: unbounded), insert, unlock. Asserts the tree never holds more
    than `capacity_tokens`."""
    slots = SlotCounter()
    tree = UnifiedRadixCache([FullComponent(slots)], page_size=page_size, eviction_policy="lru")
    hits = 0
    for tokens in requests:
        key = RadixKey(tokens)
        match = tree.match_prefix(key)
        hits += match.prefix_len
        receipt = tree.lock(match.last_node)
        if capacity_tokens is not None:
            excess = tree.total_size() + len(key) - match.prefix_len - capacity_tokens
            if excess > 0:
                tree.evict(EvictRequest.full(excess))
        tree.insert(key, slots.take_numpy(len(key)))
        tree.unlock(receipt)
        assert capacity_tokens is None or tree.total_size() <= capacity_tokens
    return hits
