"""`kvstrata services up|status|down`: the L3 store and prefix index actors on a Ray cluster.

One L3 store actor and one prefix index shard actor per alive Ray node; see
services/l3-store/README.md and services/prefix-index/README.md. Needs kvstrata[ray] (the
kvstrata-l3-store and kvstrata-prefix-index distributions); without them the command says so and
exits 2. Every subcommand joins the cluster at --address (default "auto") as a driver. `up` is
idempotent: every node may run it after joining (the Ray files in ops/ do), and it creates only
what is missing.
"""

from __future__ import annotations

import argparse
import sys
import time
from types import MappingProxyType
from typing import TYPE_CHECKING

from kvstrata.storage.errors import StorageError
from kvstrata.storage.registry import StorageURL

if TYPE_CHECKING:
    from kvstrata.l3_store.deploy import StoreStatus

NAME = "services"
HELP = "run the L3 store and prefix index actors on a Ray cluster (needs kvstrata[ray])"


def _size(text: str) -> int:
    """A byte size as storage URLs write them (64GiB, 512MiB, 1_000_000)."""
    url = StorageURL(url=text, scheme="", host="", path="", params=MappingProxyType({"n": text}))
    try:
        return url.size_param("n")
    except StorageError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte size (e.g. 64GiB)") from exc


def add_arguments(services: argparse.ArgumentParser) -> None:
    """The actions of `kvstrata services` and their options."""
    actions = services.add_subparsers(dest="action", required=True, metavar="ACTION")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", default="auto", help="Ray cluster address (default auto)")
    common.add_argument("--namespace", default="kvstrata", help="Ray namespace of the stores")
    common.add_argument("--arena-dir", default="/dev/shm", help="where arena files live")
    up = actions.add_parser("up", parents=[common], help="create the missing stores, reconcile")
    up.add_argument("--store-bytes", type=_size, default=_size("64GiB"), help="memory per node")
    up.add_argument("--disk", default=None, help="spill directory on every node (optional)")
    up.add_argument("--disk-bytes", type=_size, default=0, help="disk budget per node")
    up.add_argument("--reconcile-s", type=float, default=5.0, help="reconciliation period")
    up.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus port per store (0: any free)"
    )
    up.add_argument(
        "--metrics-addr", default="127.0.0.1", help="address the metrics endpoints bind"
    )
    up.add_argument(
        "--index-page-size", type=int, default=16, help="prefix index page size (0: no index)"
    )
    up.add_argument(
        "--index-metrics-port",
        type=int,
        default=0,
        help="Prometheus port per index shard (0: any free)",
    )
    status = actions.add_parser("status", parents=[common], help="one row per node")
    status.add_argument(
        "--interval", type=float, default=1.0, help="seconds between the two samples of ops/s"
    )
    actions.add_parser("down", parents=[common], help="remove every store and its files")
    services.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        from kvstrata.l3_store import deploy
        from kvstrata.l3_store.actor import StoreConfig
        from kvstrata.l3_store.core import StoreParams
        from kvstrata.prefix_index import cluster
        from kvstrata.prefix_index.errors import PrefixIndexError
    except ImportError:
        print(
            "kvstrata services needs the l3 store and the prefix index: "
            "pip install 'kvstrata[ray]'",
            file=sys.stderr,
        )
        return 2
    if args.action == "up":
        problem = _check_up(args)
        if problem:
            print(f"kvstrata services up: {problem}", file=sys.stderr)
            return 2
    deploy.connect(args.address)
    if args.action == "up":
        config = StoreConfig(
            namespace=args.namespace,
            params=StoreParams(memory_bytes=args.store_bytes),
            arena_dir=args.arena_dir,
            disk_dir=args.disk,
            disk_bytes=args.disk_bytes,
            metrics_addr=args.metrics_addr,
            metrics_port=args.metrics_port,
        )
        done = deploy.up(config, reconcile_s=args.reconcile_s)
        print(f"created {len(done.created)} store(s); {len(done.failed)} failed to start")
        for node_id in done.failed:
            print(f"  no store on {node_id}", file=sys.stderr)
        if args.index_page_size:
            try:
                shards = cluster.deploy_shards(
                    args.index_page_size,
                    metrics_port=args.index_metrics_port,
                    metrics_addr=args.metrics_addr,
                )
            except PrefixIndexError as exc:
                print(f"kvstrata services up: {exc}", file=sys.stderr)
                return 2
            print(f"prefix index: {len(shards)} shard(s)")
        return 1 if done.failed else 0
    if args.action == "status":
        before = deploy.status(args.namespace)
        time.sleep(args.interval)
        after = deploy.status(args.namespace)
        print(_table(before, after, args.interval))
        return 0
    gone = deploy.down(args.namespace, arena_dir=args.arena_dir)
    shards = cluster.remove_shards()
    print(f"removed {gone} store(s) and {shards} prefix index shard(s)")
    return 0


def _check_up(args: argparse.Namespace) -> str:
    """What is wrong with `up`'s arguments ("" when nothing), checked before Ray is touched."""
    if args.index_page_size < 0:
        return f"--index-page-size must be >= 0, got {args.index_page_size}"
    for flag in ("metrics_port", "index_metrics_port"):
        port = getattr(args, flag)
        if not 0 <= port <= 65535:
            return f"--{flag.replace('_', '-')} must be in 0..65535, got {port}"
    return ""


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}"


def _table(before: list[StoreStatus], after: list[StoreStatus], interval: float) -> str:
    head = ("node", "mem GiB", "mem cap", "disk GiB", "pages", "hit rate", "ops/s")
    rows: list[tuple[str, ...]] = [head]
    earlier = {r.node_id: r.stats for r in before}
    for row in after:
        s = row.stats
        if s is None:
            rows.append((row.node_id[:12], "down", "", "", "", "", ""))
            continue
        hits = s.hits_memory + s.hits_disk
        asked = hits + s.misses
        prev = earlier.get(row.node_id)
        ops = (s.operations - prev.operations) / interval if prev is not None else 0.0
        rows.append(
            (
                row.node_id[:12],
                _gib(s.memory_used_bytes),
                _gib(s.memory_capacity_bytes),
                _gib(s.disk_used_bytes),
                str(s.memory_pages + s.disk_pages),
                f"{hits / asked:.1%}" if asked else "-",
                f"{ops:.1f}",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)
