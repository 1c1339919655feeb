"""`kvstrata bench tiers`: hit share per tier of a Mooncake trace over device, host and storage.

The workload is `kvstrata bench radix`'s bounded replay (block id h -> tokens h*T .. h*T+T-1;
per request match the whole key, lock, evict the shortfall, insert, unlock; hit rate = hit
tokens / key tokens, counted before the request's own insert), run twice in the same process:

- baseline: a device-only tree of `--device-blocks` blocks (LRU): the device alone;
- tiered: the same device tree under a `HierarchicalCache` with a host tier of `--host-blocks`
  blocks and an unbounded memory storage: match on both tiers, prefetch from storage
  (`wait_complete`, threshold one page), load back, insert (write-through, backup to storage).

A small model (1 layer, 1 KV head, head_dim 8, fp16: 32 bytes per token) keeps the real page
copies cheap on CPU. The ideal is the unbounded prefix hit rate, computed in the same run with
an unbounded device-only tree. Prints one JSON line: per-tier hit shares, the three together,
their ratio to the ideal, the device-only LRU figure beside the tiered device share, bytes moved
per direction and the time spent waiting for transfers.
"""

from __future__ import annotations

import argparse
import time
from array import array
from pathlib import Path
from typing import Any

import torch

from kvstrata.allocator import PagedAllocator
from kvstrata.bench.radix import read_keys
from kvstrata.bench.report import emit, environment, pin_threads, ratio
from kvstrata.hybrid_cache import HybridPool, PoolGroup, PrefetchPolicy, TierController
from kvstrata.pool import MHAKVPool, MHASpec
from kvstrata.pool_host import HostLayout, MHAHostPool
from kvstrata.storage import MemoryStorage
from kvstrata.unified_radix_cache import EvictRequest, FullComponent, RadixKey, UnifiedRadixCache
from kvstrata.unified_radix_cache.hierarchy import HierarchicalCache
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy

_SPEC = MHASpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float16)


def _device_only(keys: list[array], *, page: int, capacity_tokens: int | None) -> float:
    """Hit rate of a device-only LRU tree (unbounded when `capacity_tokens` is None)."""
    size = capacity_tokens or sum(len(k) for k in keys) + page
    allocator = PagedAllocator(size=size, page_size=page, device="cpu")
    tree = UnifiedRadixCache([FullComponent(allocator)], page_size=page)
    hit = total = 0
    for tokens in keys:
        key = RadixKey(tokens)
        m = tree.match_prefix(key)
        hit += m.prefix_len
        total += len(tokens)
        receipt = tree.lock(m.last_node)
        need = len(tokens) - m.prefix_len
        if need > allocator.available_size():
            tree.evict(EvictRequest.full(need - allocator.available_size()))
        slots = allocator.alloc(need)
        assert slots is not None, "a request longer than the device"
        value = torch.cat([m.device_indices, slots])
        result = tree.insert(key, value, cached_len=m.prefix_len)
        allocator.free(result.duplicates(value))
        tree.unlock(receipt)
    return hit / total


def _tiered(
    keys: list[array], *, page: int, device_tokens: int, host_tokens: int, policy: WritePolicy
) -> dict[str, Any]:
    pool = MHAKVPool(_SPEC, size=device_tokens, page_size=page, device="cpu")
    allocator = PagedAllocator(size=device_tokens, page_size=page, device="cpu")
    tree = UnifiedRadixCache([FullComponent(allocator)], page_size=page)
    host = MHAHostPool(pool, layout=HostLayout.page_first, size=host_tokens)
    storage = MemoryStorage(capacity_bytes=1 << 40)
    controller = TierController(PoolGroup(HybridPool.full(pool), {"full": host}), storage=storage)
    params = TierParams(
        write_policy=policy,
        prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
        prefetch_threshold=page,
    )
    cache = HierarchicalCache(
        tree, controller=controller, host_allocator=host.make_allocator(), params=params
    )
    device = host_hit = storage_hit = total = 0
    start = time.perf_counter()
    try:
        for tokens in keys:
            key = RadixKey(tokens)
            m = cache.match_prefix(key)
            d, h = m.device.prefix_len, m.prefix_len
            found = m.device
            if m.prefetch_id is not None:
                cache.finish_prefetch(m.prefetch_id)
                found = cache.tier.match_key(key)  # the prefetch added host values: re-walk
            if found.last_host_node is not None:
                got = cache.load_back(found.last_host_node).match
            else:
                got = found
            hit = got.prefix_len
            device += min(hit, d)
            host_hit += max(min(hit, h) - d, 0)
            storage_hit += max(hit - max(h, d), 0)
            total += len(tokens)
            receipt = tree.lock(got.last_node)
            need = len(tokens) - hit
            if need > allocator.available_size():
                cache.evict_device(need - allocator.available_size())
            slots = allocator.alloc(need)
            assert slots is not None, "a request longer than the device"
            value = torch.cat([got.device_indices, slots])
            result = cache.insert(key, value, cached_len=hit)
            allocator.free(result.duplicates(value))
            tree.unlock(receipt)
        cache.drain()
        seconds = time.perf_counter() - start
        cache.check_integrity()
    finally:
        controller.close()
    c = cache.counters
    return {
        "device_hit_rate": device / total,
        "host_hit_rate": host_hit / total,
        "storage_hit_rate": storage_hit / total,
        "total_hit_rate": (device + host_hit + storage_hit) / total,
        "bytes_d2h": c.bytes_d2h,
        "bytes_h2d": c.bytes_h2d,
        "bytes_storage_get": c.bytes_storage_get,
        "bytes_storage_set": c.bytes_storage_set,
        "transfer_wait_seconds": round(c.transfer_wait_seconds, 3),
        "failed_transfers": c.failed_ops,
        "seconds": round(seconds, 3),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvstrata bench tiers", description=__doc__)
    parser.add_argument("--trace", type=Path, required=True)
    parser.add_argument("--tokens-per-block", type=int, default=16)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--device-blocks", type=int, default=2000)
    parser.add_argument("--host-blocks", type=int, default=10000)
    parser.add_argument(
        "--write-policy", choices=[p.value for p in WritePolicy], default="write_through"
    )
    parser.add_argument("--limit", type=int, default=0)
    args = parser.parse_args(argv)
    pin_threads(1)
    t, page = args.tokens_per_block, args.page_size
    keys = read_keys(args.trace, t, args.limit)
    ideal = _device_only(keys, page=page, capacity_tokens=None)
    lru = _device_only(keys, page=page, capacity_tokens=args.device_blocks * t)
    tiered = _tiered(
        keys,
        page=page,
        device_tokens=args.device_blocks * t,
        host_tokens=args.host_blocks * t,
        policy=WritePolicy(args.write_policy),
    )
    emit(
        {
            "bench": "tiers",
            "trace": str(args.trace),
            "requests": len(keys),
            "tokens_per_block": t,
            "page_size": page,
            "device_blocks": args.device_blocks,
            "host_blocks": args.host_blocks,
            "write_policy": args.write_policy,
            "model": "1 layer x 1 KV head x head_dim 8, fp16 (32 B/token)",
            "ideal_hit_rate": ideal,
            "device_only_lru_hit_rate": lru,
            **tiered,
            "ratio_total_vs_ideal": ratio(tiered["total_hit_rate"], ideal),
            "ratio_device_vs_lru": ratio(tiered["device_hit_rate"], lru),
            "environment": environment(),
        }
    )
    return 0
