"""Entry point of the `kvstrata` command.

Each subcommand lives in its own module, which names it (`NAME`), gives its one-line `HELP`, is
its description (the module docstring, shown by `kvstrata NAME --help`) and declares its options
and handler (`add_arguments`); this module only registers them all the same way and dispatches,
so adding a command never touches the others.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from importlib import metadata

from kvstrata.cli import (
    index_command,
    plan_command,
    replay_command,
    services_command,
    size_command,
)

#: Distributions of the workspace, in layer order (bottom first), as `kvstrata version` lists them.
DISTRIBUTIONS: tuple[str, ...] = (
    "kvstrata-core",
    "kvstrata-pool",
    "kvstrata-storage",
    "kvstrata-allocator",
    "kvstrata-pool-host",
    "kvstrata-hybrid-cache",
    "kvstrata-unified-radix-cache",
    "kvstrata-l3-store",
    "kvstrata-prefix-index",
    "kvstrata",
)

Handler = Callable[[argparse.Namespace], int]

#: The command modules, in the order `kvstrata --help` lists them (after version and bench).
COMMANDS = (replay_command, plan_command, size_command, services_command, index_command)


def _version(_args: argparse.Namespace) -> int:
    for dist in DISTRIBUTIONS:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = "not installed"
        print(f"{dist} {version}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from kvstrata import bench

    try:
        run = bench.load(args.name)
    except KeyError as exc:
        print(exc.args[0], file=sys.stderr)
        return 2
    return run(list(args.options))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvstrata",
        description="KV-cache memory system: replay request traces and run benchmarks.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    version = sub.add_parser("version", help="print the version of every kvstrata distribution")
    version.set_defaults(handler=_version)
    bench = sub.add_parser(
        "bench",
        help="run a benchmark; prints JSON lines with ratios against a same-run baseline",
        description="Run `kvstrata bench NAME --help` for the options of one benchmark.",
    )
    bench.add_argument("name", help="benchmark name (alloc, radix, l2, l3, ...)")
    bench.add_argument("options", nargs=argparse.REMAINDER, help="options of that benchmark")
    bench.set_defaults(handler=_bench)
    for command in COMMANDS:
        command.add_arguments(
            sub.add_parser(
                command.NAME,
                help=command.HELP,
                description=command.__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler = args.handler
    return handler(args)


if __name__ == "__main__":
    sys.exit(main())
