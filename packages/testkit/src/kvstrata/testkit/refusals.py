"""Refused frees for evict tests (issue 17: an `evict` that raises leaves everything as it was).

- `RefusingAllocator` stands in for a component's allocator and refuses, as a real one refuses
  slots it has not handed out (NotAllocated, nothing changed), any `check_allocated` or `free`
  touching the slots it is told to refuse; everything else goes to the real allocator. `refusing`
  installs one on a component for a `with` block.
- `tree_state` is everything a refused evict must leave as it was, as one comparable value:
  per node its place, key, device and host data of every component and its locks; component
  sizes and counters; LRU orders; both heaps with their keys (the eviction order); the host
  tier's sizes, counters and candidates; every device and host allocator's free list; and the
  Prometheus samples of the tree (and of the hierarchical cache when given). Read-only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from kvstrata.allocator import NotAllocated
from kvstrata.core.free_ids import FreeIds
from kvstrata.unified_radix_cache import (
    FullComponent,
    RadixCacheCollector,
    TierCacheCollector,
    TreeComponent,
    UnifiedRadixCache,
)
from kvstrata.unified_radix_cache.components.base import LRUListComponent
from kvstrata.unified_radix_cache.hierarchy import HierarchicalCache
from kvstrata.unified_radix_cache.host_tier import HostTier


class RefusingAllocator:
    """`inner` with `check_allocated` and `free` refusing (NotAllocated, before any change) any
    of the slots `refused`, the way an allocator refuses slots it has not handed out. Every
    other attribute is `inner`'s."""

    def __init__(self, inner: object, refused: Iterable[int]) -> None:
        self.inner = inner
        self.refused = np.array(sorted({int(s) for s in refused}), dtype=np.int64)
        #: Calls refused so far.
        self.refusals = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    def _refuse(self, indices: torch.Tensor, name: str) -> None:
        slots = indices.cpu().numpy()
        hit = np.isin(slots, self.refused)
        if hit.any():
            self.refusals += 1
            raise NotAllocated(f"{name}: slots {slots[hit][:8].tolist()} refused (injected)")

    def check_allocated(self, indices: torch.Tensor, name: str = "indices") -> None:
        self._refuse(indices, name)
        check = getattr(self.inner, "check_allocated", None)
        if callable(check):
            check(indices, name)

    def free(self, indices: torch.Tensor) -> None:
        self._refuse(indices, "free")
        self.inner.free(indices)  # pyright: ignore[reportAttributeAccessIssue]


@contextmanager
def refusing(component: TreeComponent, refused: Iterable[int]) -> Iterator[RefusingAllocator]:
    """`component` frees into a `RefusingAllocator` over its allocator for the block."""
    inner = component.allocator  # pyright: ignore[reportAttributeAccessIssue]
    proxy = RefusingAllocator(inner, refused)
    component.allocator = proxy  # pyright: ignore[reportAttributeAccessIssue]
    try:
        yield proxy
    finally:
        component.allocator = inner  # pyright: ignore[reportAttributeAccessIssue]


@dataclass(frozen=True, kw_only=True)
class TreeState:
    """What `tree_state` read (compare two with ==)."""

    nodes: tuple[object, ...]
    components: tuple[object, ...]
    lrus: tuple[object, ...]
    device_heap: tuple[object, ...]
    host_heap: tuple[object, ...]
    host_tier: tuple[object, ...]
    pools: tuple[object, ...]
    metrics: tuple[object, ...]


def _plain(value: object) -> object:
    """Arrays, tensors and dataclasses (allocator states) as nested tuples of Python values."""
    if isinstance(value, torch.Tensor):
        return tuple(value.cpu().reshape(-1).tolist())
    if isinstance(value, np.ndarray):
        return tuple(value.reshape(-1).tolist())
    if isinstance(value, (list, tuple)):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return tuple(
            _plain(getattr(value, f.name)) for f in dataclasses.fields(value) if f.name != "owner"
        )
    return value


