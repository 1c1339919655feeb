"""`kvstrata bench radix`: replay a Mooncake trace through the unified radix tree alone.

The workload is the one of `shared/bench/peer/radix_replay.py` (normative), so that the figures
sit beside SGLang's `RadixCache` (pure Python) and `UnifiedRadixCache` (Rust core) measured in
the same session:

- block id h becomes tokens h*T .. h*T+T-1 (T = --tokens-per-block); a request's key is the
  concatenation of its blocks; keys are built before the timed loop (as the peer does);
- values are plain slot numbers, fresh consecutive numbers for the whole key of every request,
  handed out by a stand-in slot counter inside the timed loop (as `torch.arange`, like the peer,
  or as numpy int64 with `--values numpy`); the counter never runs out and counts what the tree
  frees back;
- unbounded (default): per request `match_prefix`, then `insert`;
- `--capacity-blocks N` (C = N*T tokens): per request `match_prefix`, `lock` the matched node,
  `excess = evictable + protected + (page-aligned len - hit) - C`, `evict(excess)` when > 0,
  `insert`, `unlock`; eviction is page-granular, so it frees exactly the pages asked for;
- `hit_rate` = hit tokens / key tokens, counted before each request's own insert.

One torch thread, as the peer scripts; a full garbage collection before each timed pass (the
collector stays on during it). Our tree runs with its defaults, the insert slot check on
(`check_slots=True`); each repeat also times one pass with the check off, interleaved.
Prints one JSON line: requests, tokens, hit_tokens, hit_rate, seconds (median over --repeats
passes, each on a fresh tree), requests_per_s, tokens_per_s, evicted_tokens, `check_off` (the
same figures with `check_slots=False`) and `check_slots_cost` (median seconds with the check /
without it), and, unless --no-peer, the peer figures for `--impl classic` and `--impl unified`
run in the same session (same repeats, interleaved with ours) and the ratios of requests/s:
`ratio_vs_<impl>` of the median passes (check on), `ratio_vs_<impl>_fastest` of the fastest
ones (the least disturbed on a shared machine), `ratio_vs_<impl>_check_off` for the check off.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.allocator import SlotCounter
from kvstrata.bench.report import emit, environment, pin_threads, ratio
from kvstrata.bench.trace_input import check_trace_options, read_keys, trace_replay_parser
from kvstrata.unified_radix_cache import (
    POLICIES,
    EvictRequest,
    FullComponent,
    RadixKey,
    UnifiedRadixCache,
)

_PEER_SCRIPT_PARTS = ("shared", "bench", "peer", "radix_replay.py")


def replay(
    keys: list[array],
    *,
    page_size: int,
    capacity_blocks: int,
    tokens_per_block: int,
    policy: str,
    values: str,
    check_slots: bool = True,
) -> dict[str, Any]:
    """One timed pass over `keys` on a fresh tree; returns the peer's JSON keys.
    `check_slots`: the tree's insert slot check (on by default, as a user gets it; the stand-in
    sink has no `check_allocated`, so it covers range, repeats and slots already held)."""
    sink = SlotCounter()
    tree = UnifiedRadixCache(
        [FullComponent(sink)],
        page_size=page_size,
        eviction_policy=policy,
        check_slots=check_slots,
    )
    take: Callable[[int], torch.Tensor | npt.NDArray[np.int64]] = (
        sink.take_numpy if values == "numpy" else sink.take_torch
    )
    cap = capacity_blocks * tokens_per_block
    hit = total = evict_calls = evict_requested = evicted = over_cap = 0
    match, insert = tree.match_prefix, tree.insert
    # Collect the setup's garbage (trace parsing, earlier passes) now, so that the timed pass
    # pays only for collections its own work triggers. The collector stays enabled.
    gc.collect()
    cpu_start = time.process_time()
    start = time.perf_counter()
    if not cap:
        for k in keys:
            key = RadixKey(k)
            hit += match(key).prefix_len
            total += len(k)
            insert(key, take(len(k)))
    else:
        lock, unlock, evict = tree.lock, tree.unlock, tree.evict
        size = tree.total_size
        for k in keys:
            key = RadixKey(k)
            m = match(key)
            n = m.prefix_len
            hit += n
            total += len(k)
            receipt = lock(m.last_node)
            excess = size() + (len(k) // page_size * page_size - n) - cap
            if excess > 0:
                evicted += evict(EvictRequest.full(excess)).num_evicted()
                evict_calls += 1
                evict_requested += excess
            insert(key, take(len(k)))
            unlock(receipt)
            over_cap += size() > cap
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    out: dict[str, Any] = {
        "requests": len(keys),
        "tokens": total,
        "hit_tokens": hit,
        "hit_rate": hit / total if total else 0.0,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "requests_per_s": len(keys) / seconds,
        "tokens_per_s": total / seconds,
        "evicted_tokens": evicted,
        "cached_tokens_at_end": tree.total_size(),
        "slots_freed_by_cache": sink.freed,
    }
    if cap:
        out.update(
            capacity_tokens=cap,
            evict_calls=evict_calls,
            evict_requested_tokens=evict_requested,
            over_capacity_inserts=over_cap,
        )
    return out


def default_peer_python() -> str | None:
    venv = os.environ.get("PEER_VENV")
    for candidate in ([Path(venv) / "bin" / "python"] if venv else []) + [
        Path("/tmp/kvstrata-peer/bin/python")
    ]:
        if candidate.exists():
            return str(candidate)
    return None


def find_peer_script() -> Path | None:
    here = Path(__file__).resolve()
    for parent in here.parents:
        candidate = parent.joinpath(*_PEER_SCRIPT_PARTS)
        if candidate.is_file():
            return candidate
    return None


def run_peer(python: str, script: Path, args: argparse.Namespace, impl: str) -> dict[str, Any]:
    cmd = [
        python,
        str(script),
        str(Path(args.trace).resolve()),  # the peer runs from its own folder
        "--impl",
        impl,
        "--tokens-per-block",
        str(args.tokens_per_block),
        "--page-size",
        str(args.page_size),
        "--capacity-blocks",
        str(args.capacity_blocks),
        "--threads",
        str(args.threads),
    ]
    if args.limit:
        cmd += ["--limit", str(args.limit)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=script.parent, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"peer {impl} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median time (so every figure in it comes from one real pass), plus the
    fastest time and every time: on a shared machine the minimum is the least disturbed."""
    ordered = sorted(runs, key=lambda r: r["seconds"])
    chosen = dict(ordered[(len(ordered) - 1) // 2])
    chosen["seconds_min"] = ordered[0]["seconds"]
    chosen["seconds_all"] = [round(r["seconds"], 4) for r in runs]
    return chosen


def main(argv: list[str]) -> int:
    parser = trace_replay_parser(
        "radix", "Replay a Mooncake trace through the unified radix tree alone, beside SGLang."
    )
    parser.add_argument("--capacity-blocks", type=int, default=0, help="0 = unbounded")
    parser.add_argument(
        "--policy",
        default="lru",
        choices=sorted(POLICIES),
        help="eviction policy of our tree (the peers always run LRU)",
    )
    parser.add_argument("--repeats", type=int, default=3, help="passes per implementation")
    parser.add_argument(
        "--values",
        choices=["torch", "numpy"],
        default="torch",
        help="slot numbers as torch.arange (as the peer) or numpy int64",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--peer-python",
        default=default_peer_python(),
        help="python of the SGLang peer venv ($PEER_VENV or /tmp/kvstrata-peer)",
    )
    parser.add_argument("--no-peer", action="store_true", help="skip the SGLang peer runs")
    args = parser.parse_args(argv)
    check_trace_options(parser, args)
    if args.capacity_blocks < 0 or args.repeats < 1:
        parser.error("--repeats must be >= 1 and --capacity-blocks >= 0")
    pin_threads(args.threads)
    keys = read_keys(args.trace, args.tokens_per_block, args.limit)
    peer_script = find_peer_script()
    with_peer = not args.no_peer
    if with_peer and (
        args.peer_python is None or not Path(args.peer_python).exists() or peer_script is None
    ):
        print(
            "kvstrata bench radix: no peer venv or peer script found; run "
            "`bash shared/bench/peer/setup.sh` or pass --no-peer",
            file=sys.stderr,
        )
        return 2
    ours: list[dict[str, Any]] = []
    unchecked: list[dict[str, Any]] = []
    peers: dict[str, list[dict[str, Any]]] = {"classic": [], "unified": []}
    for _ in range(args.repeats):
        for check, runs in ((True, ours), (False, unchecked)):
            runs.append(
                replay(
                    keys,
                    page_size=args.page_size,
                    capacity_blocks=args.capacity_blocks,
                    tokens_per_block=args.tokens_per_block,
                    policy=args.policy,
                    values=args.values,
                    check_slots=check,
                )
            )
        if with_peer:
            assert args.peer_python is not None and peer_script is not None
            for impl in peers:
                peers[impl].append(run_peer(args.peer_python, peer_script, args, impl))
    record: dict[str, Any] = {
        "bench": "radix",
        "impl": "kvstrata UnifiedRadixCache",
        "trace": str(args.trace),
        "tokens_per_block": args.tokens_per_block,
        "page_size": args.page_size,
        "capacity_blocks": args.capacity_blocks or None,
        "policy": args.policy,
        "values": args.values,
        "repeats": args.repeats,
    }
    record.update(_median_run(ours))
    record["check_slots"] = True
    off = _median_run(unchecked)
    record["check_off"] = {
        k: off[k] for k in ("seconds", "seconds_min", "seconds_all", "requests_per_s", "hit_rate")
    }
    record["check_slots_cost"] = ratio(record["seconds"], off["seconds"])
    record["check_slots_cost_fastest"] = ratio(record["seconds_min"], off["seconds_min"])
    if with_peer:
        for impl, runs in peers.items():
            peer = _median_run(runs)
            record[f"peer_{impl}"] = {
                k: peer.get(k)
                for k in (
                    "impl",
                    "hit_rate",
                    "seconds",
                    "seconds_min",
                    "seconds_all",
                    "requests_per_s",
                    "tokens_per_s",
                    "evicted_tokens",
                    "evict_calls",
                    "tree_core_backend",
                    "torch",
                )
                if k in peer
            }
            # requests/s ratio = inverse ratio of the times of one pass over the same trace
            record[f"ratio_vs_{impl}"] = ratio(record["requests_per_s"], peer["requests_per_s"])
            record[f"ratio_vs_{impl}_fastest"] = ratio(peer["seconds_min"], record["seconds_min"])
            peer_rate = peer["requests_per_s"]
            record[f"ratio_vs_{impl}_check_off"] = ratio(off["requests_per_s"], peer_rate)
    record["environment"] = environment()
    emit(record)
    return 0
