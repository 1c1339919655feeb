"""Routing simulation: N engine instances, each a device-only LRU `UnifiedRadixCache` of a fixed
number of pages, fed one request at a time by a `Router`; the instances' KV events feed the
router's `PrefixIndex` (unless the router is approximate).

Per request (prompt = page-aligned token ids):

    keys  = index.page_keys(tokens)            the router's view of the prompt
    d     = router.route(keys)                 picks an instance, charges its load
    hit   = instance.serve(tokens)             match (counted), lock, evict to fit, insert
    index.apply(d.instance, take_events())     what the instance now holds

`hit` counts the pages the chosen instance really had (before the request's own insert), so the
hit rate is the instance caches' truth, not the index's opinion. The simulation has no
completion model: load is the prompt pages routed to an instance so far (`finish` is never
called), and `max_load_ratio` is the busiest instance's routed pages over the mean.
`kvstrata bench index` and `kvstrata replay --instances` reuse `SimInstance` and `simulate`.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kvstrata.allocator import SlotCounter
from kvstrata.prefix_index.errors import InvalidParameter
from kvstrata.prefix_index.index import PrefixIndex
from kvstrata.prefix_index.router import Router
from kvstrata.unified_radix_cache import (
    EvictRequest,
    FullComponent,
    KVEvent,
    RadixKey,
    UnifiedRadixCache,
)


class SimInstance:
    """One simulated engine: a device-only LRU tree holding at most `capacity_pages` pages,
    publishing KV events (page keys from `PageKeyer(page_size)`, as the index expects)."""

    def __init__(self, name: str, *, capacity_pages: int, page_size: int = 1) -> None:
        if capacity_pages < 1:
            raise InvalidParameter(f"capacity_pages must be >= 1, got {capacity_pages}")
        self.name = name
        self.page_size = page_size
        self.capacity_tokens = capacity_pages * page_size
        self.slots = SlotCounter()
        self.tree = UnifiedRadixCache(
            [FullComponent(self.slots)], page_size=page_size, enable_events=True
        )

    def serve(self, tokens: Sequence[int] | array) -> int:
        """Run one request's prefill through the cache; returns the pages it hit. Mutates the
        tree (LRU touch, eviction, insert) and queues its events."""
        key = RadixKey(tokens if isinstance(tokens, array) else array("q", tokens))
        tree = self.tree
        match = tree.match_prefix(key)
        hit = match.prefix_len
        receipt = tree.lock(match.last_node)
        aligned = len(key) // self.page_size * self.page_size
        excess = tree.total_size() + aligned - hit - self.capacity_tokens
        if excess > 0:
            tree.evict(EvictRequest.full(excess))
        tree.insert(key, self.slots.take_numpy(len(key)))
        tree.unlock(receipt)
        return hit // self.page_size

    def take_events(self) -> list[KVEvent]:
        return self.tree.take_events()


@dataclass(frozen=True, kw_only=True)
class SimResult:
    policy: str
    approximate: bool
    num_instances: int
    capacity_pages: int
    requests: int
    pages: int
    hit_pages: int
    routed_pages: dict[str, int]

    @property
    def hit_rate(self) -> float:
        return self.hit_pages / self.pages if self.pages else 0.0

    @property
    def max_load_ratio(self) -> float:
        """Busiest instance's routed pages over the mean (1.0 = perfectly even)."""
        loads = list(self.routed_pages.values())
        mean = sum(loads) / len(loads) if loads else 0.0
        return max(loads) / mean if mean else 0.0


def simulate(
    prompts: Sequence[Sequence[int] | array],
    *,
    num_instances: int,
    capacity_pages: int,
    policy: str,
    page_size: int = 1,
    load_weight: float = 1.0,
    prefill_weight: float = 1.0,
    approximate_ttl_s: float | None = None,
) -> SimResult:
    """Replay `prompts` (token ids) through `num_instances` simulated instances routed by
    `policy`. Approximate mode uses the request index as clock (TTL in requests)."""
    if num_instances < 1:
        raise InvalidParameter(f"num_instances must be >= 1, got {num_instances}")
    names = [f"instance-{i}" for i in range(num_instances)]
    instances = {
        n: SimInstance(n, capacity_pages=capacity_pages, page_size=page_size) for n in names
    }
    index = PrefixIndex(page_size)
    tick = [0.0]
    router = Router(
        index,
        names,
        policy=policy,
        load_weight=load_weight,
        prefill_weight=prefill_weight,
        approximate_ttl_s=approximate_ttl_s,
        clock=lambda: tick[0],
    )
    pages = hits = 0
    for i, tokens in enumerate(prompts):
        tick[0] = float(i)
        keys = index.page_keys(np.asarray(tokens, dtype=np.int64))
        decision = router.route(keys)
        instance = instances[decision.instance]
        hits += instance.serve(tokens)
        pages += len(keys)
        events = instance.take_events()
        if approximate_ttl_s is None:
            index.apply(decision.instance, events)
    return SimResult(
        policy=policy,
        approximate=approximate_ttl_s is not None,
        num_instances=num_instances,
        capacity_pages=capacity_pages,
        requests=len(prompts),
        pages=pages,
        hit_pages=hits,
        routed_pages=dict(router.routed_pages),
    )


def read_trace(path: str, *, tokens_per_block: int = 1, limit: int = 0) -> list[array]:
    """Prompts of a Mooncake-format JSONL trace: block id h becomes tokens h*T .. h*T+T-1
    (T = `tokens_per_block`; with T = 1 and page size 1 a page is a trace block)."""
    import json

    t = tokens_per_block
    out: list[array] = []
    with open(path) as fh:
        for line in fh:
            if not line.strip():
                continue
            ids = json.loads(line)["hash_ids"]
            out.append(array("q", [h * t + j for h in ids for j in range(t)]))
            if limit and len(out) >= limit:
                break
    return out
