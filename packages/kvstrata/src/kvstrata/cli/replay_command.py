"""`kvstrata replay`: the main job's command line.

Builds a memory system for one model family, replays a Mooncake trace (or the embedded
workload) through it, shows a progress bar on stderr, and prints a summary table (and, with
`--json FILE`, the same figures as one JSON object).

Only argparse is imported at module level: `kvstrata version` and `kvstrata --help` build this
parser too, and should not pay for importing torch. The family and policy choices are therefore
spelled out here; a test checks them against `kvstrata.build.FAMILIES` and `POLICIES`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from kvstrata.cli.errors import print_error

if TYPE_CHECKING:
    from rich.table import Table

    from kvstrata.build import MemorySystem
    from kvstrata.build.tiers import TieredSystem
    from kvstrata.replay import ReplayEngine, ReplayRequest, ReplayStats

FAMILY_CHOICES: tuple[str, ...] = ("mha", "swa", "mamba")
POLICY_CHOICES: tuple[str, ...] = ("lru", "lfu", "fifo", "mru", "filo", "priority")

#: Keys of the `--json` record, in order (the summary table shows the same figures).
JSON_KEYS: tuple[str, ...] = (
    "source",
    "family",
    "policy",
    "page_size",
    "tokens_per_block",
    "capacity_tokens",
    "unbounded",
    "device",
    "requests",
    "prompt_tokens",
    "hit_tokens",
    "computed_tokens",
    "evicted_tokens",
    "cache_seconds",
    "kv_write_seconds",
    "hit_rate",
    "requests_per_s",
    "tokens_per_s",
    "wall_seconds",
)

WRITE_POLICY_CHOICES: tuple[str, ...] = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICY_CHOICES: tuple[str, ...] = ("best_effort", "wait_complete", "timeout")

#: Keys added to the `--json` record (after "tokens_per_s") when a host tier is configured.
#: `host_state_slots` / `host_swa_tokens` are null for a family without Mamba / SWA layers.
TIER_JSON_KEYS: tuple[str, ...] = (
    "host_tokens",
    "host_state_slots",
    "host_swa_tokens",
    "storage",
    "write_policy",
    "prefetch_policy",
    "device_hit_tokens",
    "host_hit_tokens",
    "storage_hit_tokens",
    "bytes_d2h",
    "bytes_h2d",
    "bytes_storage_get",
    "bytes_storage_set",
    "transfer_wait_seconds",
    "failed_transfers",
)


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `replay` on the `kvstrata` command's subparsers."""
    parser = sub.add_parser(
        "replay",
        help="replay a request trace (or the embedded workload) through the memory system",
        description=(
            "Drive requests through the real allocator, pools and radix tree as an engine "
            "would (match, lock, allocate, write KV, insert, release) and report the hit rate "
            "and the speed of the cache operations. Without --trace it runs the embedded "
            "workload (shared system prompts and multi-turn conversations)."
        ),
    )
    parser.add_argument(
        "--trace", type=Path, help="Mooncake-format trace (JSON lines with hash_ids)"
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    parser.add_argument(
        "--tokens-per-block",
        type=int,
        default=16,
        help="tokens each trace block id stands for (default 16)",
    )
    parser.add_argument(
        "--capacity-tokens",
        type=int,
        help="device KV capacity in tokens (default: unbounded, room for every prompt)",
    )
    parser.add_argument("--policy", choices=POLICY_CHOICES, default="lru", help="eviction policy")
    parser.add_argument("--family", choices=FAMILY_CHOICES, default="mha", help="model family")
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument("--seed", type=int, default=0, help="seed of the embedded workload")
    parser.add_argument("--device", default="cpu", help="device of the pools (default cpu)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="read back every hit's KV and check it is what was written for those tokens",
    )
    host = parser.add_mutually_exclusive_group()
    host.add_argument(
        "--host-ratio",
        type=float,
        help="add a host tier: a mirror of each device pool (KV, SWA, Mamba states) this many "
        "times its size",
    )
    host.add_argument(
        "--host-bytes",
        type=int,
        help="add a host tier of this many bytes in all, split between the mirrors like the "
        "device pools",
    )
    parser.add_argument(
        "--storage",
        metavar="URL",
        help="add a storage tier: memory://?capacity_bytes=N or file:///abs/dir (needs a host "
        "tier; a host ratio of 2 is used when none is given; exit 2 with the reason where the "
        "hierarchical cache refuses it)",
    )
    parser.add_argument(
        "--write-policy",
        choices=WRITE_POLICY_CHOICES,
        default="write_through",
        help="when device pages are backed up to the host (default write_through)",
    )
    parser.add_argument(
        "--prefetch-policy",
        choices=PREFETCH_POLICY_CHOICES,
        default="wait_complete",
        help="how long a request waits for its storage prefetch (default wait_complete)",
    )
    parser.add_argument(
        "--prefetch-threshold",
        type=int,
        default=256,
        help="tokens beyond the host hit below which no prefetch starts (default 256)",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the summary as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run_replay)


def run_replay(args: argparse.Namespace, *, stdout: TextIO | None = None) -> int:
    """Handler of `kvstrata replay`: 0 on success, 2 for bad options or input, 1 when
    `--verify` finds a hit whose KV is not what was written for its tokens."""
    import torch
    from rich.console import Console

    from kvstrata.build import BuildError, build_memory_system
    from kvstrata.pool_host.errors import HostPoolError
    from kvstrata.replay import (
        KVMismatch,
        ReplayEngine,
        ReplayError,
        WorkloadSpec,
        generate_workload,
        read_trace,
        unbounded_capacity,
    )
    from kvstrata.storage.errors import StorageError

    out = stdout if stdout is not None else sys.stdout
    try:
        if args.threads < 1:
            raise ReplayError(f"--threads must be >= 1, got {args.threads}")
        if args.limit is not None and args.limit < 0:
            raise ReplayError(f"--limit must be >= 0, got {args.limit}")
        torch.set_num_threads(args.threads)
        if args.trace is not None:
            requests = read_trace(
                args.trace, tokens_per_block=args.tokens_per_block, limit=args.limit
            )
            source = str(args.trace)
        else:
            requests = generate_workload(WorkloadSpec(seed=args.seed))[: args.limit]
            source = f"embedded workload (seed {args.seed})"
        unbounded = args.capacity_tokens is None
        if unbounded:
            # Room for everything, in every pool: SWA as large as full, a state slot per chunk.
            room = unbounded_capacity(requests, page_size=args.page_size)
            system = build_memory_system(
                family=args.family,
                capacity_tokens=room.capacity_tokens,
                page_size=args.page_size,
                policy=args.policy,
                device=args.device,
                swa_ratio=1.0,
                mamba_slots=room.mamba_slots,
            )
        else:
            system = build_memory_system(
                family=args.family,
                capacity_tokens=args.capacity_tokens,
                page_size=args.page_size,
                policy=args.policy,
                device=args.device,
            )
        tiers = _build_tiers(args, system)
        engine = ReplayEngine(system, verify=args.verify, tiers=tiers)
        try:
            engine.check_fits(requests)
            started = time.perf_counter()
            stats = _run_with_progress(engine, requests, enabled=_progress_enabled(args))
            wall_seconds = time.perf_counter() - started
        finally:
            if tiers is not None:
                tiers.close()
        if tiers is not None:
            tiers.check_integrity()
        else:
            system.check_integrity()
    except KVMismatch as exc:
        print_error(str(exc), label="verification failed")
        return 1
    except (ReplayError, BuildError, HostPoolError, StorageError, OSError) as exc:
        print_error(str(exc))
        return 2
    record: dict[str, object] = {
        "source": source,
        "family": args.family,
        "policy": args.policy,
        "page_size": args.page_size,
        "tokens_per_block": args.tokens_per_block if args.trace is not None else None,
        "capacity_tokens": system.capacity_tokens,
        "unbounded": unbounded,
        "device": str(system.device),
    }
    if tiers is not None:
        record.update(
            host_tokens=tiers.host_tokens,
            host_state_slots=tiers.host_state_slots,
            host_swa_tokens=tiers.host_swa_tokens,
            storage=args.storage,
            write_policy=args.write_policy,
            prefetch_policy=args.prefetch_policy,
        )
    record.update(stats.to_json())
    record["wall_seconds"] = round(wall_seconds, 3)
    expected = JSON_KEYS if tiers is None else _tiered_keys()
    assert sorted(record) == sorted(expected), f"JSON_KEYS is stale: {tuple(record)}"
    Console(file=out, width=max(80, Console(file=out).width)).print(_summary_table(record, stats))
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            print_error(f"cannot write {args.json}: {exc}")
            return 2
    return 0


def _host_sizes(record: dict[str, object]) -> str:
    """'N tokens' of the host KV mirror, plus the SWA mirror's tokens or the state slots."""
    parts = [f"{record['host_tokens']:,} tokens"]
    if record.get("host_swa_tokens") is not None:
        parts.append(f"{record['host_swa_tokens']:,} SWA tokens")
    if record.get("host_state_slots") is not None:
        parts.append(f"{record['host_state_slots']:,} state slots")
    return " + ".join(parts)


def _tiered_keys() -> tuple[str, ...]:
    return (*JSON_KEYS, *TIER_JSON_KEYS)


def _build_tiers(args: argparse.Namespace, system: MemorySystem) -> TieredSystem | None:
    """The host (and storage) tier the options ask for, or None. Raises BuildError /
    ReplayError for bad combinations before anything is allocated."""
    from kvstrata.build.tiers import build_tiers
    from kvstrata.hybrid_cache import PrefetchPolicy
    from kvstrata.replay import ReplayError
    from kvstrata.unified_radix_cache.errors import InvalidConfig
    from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy

    if args.host_ratio is None and args.host_bytes is None and args.storage is None:
        return None
    try:
        params = TierParams(
            write_policy=WritePolicy(args.write_policy),
            prefetch_policy=PrefetchPolicy(args.prefetch_policy),
            prefetch_threshold=args.prefetch_threshold,
        )
    except InvalidConfig as exc:
        raise ReplayError(str(exc)) from exc
    return build_tiers(
        system,
        host_ratio=args.host_ratio,
        host_bytes=args.host_bytes,
        storage_url=args.storage,
        params=params,
    )


def _progress_enabled(args: argparse.Namespace) -> bool:
    return not args.no_progress and sys.stderr.isatty()


def _run_with_progress(
    engine: ReplayEngine, requests: list[ReplayRequest], *, enabled: bool
) -> ReplayStats:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    if not enabled:
        return engine.run(requests)
    progress = Progress(
        TextColumn("replay"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("hit rate {task.fields[hit]:.2%}"),
        TimeRemainingColumn(),
        console=Console(file=sys.stderr),
        transient=True,
    )
    with progress:
        task = progress.add_task("replay", total=len(requests), hit=0.0)

        def advance(done: int) -> None:
            progress.update(task, completed=done, hit=engine.stats().hit_rate)

        return engine.run(requests, on_progress=advance)


def _summary_table(record: dict[str, object], stats: ReplayStats) -> Table:
    from rich.table import Table

    table = Table(title=f"kvstrata replay: {record['source']}")
    table.add_column("", style="bold")
    table.add_column("value", justify="right")
    capacity = "unbounded" if record["unbounded"] else f"{record['capacity_tokens']:,} tokens"
    rows = [
        ("family / policy", f"{record['family']} / {record['policy']}"),
        ("page size", f"{record['page_size']}"),
        ("capacity", capacity),
        ("requests", f"{stats.requests:,}"),
        ("prompt tokens", f"{stats.prompt_tokens:,}"),
        ("hit tokens", f"{stats.hit_tokens:,}"),
        ("hit rate", f"{stats.hit_rate:.2%}"),
        ("evicted tokens", f"{stats.evicted_tokens:,}"),
        ("cache operations", f"{stats.cache_seconds:.3f} s"),
        ("requests/s (cache operations)", f"{stats.requests_per_s:,.0f}"),
        ("tokens/s (cache operations)", f"{stats.tokens_per_s:,.0f}"),
        ("KV writes (stand-in forward)", f"{stats.kv_write_seconds:.3f} s"),
    ]
    tiers = stats.tiers
    if tiers is not None:
        prompt = max(stats.prompt_tokens, 1)

        def share(tokens: int) -> str:
            return f"{tokens:,} ({tokens / prompt:.2%})"

        rows += [
            ("host tier", f"{_host_sizes(record)}, {record['write_policy']}"),
            ("storage", f"{record['storage'] or '-'} ({record['prefetch_policy']})"),
            (
                "hits: device",
                f"{tiers.device_hit_tokens:,} ({tiers.device_hit_tokens / prompt:.2%})",
            ),
            ("hits: host", f"{tiers.host_hit_tokens:,} ({tiers.host_hit_tokens / prompt:.2%})"),
            (
                "hits: storage",
                f"{tiers.storage_hit_tokens:,} ({tiers.storage_hit_tokens / prompt:.2%})",
            ),
            ("bytes device -> host", f"{tiers.bytes_d2h:,}"),
            ("bytes host -> device", f"{tiers.bytes_h2d:,}"),
            ("bytes storage -> host", f"{tiers.bytes_storage_get:,}"),
            ("bytes host -> storage", f"{tiers.bytes_storage_set:,}"),
            ("waited for transfers", f"{tiers.transfer_wait_seconds:.3f} s"),
            ("failed transfers", f"{tiers.failed_transfers:,}"),
        ]
    for name, value in rows:
        table.add_row(name, value)
    return table
