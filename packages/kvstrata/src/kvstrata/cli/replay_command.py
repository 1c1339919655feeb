"""`kvstrata replay`: replay a request trace (or the embedded workload) through the memory system.

Drives requests through the real allocator, pools and radix tree as an engine would (match,
lock, allocate, write KV, insert, release) and reports the hit rate and the speed of the cache
operations. Without --trace it runs the embedded workload (shared system prompts and multi-turn
conversations). Without a capacity, tier, --unbounded or --model option it compares the default
configurations side by side. Shows a progress bar on stderr and prints a summary table; --json
FILE writes the same figures as one JSON object.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, TextIO

from kvstrata.cli.errors import print_error
from kvstrata.cli.json_output import write_json
from kvstrata.cli.options import (
    add_output_options,
    add_trace_option,
    check_plot_path,
    load_requests,
    tier_config,
)
from kvstrata.cli.replay_cluster import add_cluster_arguments, run_cluster_replay
from kvstrata.cli.replay_model import (
    add_model_arguments,
    check_model_options,
    model_build,
    run_reference_replay,
)

# Only argparse is imported at module level: `kvstrata version` and `kvstrata --help` build this
# parser too, and should not pay for importing torch. The family and policy choices are
# therefore spelled out here; a test checks them against `kvstrata.build.FAMILIES` and
# `POLICIES`.
if TYPE_CHECKING:
    from collections.abc import Callable

    from prometheus_client import CollectorRegistry
    from rich.table import Table

    from kvstrata.replay import ReplayEngine, ReplayRequest, ReplayStats
    from kvstrata.replay.compare import ConfigRun, TierConfig
    from kvstrata.replay.exporter import MetricsServer
    from kvstrata.replay.model import ModelBuild

NAME = "replay"
HELP = "replay a request trace (or the embedded workload) through the memory system"

FAMILY_CHOICES: tuple[str, ...] = ("mha", "swa", "mamba")
POLICY_CHOICES: tuple[str, ...] = ("lru", "lfu", "fifo", "mru", "filo", "priority")

#: Keys of the `--json` record, in order (the summary table shows the same figures).
JSON_KEYS: tuple[str, ...] = (
    "source",
    "model",
    "device_memory",
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of `kvstrata replay` (with those of `--model` and `--instances`)."""
    add_trace_option(parser, absent="the embedded workload")
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
    parser.add_argument(
        "--family", choices=FAMILY_CHOICES, help="toy model family (default mha; not with --model)"
    )
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
    parser.add_argument(
        "--unbounded",
        action="store_true",
        help="one run on a device with room for every prompt (no eviction, no tiers)",
    )
    add_output_options(
        parser,
        json_help="also write the summary as JSON",
        plot_help="draw hit rate and capacity use per tier over the requests (one line per "
        "configuration) into a PNG",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        metavar="N",
        help="serve every layer's Prometheus metrics on http://ADDR:N/metrics while the replay "
        "runs (0: a free port, printed on stderr)",
    )
    parser.add_argument(
        "--metrics-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="address the metrics endpoint listens on (default 127.0.0.1, loopback only)",
    )
    parser.add_argument(
        "--metrics-hold",
        type=float,
        default=0.0,
        metavar="S",
        help="keep serving the metrics S seconds after the replay ends (default 0)",
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_cluster_arguments(parser)
    add_model_arguments(parser)
    parser.set_defaults(handler=run_replay)


def run_replay(args: argparse.Namespace, *, stdout: TextIO | None = None) -> int:
    """Handler of `kvstrata replay`: 0 on success, 2 for bad options or input, 1 when
    `--verify` finds a hit whose KV is not what was written for its tokens."""
    import torch
    from rich.console import Console

    from kvstrata.build import BuildError
    from kvstrata.pool_host.errors import HostPoolError
    from kvstrata.replay import KVMismatch, ReplayError
    from kvstrata.storage.errors import StorageError

    out = stdout if stdout is not None else sys.stdout
    if args.model is None and args.family is None:
        args.family = "mha"  # None only tells an explicit --family apart for --model
    if args.instances is not None:
        if args.model is not None:
            print_error("--instances replays toy device-only trees: it takes no --model")
            return 2
        return run_cluster_replay(args, out)
    err = Console(file=sys.stderr)
    server: MetricsServer | None = None
    try:
        _check_options(args)
        if args.engine == "reference":
            return run_reference_replay(args, out)
        torch.set_num_threads(args.threads)
        requests, source = load_requests(args)
        model = None if args.model is None else model_build(args, requests)
        configs = _configs(args, requests)
        registry = None
        if args.metrics_port is not None:
            from prometheus_client import CollectorRegistry

            from kvstrata.replay.exporter import MetricsServer

            registry = CollectorRegistry()
            server = MetricsServer(registry, port=args.metrics_port, addr=args.metrics_addr)
            err.print(f"serving metrics on {server.url}", highlight=False)
        runs = [
            _run_with_progress(args, config, requests, registry=registry, model=model)
            for config in configs
        ]
        if args.plot is not None:
            from kvstrata.replay.plot import plot_runs

            plot_runs(runs, args.plot)
    except KVMismatch as exc:
        print_error(str(exc), label="verification failed")
        _close(server, hold=0.0)
        return 1
    except (ReplayError, BuildError, HostPoolError, StorageError, OSError) as exc:
        print_error(str(exc))
        _close(server, hold=0.0)
        return 2
    records = [_record(args, run, source) for run in runs]
    console = Console(file=out, width=max(80, Console(file=out).width))
    if _comparing(args):
        console.print(_comparison_table(source, runs))
        document: object = {
            "configurations": [
                {"configuration": r.config.name, **rec}
                for r, rec in zip(runs, records, strict=True)
            ]
        }
    else:
        console.print(_summary_table(records[0], runs[0].stats))
        document = records[0]
    status = 0 if write_json(args.json, document) else 2
    if args.plot is not None:
        err.print(f"plot written to {args.plot}", highlight=False)
    _close(server, hold=args.metrics_hold)
    return status


def _check_options(args: argparse.Namespace) -> None:
    """Every option checked before anything is built or served (ReplayError)."""
    from kvstrata.replay import ReplayError

    check_model_options(args)
    if args.threads < 1:
        raise ReplayError(f"--threads must be >= 1, got {args.threads}")
    if args.limit is not None and args.limit < 0:
        raise ReplayError(f"--limit must be >= 0, got {args.limit}")
    if args.metrics_hold < 0:
        raise ReplayError(f"--metrics-hold must be >= 0 seconds, got {args.metrics_hold}")
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        raise ReplayError(f"--metrics-port must be in 0..65535, got {args.metrics_port}")
    if args.metrics_hold > 0 and args.metrics_port is None:
        raise ReplayError("--metrics-hold needs --metrics-port")
    check_plot_path(args.plot, ReplayError)
    if args.unbounded and (_tier_options(args) or args.capacity_tokens is not None):
        raise ReplayError("--unbounded takes no --capacity-tokens, host or storage option")


def _tier_options(args: argparse.Namespace) -> bool:
    return args.host_ratio is not None or args.host_bytes is not None or args.storage is not None


def _comparing(args: argparse.Namespace) -> bool:
    """The default: no capacity, tier, --unbounded or --model option given."""
    return not (
        args.unbounded
        or args.capacity_tokens is not None
        or _tier_options(args)
        or args.model is not None
    )


def _configs(args: argparse.Namespace, requests: list[ReplayRequest]) -> list[TierConfig]:
    from kvstrata.replay.compare import default_configs

    if _comparing(args):
        return default_configs(requests, page_size=args.page_size)
    tiers = "device"
    if _tier_options(args):
        tiers += "+host" + ("+storage" if args.storage is not None else "")
    return [tier_config(args, name=tiers, capacity_tokens=args.capacity_tokens)]


def _close(server: MetricsServer | None, *, hold: float) -> None:
    if server is None:
        return
    if hold > 0:
        print(f"holding {server.url} for {hold:g} s", file=sys.stderr)
        time.sleep(hold)
    server.close()


def _record(args: argparse.Namespace, run: ConfigRun, source: str) -> dict[str, object]:
    """The `--json` record of one configuration (JSON_KEYS, plus TIER_JSON_KEYS with tiers)."""
    config = run.config
    record: dict[str, object] = {
        "source": source,
        "model": run.model,
        "device_memory": args.device_memory,
        "family": run.family,
        "policy": args.policy,
        "page_size": run.page_size,
        "tokens_per_block": args.tokens_per_block if args.trace is not None else None,
        "capacity_tokens": run.capacity_tokens,
        "unbounded": config.capacity_tokens is None and run.model is None,
        "device": run.device,
    }
    if config.tiered:
        record.update(
            host_tokens=run.host_tokens,
            host_state_slots=run.host_state_slots,
            host_swa_tokens=run.host_swa_tokens,
            storage=config.storage_url,
            write_policy=config.write_policy,
            prefetch_policy=config.prefetch_policy,
        )
    record.update(run.stats.to_json())
    record["wall_seconds"] = round(run.wall_seconds, 3)
    expected = _tiered_keys() if config.tiered else JSON_KEYS
    assert sorted(record) == sorted(expected), f"JSON_KEYS is stale: {tuple(record)}"
    return record


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


def _progress_enabled(args: argparse.Namespace) -> bool:
    return not args.no_progress and sys.stderr.isatty()


def _run_with_progress(
    args: argparse.Namespace,
    config: TierConfig,
    requests: list[ReplayRequest],
    *,
    registry: CollectorRegistry | None,
    model: ModelBuild | None = None,
) -> ConfigRun:
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from kvstrata.replay.compare import run_configuration

    options = {
        "sample_every": max(len(requests) // 40, 1),
        "family": args.family,
        "policy": args.policy,
        "page_size": args.page_size,
        "device": args.device,
        "verify": args.verify,
        "registry": registry,
        "model": model,
    }
    if not _progress_enabled(args):
        return run_configuration(config, requests, **options)
    progress = Progress(
        TextColumn(f"replay {config.name}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("hit rate {task.fields[hit]:.2%}"),
        TimeRemainingColumn(),
        console=Console(file=sys.stderr),
        transient=True,
    )
    with progress:
        task = progress.add_task("replay", total=len(requests), hit=0.0)

        def advance(done: int, engine: ReplayEngine) -> None:
            progress.update(task, completed=done, hit=engine.stats().hit_rate)

        return run_configuration(config, requests, on_progress=advance, **options)


def _comparison_table(source: str, runs: list[ConfigRun]) -> Table:
    """One column per configuration: hits per tier, tokens saved, bytes moved, time."""
    from rich.table import Table

    first = runs[0]
    table = Table(
        title=f"kvstrata replay: {source}, device {first.capacity_tokens:,} tokens "
        f"({first.stats.requests:,} requests, {first.stats.prompt_tokens:,} prompt tokens)"
    )
    table.add_column("", style="bold")
    for run in runs:
        table.add_column(run.config.name, justify="right")
    base_hits = first.stats.hit_tokens

    def row(name: str, cell: Callable[[ConfigRun], str]) -> None:
        table.add_row(name, *(cell(run) for run in runs))

    def pct(tokens: int, run: ConfigRun) -> str:
        return f"{tokens / max(run.stats.prompt_tokens, 1):.2%}"

    def tier_hits(run: ConfigRun, tier: str) -> str:
        if tier not in run.config.tiers:
            return "-"
        t = run.stats.tiers
        tokens = run.stats.hit_tokens if t is None else getattr(t, f"{tier}_hit_tokens")
        return pct(tokens, run)

    def moved(run: ConfigRun, *fields: str) -> str:
        t = run.stats.tiers
        return "-" if t is None else _bytes(sum(getattr(t, f) for f in fields))

    row("host tier", lambda r: "-" if r.host_tokens is None else f"{r.host_tokens:,} tokens")
    row("storage", lambda r: (r.config.storage_url or "-").split("?")[0])
    for tier in ("device", "host", "storage"):
        row(f"hit rate: {tier}", lambda r, tier=tier: tier_hits(r, tier))
    row("hit rate: all tiers", lambda r: pct(r.stats.hit_tokens, r))
    row("tokens not recomputed", lambda r: f"{r.stats.hit_tokens:,}")
    row(
        "recompute saved vs device",
        lambda r: f"{r.stats.hit_tokens - base_hits:+,}",
    )
    row("evicted from device", lambda r: f"{r.stats.evicted_tokens:,}")
    row("bytes device <-> host", lambda r: moved(r, "bytes_d2h", "bytes_h2d"))
    row("bytes host <-> storage", lambda r: moved(r, "bytes_storage_get", "bytes_storage_set"))
    row("cache operations", lambda r: f"{r.stats.cache_seconds:.3f} s")
    row(
        "waited for transfers",
        lambda r: "-" if r.stats.tiers is None else f"{r.stats.tiers.transfer_wait_seconds:.3f} s",
    )
    return table


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024  # pyright: ignore[reportAssignmentType]
    raise AssertionError("unreachable")


def _summary_table(record: dict[str, object], stats: ReplayStats) -> Table:
    from rich.table import Table

    table = Table(title=f"kvstrata replay: {record['source']}")
    table.add_column("", style="bold")
    table.add_column("value", justify="right")
    capacity = "unbounded" if record["unbounded"] else f"{record['capacity_tokens']:,} tokens"
    rows = [
        ("family / policy", f"{record['family']} / {record['policy']}"),
        *(
            [("model / device memory", f"{record['model']} / {record['device_memory']}")]
            if record["model"] is not None
            else []
        ),
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
