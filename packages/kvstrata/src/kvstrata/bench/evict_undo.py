"""`kvstrata bench evict_undo`: what the evict undo journal costs on a tree with a state component.

A device-only `UnifiedRadixCache` with Full + SWA components (a real `SWAAllocator`) evicts all or
nothing (unified_radix_cache/evict_undo.py): it records every node it changes and the LRU
orders, checks every component's queued frees, and only then frees. This benchmark replays a
Mooncake trace through such a tree at a fixed pool size, as an engine drives it, twice per
repeat on fresh trees: `journal` (the tree as built) and `plain` (the same tree whose evict
lets each component evict and then frees, with no journal and no check before the frees: the
evict before the undo journal existed). Both replay the same requests and must evict the same
tokens and hit the same prefixes (checked: the run fails otherwise).

Per request: `match_prefix`, `lock` the match, allocate slots for the whole key from the real
allocator (on failure `evict` the shortfall from every component and allocate again; a request
that still does not fit is skipped, counted in `skipped`), `insert`, free the caller's
duplicates and unaligned tail, `unlock`. Prints one JSON line: per variant the medians of the
pass seconds (wall and CPU) and of the seconds spent inside `evict` (`tree.evict_seconds`), and
the ratios journal / plain.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from kvstrata.allocator import SWAAllocator
from kvstrata.bench.report import emit, environment, pin_threads, ratio
from kvstrata.bench.trace_input import check_trace_options, read_keys, trace_replay_parser
from kvstrata.unified_radix_cache import (
    EvictRequest,
    FullComponent,
    RadixKey,
    SWAComponent,
    UnifiedRadixCache,
)
from kvstrata.unified_radix_cache import evict_undo as undo_module


def _evict_plain(tree: UnifiedRadixCache, targets: Mapping[str, int]) -> None:
    """Each component evicts its target, then every component frees: no journal, no check."""
    for component in tree.components:
        target = targets.get(component.name, 0)
        if target > 0:
            component.evict(target)
    for component in tree.components:
        component.flush()


@contextmanager
def _without_journal() -> Iterator[None]:
    built = undo_module.evict_components
    undo_module.evict_components = _evict_plain
    try:
        yield
    finally:
        undo_module.evict_components = built


def replay(keys: list[Any], *, pool_tokens: int, page_size: int, window: int) -> dict[str, Any]:
    """One pass over `keys` on a fresh tree (module docstring)."""
    full = SWAAllocator(size=pool_tokens, swa_size=pool_tokens, page_size=page_size, device="cpu")
    tree = UnifiedRadixCache(
        [FullComponent(full), SWAComponent(full, sliding_window=window)], page_size=page_size
    )
    names = [c.name for c in tree.components]
    hit = total = skipped = 0
    gc.collect()
    cpu_start = time.process_time()
    start = time.perf_counter()
    for k in keys:
        key = RadixKey(k)
        m = tree.match_prefix(key)
        hit += m.prefix_len
        total += len(k)
        receipt = tree.lock(m.last_node)
        need = -(-len(k) // page_size) * page_size
        slots = full.alloc(need)
        if slots is None:
            tree.evict(EvictRequest(targets=dict.fromkeys(names, need)))
            slots = full.alloc(need)
        if slots is None:
            skipped += 1
            tree.unlock(receipt)
            continue
        slots = slots[: len(k)]
        result = tree.insert(key, slots)
        duplicates = result.duplicates(slots)
        if len(duplicates):
            full.free(duplicates)
        kept = result.prefix_len + result.inserted_len
        if kept < len(k):
            full.free(slots[kept:])
        tree.unlock(receipt)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "cpu_seconds": time.process_time() - cpu_start,
        "evict_seconds": tree.evict_seconds,
        "evict_calls": tree.evict_calls,
        "evicted": {c.name: c.evicted_total for c in tree.components},
        "hit_tokens": hit,
        "hit_rate": hit / total if total else 0.0,
        "skipped": skipped,
    }


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out = {k: statistics.median(r[k] for r in runs) for k in ("seconds", "cpu_seconds")}
    out["evict_seconds"] = statistics.median(r["evict_seconds"] for r in runs)
    out["seconds_all"] = [round(r["seconds"], 4) for r in runs]
    out["evict_seconds_all"] = [round(r["evict_seconds"], 4) for r in runs]
    for k in ("evict_calls", "evicted", "hit_rate", "skipped"):
        out[k] = runs[0][k]
    return out


def main(argv: list[str]) -> int:
    parser = trace_replay_parser(
        "evict_undo",
        "The evict undo journal's cost: a Full + SWA tree's replay with and without.",
        limit=3000,
    )
    parser.add_argument("--capacity-blocks", type=int, default=10000, help="pool size in blocks")
    parser.add_argument("--window", type=int, default=1024, help="SWA sliding window (tokens)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    check_trace_options(parser, args)
    if min(args.capacity_blocks, args.window, args.repeats) < 1:
        parser.error("--capacity-blocks, --window, --repeats must be >= 1")
    pin_threads(1)
    keys = read_keys(args.trace, args.tokens_per_block, args.limit)
    pool = args.capacity_blocks * args.tokens_per_block
    runs: dict[str, list[dict[str, Any]]] = {"journal": [], "plain": []}
    for _ in range(args.repeats):
        for variant, out in runs.items():
            if variant == "plain":
                with _without_journal():
                    out.append(
                        replay(keys, pool_tokens=pool, page_size=args.page_size, window=args.window)
                    )
            else:
                out.append(
                    replay(keys, pool_tokens=pool, page_size=args.page_size, window=args.window)
                )
    journal, plain = _medians(runs["journal"]), _medians(runs["plain"])
    for key in ("evicted", "hit_rate", "skipped", "evict_calls"):
        if journal[key] != plain[key]:
            raise RuntimeError(f"variants differ in {key}: {journal[key]} vs {plain[key]}")
    emit(
        {
            "bench": "evict_undo",
            "trace": str(args.trace),
            "components": "full+swa",
            "requests": len(keys),
            "pool_tokens": pool,
            "page_size": args.page_size,
            "window": args.window,
            "repeats": args.repeats,
            "journal": journal,
            "plain": plain,
            "evict_cost": ratio(journal["evict_seconds"], plain["evict_seconds"]),
            "pass_cost": ratio(journal["seconds"], plain["seconds"]),
            "pass_cost_cpu": ratio(journal["cpu_seconds"], plain["cpu_seconds"]),
            "environment": environment(),
        }
    )
    return 0
