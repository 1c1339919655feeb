"""`kvstrata bench index`: the cluster prefix index (`kvstrata.prefix_index`) on a request trace.

Three records (JSON lines):

- `index_ops`: Dynamo's INDEXER_BENCH method in process, on the index core `PrefixIndex` picks
  (`core`: "native", the compiled extension module, unless there is no C compiler or Python
  headers or `KVSTRATA_NATIVE=0`; `native_status` says which module or why not) and, when
  that is the native one, on the Python core too (`python`, the same figures, measured
  alternately in the same run; `ratio_native_vs_python_*`). The trace is served (untimed) by one
  LRU-bounded simulated instance (`--capacity-pages`, default 8 x 5,860); each request gives one
  lookup (`find_matches` of its page keys) and its KV events (stored pages, evicted pages). The
  stream is replayed into a fresh index with every op timed: ops/s by wall clock and by this
  process's CPU time (the machine is shared), p50/p99 per op, pages per second. Baseline: the
  same stream on an unbounded index, measured in the same run; the bounded index
  (`--max-entries`, default half the distinct keys) is reported beside it with the ratio.
  Beside them: the unbounded replay untimed (no per-op clock), the timed replay into an index
  that does nothing (`harness_ns_per_op`: the loop and per-op clock reads, CPU ns per op: part
  of every timed figure), the same stream as bare calls of the compiled core (`native_floor`:
  no events, names or result objects around them), the same stream as bare dict
  probes (`bare_dict`: the floor of any CPython dict-keyed index on this machine, and the
  index's ratio to it), and the CPU ns of one dict probe on a 256-key and on a full-size dict
  (`dict_probe_ns`: on a shared machine the large one is cache misses, not bytecode).
- `index_memory`: bytes per entry (a key held by one instance) and per extra holder, of each
  core (the native core's C allocations counted beside tracemalloc's Python ones).
- `index_ray` (with `--ray`): the same stream through shard actors on a local 2-node loopback
  Ray cluster, one `round` call per shard per round (its lookups and its event batches), over
  each `--transport` (Ray actor calls; `direct`: the shards' TCP channels, placed and found
  through Ray), for every `--batch` (requests per round) x `--in-flight` (rounds outstanding);
  `--ray-repeats` passes over all configs, medians per config. Each op's latency is its round's
  time from submission to answer. Per config: ops/s, p50/p99, the driver's and the shards' CPU
  per op (and the driver's publishing part: splitting and encoding the events, which each engine
  instance pays in a deployment), and the rates those CPU costs allow on 2 idle cores (with and
  without publishing). Beside the curve: bare round trips (`echo`, an empty handler) on both
  transports and on an async actor, timed in the same session, and the load average before and
  after. Baseline: the in-process rate.
- `routing` (unless `--no-routing`): 8 simulated device-only LRU instances of 5,860 pages, the
  trace routed round-robin (baseline) and cache-aware; block hit rate and the busiest
  instance's routed pages over the mean.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from kvstrata.bench.report import emit, environment, ratio
from kvstrata.pool.native import disabled
from kvstrata.prefix_index import PrefixIndex, read_trace, simulate
from kvstrata.prefix_index.native import native_status
from kvstrata.prefix_index.opstream import (
    NullIndex,
    OpStream,
    OpTiming,
    bare_dict_floor,
    build_op_stream,
    dict_lookup_cost,
    measure_memory,
    native_floor,
    replay_ops,
    replay_untimed,
)

_TRACE_PARTS = ("shared", "traces", "mooncake_conversation_trace.jsonl")


def default_trace() -> Path | None:
    for parent in Path(__file__).resolve().parents:
        candidate = parent.joinpath(*_TRACE_PARTS)
        if candidate.is_file():
            return candidate
    return None


def _timing(t: OpTiming) -> dict[str, Any]:
    return {
        "ops": t.ops,
        "pages": t.pages,
        "seconds": round(t.seconds, 4),
        "ops_per_s": round(t.ops_per_s),
        "ops_per_cpu_s": round(t.ops_per_cpu_s),
        "pages_per_s": round(t.pages_per_s),
        "p50_us": round(t.p50_us, 2),
        "p99_us": round(t.p99_us, 2),
        "lookup_p99_us": round(t.lookup_p99_us, 2),
        "event_p99_us": round(t.event_p99_us, 2),
        "max_us": round(t.max_us, 1),
    }


def _median(runs: list[OpTiming]) -> OpTiming:
    return sorted(runs, key=lambda t: t.seconds)[(len(runs) - 1) // 2]


def _index(core: str, max_entries: int | None = None) -> PrefixIndex:
    """An index on `core`: the one PrefixIndex picks ("default"), or the Python entries."""
    if core == "python":
        with disabled():
            return PrefixIndex(1, max_entries=max_entries)
    return PrefixIndex(1, max_entries=max_entries)


class _CoreRuns:
    """Per-op timed replays (unbounded, bounded) and untimed ones of one core."""

    def __init__(self, core: str) -> None:
        self.core = core
        self.unbounded: list[OpTiming] = []
        self.bounded: list[OpTiming] = []
        self.untimed: list[float] = []

    def run(self, stream: OpStream, bound: int) -> None:
        self.unbounded.append(replay_ops(_index(self.core), stream))
        self.bounded.append(replay_ops(_index(self.core, bound), stream))
        self.untimed.append(replay_untimed(_index(self.core), stream))

    def figures(self, stream: OpStream) -> dict[str, Any]:
        base, ours = _median(self.unbounded), _median(self.bounded)
        return {
            "unbounded": _timing(base),
            "bounded": {**_timing(ours)},
            "ratio_bounded_vs_unbounded_ops": ratio(ours.ops_per_s, base.ops_per_s),
            "ops_per_cpu_s_all": [round(t.ops_per_cpu_s) for t in self.unbounded],
            "untimed_ops_per_cpu_s": round(self.untimed_rate(stream)),
        }

    def untimed_rate(self, stream: OpStream) -> float:
        return stream.num_ops / statistics.median(self.untimed)


def _ray_figures(
    stream: OpStream,
    batches: list[int],
    depth: int,
    in_flights: list[int],
    transports: list[str],
    repeats: int,
    in_process: OpTiming,
) -> dict[str, Any]:
    # Ray reads its loopback switch at import: set the quiet, loopback-only settings first.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Not `uv run` per worker in a copy of the working tree (RAY_NOTES: start-up).
    os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
    from kvstrata.prefix_index.localray import ReplayConfig, replay_on_local_cluster

    configs = [
        ReplayConfig(direct=t == "direct", batch_requests=b, in_flight=f)
        for t in transports
        for b in batches
        for f in in_flights
    ]
    # Every config once per pass, passes one after another: noise spreads over all configs.
    load_before = os.getloadavg()
    run = replay_on_local_cluster(stream, configs * repeats, branch_depth=depth)
    load_after = os.getloadavg()
    trips = run.trips
    curve: list[dict[str, Any]] = []
    for i, c in enumerate(configs):
        replays = run.replays[i :: len(configs)]
        runs = [r.timing for r in replays]
        ops = runs[0].ops
        rate = statistics.median(t.ops_per_s for t in runs)
        p99 = statistics.median(t.p99_us for t in runs)
        driver = statistics.median(t.cpu_seconds for t in runs)
        publish = statistics.median(r.publish_cpu_s for r in replays)
        shards = statistics.median(r.shard_cpu_s for r in replays)
        curve.append(
            {
                "transport": "direct" if c.direct else "ray",
                "batch_requests": c.batch_requests,
                "in_flight": c.in_flight,
                "ops_per_s": round(rate),
                "ops_per_s_all": [round(t.ops_per_s) for t in runs],
                "p50_us": round(statistics.median(t.p50_us for t in runs)),
                "p99_us": round(p99),
                "p99_us_all": [round(t.p99_us) for t in runs],
                "driver_cpu_us_per_op": round(driver / ops * 1e6, 1),
                # Of which publishing (events split by shard and encoded): in a deployment
                # each engine instance pays it, the router does not.
                "driver_publish_cpu_us_per_op": round(publish / ops * 1e6, 1),
                "shards_cpu_us_per_op": round(shards / ops * 1e6, 1),
                # The rate if driver and shards shared 2 idle cores perfectly: the CPU bound.
                "cpu_bound_ops_per_s_2_cores": round(2 * ops / (driver + shards)),
                "cpu_bound_ops_per_s_2_cores_without_publish": round(
                    2 * ops / (driver - publish + shards)
                ),
                "ratio_vs_in_process_ops": ratio(rate, in_process.ops_per_s),
                "meets_target": rate >= 30_000 and p99 <= 3_200,
            }
        )
    return {
        "shards": run.num_shards,
        "branch_depth": depth,
        "ops": stream.num_ops,
        "load_average_1m_before_after": [round(load_before[0], 2), round(load_after[0], 2)],
        "round_trip_us": {
            name: {
                "p50": round(rt.p50_us, 1),
                "p99": round(rt.p99_us, 1),
                "caller_cpu_per_call": round(rt.cpu_us_per_call, 1),
            }
            for name, rt in trips.items()
        },
        "ratio_round_trip_p50_ray_vs_direct": ratio(trips["ray"].p50_us, trips["direct"].p50_us),
        "ratio_round_trip_p50_async_vs_sync_actor": ratio(
            trips["ray_async_actor"].p50_us, trips["ray"].p50_us
        ),
        "ray_repeats": repeats,
        "curve": curve,
        "shard_skew": round(run.skew, 4),
        "in_process_ops_per_s": round(in_process.ops_per_s),
        "target_ops_per_s": 30_000,
        "target_p99_us": 3_200,
    }


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, comma-separated: {text!r}")
    return values


def _transports(text: str) -> list[str]:
    values = [v.strip() for v in text.split(",") if v.strip()]
    if not values or not set(values) <= {"ray", "direct"}:
        raise argparse.ArgumentTypeError(f"expected ray and/or direct: {text!r}")
    return values


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvstrata bench index",
        description="Prefix index ops/s, p99, bytes per entry and routing hit rates on a trace.",
    )
    parser.add_argument("--trace", type=Path, default=default_trace())
    parser.add_argument("--limit", type=int, default=0, help="first N requests (0 = all)")
    parser.add_argument("--capacity-pages", type=int, default=8 * 5860)
    parser.add_argument("--max-entries", type=int, default=0, help="0 = half the distinct keys")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--instances", type=int, default=8, help="routing: instances")
    parser.add_argument("--instance-pages", type=int, default=5860, help="routing: pages each")
    parser.add_argument("--load-weight", type=float, default=0.03, help="cache_aware load term")
    parser.add_argument("--no-routing", action="store_true")
    parser.add_argument("--ray", action="store_true", help="also measure through Ray shards")
    parser.add_argument(
        "--batch", type=_ints, default=[8, 16, 32, 64], help="--ray: requests per round (list)"
    )
    parser.add_argument(
        "--in-flight", type=_ints, default=[1, 2], help="--ray: rounds outstanding (list)"
    )
    parser.add_argument(
        "--ray-repeats", type=int, default=3, help="--ray: passes over the configs (medians)"
    )
    parser.add_argument(
        "--transport",
        type=_transports,
        default=["ray", "direct"],
        help="--ray: Ray actor calls and/or the shards' direct TCP channel (list)",
    )
    parser.add_argument(
        "--branch-depth",
        type=int,
        default=2,
        help="--ray: shard by page d-1 (every trace request opens with the same page)",
    )
    args = parser.parse_args(argv)
    if args.trace is None or not args.trace.is_file():
        parser.error("no trace: pass --trace (Mooncake JSONL)")
    if args.repeats < 1 or args.capacity_pages < 1 or args.limit < 0 or args.max_entries < 0:
        parser.error("--repeats and --capacity-pages must be >= 1; --limit, --max-entries >= 0")
    if args.ray_repeats < 1:
        parser.error("--ray-repeats must be >= 1")
    prompts = read_trace(str(args.trace), limit=args.limit)
    stream = build_op_stream(prompts, capacity_pages=args.capacity_pages)
    memory = measure_memory(stream)
    core = memory.core  # the core PrefixIndex picks here: "native" or "python"
    with disabled():
        py_memory = measure_memory(stream) if core == "native" else memory
    bound = args.max_entries or max(1, memory.num_entries // 2)
    main = _CoreRuns(core)
    python = _CoreRuns("python") if core == "native" else None
    floor: list[float] = []
    c_floor: list[float] = []
    harness: list[float] = []
    for _ in range(args.repeats):
        main.run(stream, bound)
        if python is not None:
            python.run(stream, bound)
        harness.append(replay_ops(NullIndex(), stream).cpu_seconds)
        floor.append(bare_dict_floor(stream))
        calls = native_floor(stream) if core == "native" else None
        if calls is not None:
            c_floor.append(calls[0] / calls[1])
    base = _median(main.unbounded)
    untimed_rate = main.untimed_rate(stream)
    floor_rate = stream.num_ops / statistics.median(floor)
    probe = dict_lookup_cost(stream)
    figures = main.figures(stream)
    figures["bounded"] = {"max_entries": bound, **figures["bounded"]}
    versus: dict[str, Any] = {}
    if python is not None:
        py_base = _median(python.unbounded)
        versus = {
            "python_core": python.figures(stream),
            "ratio_native_vs_python_ops_cpu": ratio(base.ops_per_cpu_s, py_base.ops_per_cpu_s),
            "ratio_native_vs_python_untimed": ratio(untimed_rate, python.untimed_rate(stream)),
            "ratio_native_vs_python_p99": ratio(base.p99_us, py_base.p99_us),
        }
    emit(
        {
            "bench": "index_ops",
            "core": core,
            "native_status": native_status(),
            "requests": len(prompts),
            "events": stream.num_events,
            "capacity_pages": args.capacity_pages,
            **figures,
            **versus,
            "harness_ns_per_op": round(statistics.median(harness) / stream.num_ops * 1e9),
            "bare_dict_ops_per_cpu_s": round(floor_rate),
            "ratio_untimed_vs_bare_dict": ratio(untimed_rate, floor_rate),
            **(
                {
                    "native_floor_ops_per_cpu_s": round(statistics.median(c_floor)),
                    "ratio_untimed_vs_native_floor": ratio(
                        untimed_rate, statistics.median(c_floor)
                    ),
                }
                if c_floor
                else {}
            ),
            "dict_probe_ns": {
                str(probe.small_entries): round(probe.small_ns, 1),
                str(probe.large_entries): round(probe.large_ns, 1),
            },
            "target_ops_per_s": 400_000,
            "target_p99_us": 50,
            "ratio_vs_target_cpu": ratio(base.ops_per_cpu_s, 400_000),
            "ratio_untimed_vs_target_cpu": ratio(untimed_rate, 400_000),
            **environment(),
        }
    )
    emit(
        {
            "bench": "index_memory",
            "core": core,
            "entries": memory.num_entries,
            "bytes_per_entry": round(memory.bytes_per_entry, 1),
            "bytes_per_extra_holder": round(memory.bytes_per_extra_holder, 1),
            "python_bytes_per_entry": round(py_memory.bytes_per_entry, 1),
            "python_bytes_per_extra_holder": round(py_memory.bytes_per_extra_holder, 1),
            "key_bytes": 32,
        }
    )
    if args.ray:
        from kvstrata.prefix_index.localray import RayDidNotStart

        try:
            emit(
                {
                    "bench": "index_ray",
                    **_ray_figures(
                        stream,
                        args.batch,
                        args.branch_depth,
                        args.in_flight,
                        args.transport,
                        args.ray_repeats,
                        base,
                    ),
                }
            )
        except RayDidNotStart as exc:
            print(f"kvstrata bench index --ray: Ray did not start: {exc}", file=sys.stderr)
            return 2
    if args.no_routing:
        return 0
    results = {}
    for policy in ("round_robin", "cache_aware"):
        results[policy] = simulate(
            prompts,
            num_instances=args.instances,
            capacity_pages=args.instance_pages,
            policy=policy,
            load_weight=args.load_weight,
        )
    rr, ca = results["round_robin"], results["cache_aware"]
    emit(
        {
            "bench": "routing",
            "instances": args.instances,
            "instance_pages": args.instance_pages,
            "load_weight": args.load_weight,
            "round_robin_hit_rate": round(rr.hit_rate, 4),
            "cache_aware_hit_rate": round(ca.hit_rate, 4),
            "ratio_hit_rate": ratio(ca.hit_rate, rr.hit_rate),
            "round_robin_max_load_ratio": round(rr.max_load_ratio, 4),
            "cache_aware_max_load_ratio": round(ca.max_load_ratio, 4),
            "cache_aware_routed_pages": ca.routed_pages,
            "median_routed_pages": statistics.median(ca.routed_pages.values()),
        }
    )
    return 0
