"""`kvstrata replay --instances N --router ...`: the cluster replay (`kvstrata.replay.cluster`).

`replay_command` registers these options with `add_cluster_arguments` and hands the run to
`run_cluster_replay` when `--instances` is given; everything else about `kvstrata replay` is
unchanged.
"""

from __future__ import annotations

import argparse
import json
from typing import TextIO

from kvstrata.cli.errors import print_error

ROUTER_CHOICES = ("round-robin", "least-loaded", "cache-aware")

#: Default weight of an instance's in-flight load against the pages it would have to prefill.
#: On the shared conversation trace (8 x 5,860 blocks) 1.0 gives 25.8 % at max/mean 1.08, 0.1
#: gives 34.1 % at 1.10: load is counted in in-flight pages, which swing more than the cumulative
#: pages of the routing simulation.
DEFAULT_LOAD_WEIGHT = 0.1


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "cluster replay",
        "N instances behind a router, sharing --storage as their L3 (in one process)",
    )
    group.add_argument(
        "--instances",
        type=int,
        metavar="N",
        help="replay through N engine instances (each with --capacity-tokens of device cache), "
        "routed by --router; --storage is then one L3 shared by all of them",
    )
    group.add_argument(
        "--router", choices=ROUTER_CHOICES, default="cache-aware", help="routing policy"
    )
    group.add_argument(
        "--load-weight",
        type=float,
        default=DEFAULT_LOAD_WEIGHT,
        help=f"cache-aware: weight of in-flight load (default {DEFAULT_LOAD_WEIGHT})",
    )
    group.add_argument(
        "--prefill-tps",
        type=float,
        default=10_000.0,
        help="prefill tokens/s of an instance, for a request's load duration (default 10000)",
    )
    group.add_argument(
        "--decode-tps",
        type=float,
        default=50.0,
        help="decode tokens/s of a request, for its load duration (default 50)",
    )


def _check(args: argparse.Namespace) -> None:
    from kvstrata.replay import ReplayOptionError

    if args.capacity_tokens is None:
        raise ReplayOptionError("--instances needs --capacity-tokens (the device of one instance)")
    refused = {
        "--host-ratio": args.host_ratio is not None,
        "--host-bytes": args.host_bytes is not None,
        "--unbounded": args.unbounded,
        "--verify": args.verify,
        "--metrics-port": args.metrics_port is not None,
        "--family other than mha": args.family != "mha",
        "--policy other than lru": args.policy != "lru",
    }
    given = [name for name, on in refused.items() if on]
    if given:
        raise ReplayOptionError(f"--instances does not support {', '.join(given)}")
    if args.storage is not None and args.storage.startswith("ray://"):
        raise ReplayOptionError("--instances shares an in-process L3: ray:// storage needs --ray")
    if args.plot is not None and args.plot.suffix.lower() != ".png":
        raise ReplayOptionError(
            f"--plot writes a PNG: the file name must end in .png, got {args.plot}"
        )
    if args.limit is not None and args.limit < 0:
        raise ReplayOptionError(f"--limit must be >= 0, got {args.limit}")


def run_cluster_replay(args: argparse.Namespace, out: TextIO) -> int:
    """0 on success, 2 for bad options or input (nothing is replayed)."""
    from rich.console import Console
    from rich.table import Table

    from kvstrata.replay import ReplayError, read_trace

    try:
        from kvstrata.replay.cluster import ClusterSpec, run_cluster
    except ModuleNotFoundError as exc:  # the router lives in the optional kvstrata[ray] extra
        print_error(f"--instances needs kvstrata-prefix-index (pip install 'kvstrata[ray]'): {exc}")
        return 2
    from kvstrata.storage import open_storage
    from kvstrata.storage.errors import StorageError

    try:
        _check(args)
        spec = ClusterSpec(
            num_instances=args.instances,
            capacity_pages=args.capacity_tokens // args.page_size,
            router=args.router,
            page_size=args.page_size,
            prefill_tps=args.prefill_tps,
            decode_tps=args.decode_tps,
            load_weight=args.load_weight,
        )
        if args.trace is not None:
            requests = read_trace(
                args.trace, tokens_per_block=args.tokens_per_block, limit=args.limit
            )
            source = str(args.trace)
        else:
            from kvstrata.replay import WorkloadSpec, generate_workload

            requests = generate_workload(WorkloadSpec(seed=args.seed))[: args.limit]
            source = f"embedded workload (seed {args.seed})"
        l3 = open_storage(args.storage) if args.storage is not None else None
        try:
            report = run_cluster(spec, requests, l3=l3)
        finally:
            close = getattr(l3, "close", None)
            if close is not None:
                close()
        if args.plot is not None:
            from kvstrata.replay.cluster_plot import plot_cluster

            plot_cluster(report, args.plot)
    except (ReplayError, StorageError, OSError) as exc:
        print_error(str(exc))
        return 2
    document = {"source": source, **report.to_json()}
    table = Table(
        title=f"{source}: {spec.num_instances} instances x {spec.capacity_pages} pages, "
        f"router {spec.router}"
        + (f", shared L3 of {report.l3_capacity_pages} pages" if l3 is not None else "")
    )
    for col in ("instance", "requests", "load share", "device hits", "L3 hits", "hit rate"):
        table.add_column(col, justify="left" if col == "instance" else "right")
    for row in document["per_instance"]:  # type: ignore[union-attr]
        table.add_row(
            row["name"],
            str(row["requests"]),
            f"{100 * row['load_share']:.2f} %",
            str(row["device_hit_pages"]),
            str(row["l3_hit_pages"]),
            f"{100 * row['hit_rate']:.2f} %",
        )
    table.add_row(
        "cluster",
        str(report.requests),
        f"max/mean {report.max_load_ratio:.3f}",
        str(document["device_hit_pages"]),
        str(document["l3_hit_pages"]),
        f"{100 * report.hit_rate:.2f} %",
        end_section=True,
    )
    table.add_row(
        "pooled ideal", "", "", str(report.pooled_hits), "", f"{100 * report.pooled_hit_rate:.2f} %"
    )
    Console(file=out, width=max(80, Console(file=out).width)).print(table)
    if args.json is not None:
        try:
            args.json.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
        except OSError as exc:
            print_error(f"cannot write {args.json}: {exc}")
            return 2
    return 0