def pool_state(pool: object) -> object:
    """An allocator's free list: `backup_state()` where it has one (device allocators), else the
    free ids of a host slot allocator (seen through its `allocator` when wrapped)."""
    backup = getattr(pool, "backup_state", None)
    if callable(backup):
        return _plain(backup())
    inner = getattr(pool, "allocator", None)
    if inner is not None:
        return pool_state(inner)
    pages = getattr(pool, "_pages", None)
    assert isinstance(pages, FreeIds), f"no free list to read on {type(pool).__name__}"
    ids = np.arange(pages.first, pages.first + pages.num_ids, dtype=np.int64)
    # The order the free ids come out in is part of the state (`take` is deterministic).
    return (_plain(pages._fresh), _plain(pages._given), _plain(pages.allocated(ids)))


def _samples(collector: RadixCacheCollector | TierCacheCollector) -> tuple[object, ...]:
    return tuple(
        (s.name, tuple(sorted(s.labels.items())), s.value)
        for metric in collector.collect()
        for s in metric.samples
    )


def tree_state(tree: UnifiedRadixCache, cache: HierarchicalCache | None = None) -> TreeState:
    """Everything a refused evict must leave as it was (module docstring)."""
    full = tree.components[0]
    assert isinstance(full, FullComponent) and full.heap is not None
    nodes = []
    for n in sorted(tree.iter_nodes(), key=lambda n: n.id):
        assert n.parent is not None
        nodes.append(
            (
                n.id,
                n.parent.id,
                n.key,
                _plain(n.value),
                _plain(n.comp_values),
                _plain(n.comp_locks),
                None if n.host_value is None else _plain(n.host_value),
                _plain(n.comp_hosts),
                n.lock_ref,
                n.host_lock_ref,
                _plain(n.page_keys),
                n.in_storage,
                n.last_access,
                n.hit_count,
                n.priority,
            )
        )
    components = tuple(
        (
            c.name,
            c.evictable_size,
            c.protected_size,
            c.evicted_total,
            c.host_held_size,
            c.host_evicted_total,
            len(c._pending),
        )
        for c in tree.components
    )
    lrus = tuple(
        tuple(n.id for n in c.lru.nodes())
        for c in tree.components
        if isinstance(c, LRUListComponent)
    )
    device_heap = tuple(sorted(n.heap_entry for n in tree.iter_nodes() if n in full.heap))  # pyright: ignore[reportArgumentType]
    tier = tree.host_tier
    host_heap: tuple[object, ...] = ()
    host: tuple[object, ...] = ()
    pools: list[object] = []
    seen: set[int] = set()
    sinks: list[object] = [getattr(c, "allocator", None) for c in tree.components]
    if isinstance(tier, HostTier):
        host_heap = tuple(sorted(n.heap_entry for n in tree.iter_nodes() if n in tier.heap))  # pyright: ignore[reportArgumentType]
        host = (
            tier.evictable_size,
            tier.protected_size,
            tier.evicted_total,
            tuple(tier.candidate_sizes),
            tuple(sorted(tier.receipt_ids())),
        )
        sinks += [tier.host, *(c.host for c in tree.components[1:])]
    for sink in sinks:
        if isinstance(sink, RefusingAllocator):
            sink = sink.inner  # the same free list as when the stand-in is not installed
        if sink is not None and id(sink) not in seen:
            seen.add(id(sink))
            pools.append(pool_state(sink))
    metrics = _samples(RadixCacheCollector(tree))
    if cache is not None:
        metrics += _samples(TierCacheCollector(cache))
    return TreeState(
        nodes=tuple(nodes),
        components=components,
        lrus=lrus,
        device_heap=device_heap,
        host_heap=host_heap,
        host_tier=(*host, tree.num_nodes, tree.num_locked),
        pools=tuple(pools),
        metrics=metrics,
    )
