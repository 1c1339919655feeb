"""`kvstrata bench tiers`: hit share per tier and the cost of the tiered path, side by side.

The workload is `kvstrata bench radix`'s bounded replay (block id h -> tokens h*T .. h*T+T-1)
driven the way an engine drives its cache, through the one `PrefixCache` protocol
(`kvstrata.unified_radix_cache.protocol`): per request `begin_request` (match and lock on every
tier, prefetch and load back), `alloc_tokens` (allocate-or-evict), `cache_finished_request`
(insert, write policy). A request is its blocks plus the one token an engine computes, so the
whole prompt may hit (an engine matches at most N - 1 tokens). Hit rate = hit tokens / prompt
tokens, counted before the request's own insert. The same loop runs, in the same process, over:

- device: a `DeviceCache` of `--device-blocks` blocks (LRU): the baseline;
- host: the same device under a `HierarchicalCache` with a host tier of `--host-blocks` blocks;
- storage: the same plus an unbounded memory storage (prefetch `wait_complete`, threshold one
  page; each host write backed up).

A small model (1 layer, 1 KV head, head_dim 8, fp16: 32 bytes per token) keeps the real page
copies cheap on CPU. The ideal is the unbounded prefix hit rate (an unbounded device cache).
`seconds_*` time the whole loop (cache operations only: there is no forward) plus the final
drain of transfers; `ratio_host_vs_device` and `ratio_storage_vs_device` divide them by the
device-only time of the same run (the issue-11 targets are <= 2 and <= 3); `cpu_seconds_*` and
`cpu_ratio_*` are the same over the process's CPU time (all its threads), steadier than wall
time on a shared, loaded machine. Prints one JSON line:
per-tier hit shares (of the storage run, and of the host run), bytes moved per direction, time
spent waiting for transfers.
"""

from __future__ import annotations

import argparse
import time
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvstrata.allocator import PagedAllocator
from kvstrata.bench.report import emit, environment, pin_threads, ratio
from kvstrata.bench.trace_input import read_keys
from kvstrata.hybrid_cache import HybridPool, PoolGroup, PrefetchPolicy, TierController
from kvstrata.pool import MHAKVPool, MHASpec
from kvstrata.pool_host import HostLayout, MHAHostPool
from kvstrata.storage import MemoryStorage
from kvstrata.unified_radix_cache import DeviceCache, FullComponent, RadixKey, UnifiedRadixCache
from kvstrata.unified_radix_cache.hierarchy import HierarchicalCache
from kvstrata.unified_radix_cache.protocol import PrefixCache
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy

_SPEC = MHASpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float16)


def _requests(keys: list[array]) -> list[RadixKey]:
    """Each key plus the token the engine computes (never cached: it is a partial page)."""
    return [RadixKey(np.append(np.frombuffer(k, dtype=np.int64), 0)) for k in keys]


