"""`kvstrata bench plan`: the whole LRU curve in one pass beside direct replays of the tree.

The curve (`kvstrata.plan.lru_curve`, from the parsed block chains: dense renaming, chain check
and the stack-distance pass) gives the hit rate at every capacity; a direct replay gives it at
one. The direct replays are `kvstrata bench radix`'s bounded replay through the unified radix
tree (T = P = --tokens-per-block, numpy slot values, LRU), one per capacity of --capacities
(default the trace README's 1,000 / 10,000 / 100,000 blocks). Both sides start from parsed
input (block chains / token keys); parsing is timed once each and reported apart.

Each repeat times the curve and then the replays back to back; the line reports the medians,
`ratio` = median replays time / median curve time, `paired_ratio` = the median of the per-repeat
ratios, and, per capacity, the replay's hit tokens beside the curve's (`exact`: equal at every
capacity, as the stack algorithm promises for capacities >= the longest request).
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

from kvstrata.bench.radix import replay
from kvstrata.bench.report import emit, environment, pin_threads, ratio
from kvstrata.bench.trace_input import check_trace_options, read_keys, trace_replay_parser
from kvstrata.plan import BlockTrace, lru_curve
from kvstrata.replay import read_trace


def main(argv: list[str]) -> int:
    parser = trace_replay_parser(
        "plan",
        "Time the one-pass LRU curve beside direct tree replays at a few capacities (pages of "
        "--tokens-per-block tokens).",
        page_size=False,
    )
    parser.add_argument(
        "--capacities",
        default="1000,10000,100000",
        help="capacities (blocks) of the direct replays, comma-separated",
    )
    parser.add_argument("--repeats", type=int, default=3, help="curve + replays rounds")
    args = parser.parse_args(argv)
    check_trace_options(parser, args)
    try:
        capacities = [int(c) for c in args.capacities.split(",") if c.strip()]
    except ValueError:
        parser.error(f"--capacities takes integers separated by commas, got {args.capacities!r}")
    if not capacities or min(capacities) < 1:
        parser.error("--capacities needs at least one capacity >= 1 block")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    pin_threads(1)
    tpb = args.tokens_per_block

    started = time.perf_counter()
    requests = read_trace(args.trace, tokens_per_block=1, limit=args.limit or None)
    chains = [r.token_ids for r in requests]
    parse_chains_seconds = time.perf_counter() - started
    started = time.perf_counter()
    keys = read_keys(args.trace, tpb, args.limit)
    parse_keys_seconds = time.perf_counter() - started

    curve_times: list[float] = []
    replay_times: list[float] = []
    replays: dict[int, dict[str, Any]] = {}
    curve = None
    for _ in range(args.repeats):
        gc.collect()
        started = time.perf_counter()
        curve = lru_curve(BlockTrace.from_chains(chains))
        curve_times.append(time.perf_counter() - started)
        total = 0.0
        for capacity in capacities:
            # replay() collects garbage itself and times only its own pass.
            result = replay(
                keys,
                page_size=tpb,
                capacity_blocks=capacity,
                tokens_per_block=tpb,
                policy="lru",
                values="numpy",
            )
            total += result["seconds"]
            replays[capacity] = result
        replay_times.append(total)
    assert curve is not None, "--repeats >= 1 ran the curve"
    curve.check_integrity()

    per_capacity = []
    for capacity in capacities:
        result = replays[capacity]
        curve_hit_tokens = curve.hit_blocks(capacity) * tpb
        per_capacity.append(
            {
                "capacity_blocks": capacity,
                "replay_hit_tokens": result["hit_tokens"],
                "curve_hit_tokens": curve_hit_tokens,
                "hit_rate": round(result["hit_rate"], 6),
                "replay_seconds": round(result["seconds"], 4),
                "exact": result["hit_tokens"] == curve_hit_tokens,
            }
        )
    curve_median = statistics.median(curve_times)
    replays_median = statistics.median(replay_times)
    record: dict[str, Any] = {
        "bench": "plan",
        "trace": str(args.trace),
        "requests": curve.num_requests,
        "block_references": curve.num_references,
        "distinct_blocks": curve.num_distinct,
        "max_request_blocks": curve.max_request_blocks,
        "tokens_per_block": tpb,
        "repeats": args.repeats,
        "curve_seconds": round(curve_median, 4),
        "curve_capacities": curve.num_distinct + 1,
        "replays": len(capacities),
        "replays_seconds": round(replays_median, 4),
        "ratio": ratio(replays_median, curve_median),
        "paired_ratio": round(
            statistics.median(r / c for c, r in zip(curve_times, replay_times, strict=True)), 4
        ),
        "curve_seconds_all": [round(t, 4) for t in curve_times],
        "replays_seconds_all": [round(t, 4) for t in replay_times],
        "parse_chains_seconds": round(parse_chains_seconds, 4),
        "parse_keys_seconds": round(parse_keys_seconds, 4),
        "exact": all(row["exact"] for row in per_capacity),
        "capacities": per_capacity,
        "environment": environment(),
    }
    emit(record)
    return 0
