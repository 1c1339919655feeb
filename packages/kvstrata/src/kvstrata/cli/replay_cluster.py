"""`kvstrata replay --instances N --router ...`: the cluster replay (`kvstrata.replay.cluster`).

`replay_command` registers these options with `add_cluster_arguments` and hands the run to
`run_cluster_replay` when `--instances` is given; everything else about `kvstrata replay` is
unchanged.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, TextIO

from kvstrata.cli.errors import print_error
from kvstrata.cli.json_output import write_json
from kvstrata.cli.options import check_plot_path, load_requests

if TYPE_CHECKING:
    from kvstrata.replay import ReplayRequest
    from kvstrata.replay.cluster import ClusterReport, ClusterSpec

ROUTER_CHOICES = ("round-robin", "least-loaded", "cache-aware")

#: Default weight of an instance's in-flight load against the pages it would have to prefill.
#: On the shared conversation trace (8 x 5,860 blocks) 1.0 gives 25.8 % at max/mean 1.08, 0.1
#: gives 34.1 % at 1.10: load is counted in in-flight pages, which swing more than the cumulative
#: pages of the routing simulation.
DEFAULT_LOAD_WEIGHT = 0.1


def add_cluster_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "cluster replay",
        "N replay engines behind a router, sharing --storage as their L3: in one process, or "
        "as Ray actors with --ray",
    )
    group.add_argument(
        "--instances",
        type=int,
        metavar="N",
        help="replay through N engine instances (each with --capacity-tokens of device cache "
        "and, with --host-ratio/--host-bytes, its own host tier), routed by --router; --storage "
        "is then one L3 shared by all of them",
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
    group.add_argument(
        "--ray",
        action="store_true",
        help="every instance a Ray actor; the L3 stores (--storage ray://...) and the prefix "
        "index shards of the cluster; a loopback cluster for the run unless --address is given "
        "(needs kvstrata[ray])",
    )
    group.add_argument(
        "--address", metavar="ADDR", help="--ray: join the Ray cluster at ADDR (e.g. auto)"
    )
    group.add_argument(
        "--l3-bytes",
        type=int,
        metavar="N",
        help="--ray with ray:// storage: bring up L3 stores of N bytes each when none is up "
        "(taken down again at the end)",
    )


def _check(args: argparse.Namespace) -> None:
    from kvstrata.replay import ReplayOptionError

    if args.capacity_tokens is None:
        raise ReplayOptionError("--instances needs --capacity-tokens (the device of one instance)")
    refused = {
        "--unbounded": args.unbounded,
        "--verify": args.verify,
        "--metrics-port": args.metrics_port is not None,
        "--family other than mha": args.family != "mha",
    }
    given = [name for name, on in refused.items() if on]
    if given:
        raise ReplayOptionError(f"--instances does not support {', '.join(given)}")
    ray_storage = args.storage is not None and args.storage.startswith("ray://")
    if ray_storage and not args.ray:
        raise ReplayOptionError("--instances shares an in-process L3: ray:// storage needs --ray")
    if args.ray and args.storage is not None and not ray_storage:
        raise ReplayOptionError(
            f"--ray shares the L3 stores of the Ray cluster: give --storage ray://..., "
            f"not {args.storage}"
        )
    if args.address is not None and not args.ray:
        raise ReplayOptionError("--address needs --ray")
    if args.l3_bytes is not None and not ray_storage:
        raise ReplayOptionError("--l3-bytes sizes the ray:// stores: it needs --storage ray://")
    if args.l3_bytes is not None and args.l3_bytes <= 0:
        raise ReplayOptionError(f"--l3-bytes must be > 0, got {args.l3_bytes}")
    check_plot_path(args.plot, ReplayOptionError)
    if args.limit is not None and args.limit < 0:
        raise ReplayOptionError(f"--limit must be >= 0, got {args.limit}")


def run_cluster_replay(args: argparse.Namespace, out: TextIO) -> int:
    """0 on success, 2 for bad options or input (nothing is replayed)."""
    from rich.console import Console
    from rich.table import Table

    from kvstrata.replay import ReplayError

    try:
        from kvstrata.replay.cluster import ClusterSpec, run_cluster
    except ModuleNotFoundError as exc:  # the router lives in the optional kvstrata[ray] extra
        print_error(f"--instances needs kvstrata-prefix-index (pip install 'kvstrata[ray]'): {exc}")
        return 2
    from kvstrata.build import BuildError
    from kvstrata.pool_host.errors import HostPoolError
    from kvstrata.storage import open_storage
    from kvstrata.storage.errors import StorageError

    l3 = None
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
            policy=args.policy,
            host_ratio=args.host_ratio,
            host_bytes=args.host_bytes,
            write_policy=args.write_policy,
            prefetch_policy=args.prefetch_policy,
            prefetch_threshold=args.prefetch_threshold,
        )
        requests, source = load_requests(args)
        if args.ray:
            report = _run_on_ray(args, spec, requests)
        else:
            l3 = open_storage(args.storage) if args.storage is not None else None
            report = run_cluster(spec, requests, l3=l3)
        if args.plot is not None:
            from kvstrata.replay.cluster_plot import plot_cluster

            plot_cluster(report, args.plot)
    except (ReplayError, BuildError, HostPoolError, StorageError, OSError) as exc:
        print_error(str(exc))
        return 2
    finally:
        close = getattr(l3, "close", None)
        if close is not None:
            close()
    document = {"source": source, **report.to_json()}
    where = "Ray actors" if args.ray else "in one process"
    table = Table(
        title=f"{source}: {spec.num_instances} instances x {spec.capacity_pages} pages "
        f"({where}), router {spec.router}"
        + (f", shared L3 of {report.l3_capacity_pages} pages" if args.storage else "")
    )
    columns = ("instance", "requests", "load share", "device hits", "host hits", "L3 hits")
    for col in (*columns, "hit rate"):
        table.add_column(col, justify="left" if col == "instance" else "right")
    for row in document["per_instance"]:
        table.add_row(
            row["name"],
            str(row["requests"]),
            f"{100 * row['load_share']:.2f} %",
            str(row["device_hit_pages"]),
            str(row["host_hit_pages"]),
            str(row["l3_hit_pages"]),
            f"{100 * row['hit_rate']:.2f} %",
        )
    table.add_row(
        "cluster",
        str(report.requests),
        f"max/mean {report.max_load_ratio:.3f}",
        str(document["device_hit_pages"]),
        str(document["host_hit_pages"]),
        str(document["l3_hit_pages"]),
        f"{100 * report.hit_rate:.2f} %",
        end_section=True,
    )
    table.add_row(
        "pooled ideal",
        "",
        "",
        str(report.pooled_hits),
        "",
        "",
        f"{100 * report.pooled_hit_rate:.2f} %",
    )
    Console(file=out, width=max(110, Console(file=out).width)).print(table)
    return 0 if write_json(args.json, document) else 2


def _run_on_ray(
    args: argparse.Namespace, spec: ClusterSpec, requests: list[ReplayRequest]
) -> ClusterReport:
    """The cluster on Ray (`kvstrata.replay_ray`): started, run, and taken down here."""
    from kvstrata.replay import ReplayOptionError
    from kvstrata.replay.cluster import check_prompts, run_cluster

    check_prompts(spec, requests)  # before Ray starts
    try:
        from kvstrata.replay_ray import RayCluster
    except ModuleNotFoundError as exc:
        raise ReplayOptionError(
            f"--ray needs kvstrata-replay-ray (pip install 'kvstrata[ray]'): {exc}"
        ) from exc
    cluster = RayCluster(
        spec, address=args.address, storage_url=args.storage, l3_bytes=args.l3_bytes
    )
    try:
        return run_cluster(spec, requests, backend=cluster)
    finally:
        cluster.close()