def _serve_all(cache: PrefixCache, requests: list[RadixKey]) -> dict[str, float]:
    """The engine loop over `requests`; returns hit shares per tier and the loop's seconds."""
    page = cache.page_size
    device = host = storage = total = 0
    start, cpu_start = time.perf_counter(), time.process_time()
    for key in requests:
        n = len(key) - 1  # the prompt: whole pages (the computed token is not cached)
        req = cache.begin_request(key)
        hit = req.hit
        device += hit.device_len
        host += hit.host_len
        storage += hit.storage_len
        total += n
        slots = cache.alloc_tokens(-(-(n - req.cached_len) // page) * page)
        assert slots is not None, "a request longer than the device"
        req.extend(slots)
        cache.cache_finished_request(req)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    return {
        "device": device / total,
        "host": host / total,
        "storage": storage / total,
        "total": (device + host + storage) / total,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
    }


def _device_only(
    requests: list[RadixKey], *, page: int, capacity_tokens: int | None
) -> dict[str, float]:
    """A device-only LRU cache (unbounded when `capacity_tokens` is None)."""
    size = capacity_tokens or sum(len(k) - 1 for k in requests) + page
    allocator = PagedAllocator(size=size, page_size=page, device="cpu")
    tree = UnifiedRadixCache([FullComponent(allocator)], page_size=page)
    cache = DeviceCache(tree, kv_allocator=allocator)
    got = _serve_all(cache, requests)
    cache.check_integrity()
    return got


def _tiered(
    requests: list[RadixKey],
    *,
    page: int,
    device_tokens: int,
    host_tokens: int,
    policy: WritePolicy,
    with_storage: bool,
) -> dict[str, Any]:
    pool = MHAKVPool(_SPEC, size=device_tokens, page_size=page, device="cpu")
    allocator = PagedAllocator(size=device_tokens, page_size=page, device="cpu")
    tree = UnifiedRadixCache([FullComponent(allocator)], page_size=page)
    host = MHAHostPool(pool, layout=HostLayout.page_first, size=host_tokens)
    storage = MemoryStorage(capacity_bytes=1 << 40) if with_storage else None
    controller = TierController(PoolGroup(HybridPool.full(pool), {"full": host}), storage=storage)
    params = TierParams(
        write_policy=policy,
        prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
        prefetch_threshold=page,
    )
    cache = HierarchicalCache(
        tree, controller=controller, host_allocator=host.make_allocator(), params=params
    )
    try:
        start, cpu_start = time.perf_counter(), time.process_time()
        got = _serve_all(cache, requests)
        cache.drain()
        got["seconds"] = time.perf_counter() - start
        got["cpu_seconds"] = time.process_time() - cpu_start
        cache.check_integrity()
    finally:
        controller.close()
    c = cache.counters
    return {
        **got,
        "bytes_d2h": c.bytes_d2h,
        "bytes_h2d": c.bytes_h2d,
        "bytes_storage_get": c.bytes_storage_get,
        "bytes_storage_set": c.bytes_storage_set,
        "transfer_wait_seconds": round(c.transfer_wait_seconds, 3),
        "failed_transfers": c.failed_ops,
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
    requests = _requests(read_keys(args.trace, t, args.limit))
    ideal = _device_only(requests, page=page, capacity_tokens=None)["total"]
    device = _device_only(requests, page=page, capacity_tokens=args.device_blocks * t)
    runs = {
        name: _tiered(
            requests,
            page=page,
            device_tokens=args.device_blocks * t,
            host_tokens=args.host_blocks * t,
            policy=WritePolicy(args.write_policy),
            with_storage=with_storage,
        )
        for name, with_storage in (("host", False), ("storage", True))
    }
    tiered, host_only = runs["storage"], runs["host"]
    emit(
        {
            "bench": "tiers",
            "trace": str(args.trace),
            "requests": len(requests),
            "tokens_per_block": t,
            "page_size": page,
            "device_blocks": args.device_blocks,
            "host_blocks": args.host_blocks,
            "write_policy": args.write_policy,
            "model": "1 layer x 1 KV head x head_dim 8, fp16 (32 B/token)",
            "ideal_hit_rate": ideal,
            "device_only_lru_hit_rate": device["total"],
            "device_hit_rate": tiered["device"],
            "host_hit_rate": tiered["host"],
            "storage_hit_rate": tiered["storage"],
            "total_hit_rate": tiered["total"],
            "host_only_device_hit_rate": host_only["device"],
            "host_only_host_hit_rate": host_only["host"],
            **{k: v for k, v in tiered.items() if k.startswith(("bytes_", "transfer_", "failed"))},
            "seconds_device_only": round(device["seconds"], 3),
            "seconds_host": round(host_only["seconds"], 3),
            "seconds_host_storage": round(tiered["seconds"], 3),
            "cpu_seconds_device_only": round(device["cpu_seconds"], 3),
            "cpu_seconds_host": round(host_only["cpu_seconds"], 3),
            "cpu_seconds_host_storage": round(tiered["cpu_seconds"], 3),
            "ratio_host_vs_device": ratio(host_only["seconds"], device["seconds"]),
            "ratio_storage_vs_device": ratio(tiered["seconds"], device["seconds"]),
            "cpu_ratio_host_vs_device": ratio(host_only["cpu_seconds"], device["cpu_seconds"]),
            "cpu_ratio_storage_vs_device": ratio(tiered["cpu_seconds"], device["cpu_seconds"]),
            "ratio_total_vs_ideal": ratio(tiered["total"], ideal),
            "ratio_device_vs_lru": ratio(tiered["device"], device["total"]),
            "environment": environment(),
        }
    )
    return 0
