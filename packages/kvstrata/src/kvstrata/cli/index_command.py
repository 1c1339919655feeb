"""`kvstrata index subscribe`: feed a prefix index from an engine's ZMQ KV-event stream.

The index (kvstrata.prefix_index) runs in this process; the command prints one JSON line of
counters every --report-every seconds and at exit (the batches applied, gaps, replays, resyncs,
entries).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict

NAME = "index"
HELP = "the cluster prefix index (kvstrata.prefix_index)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `subscribe` action of `kvstrata index` and its options."""
    actions = parser.add_subparsers(dest="index_command", required=True, metavar="ACTION")
    subscribe = actions.add_parser(
        "subscribe",
        help="subscribe to a vLLM or SGLang KV-event stream (ZMQ PUB) and index it",
        description=(
            "Connect a SUB socket to the engine's event endpoint; on a sequence gap, ask the "
            "replay endpoint (ROUTER) for the missing batches, and when they are gone drop "
            "the instance's entries and resync."
        ),
    )
    subscribe.add_argument("--endpoint", required=True, help="engine PUB, e.g. tcp://host:5557")
    subscribe.add_argument("--instance", required=True, help="name of the engine instance")
    subscribe.add_argument("--format", choices=["vllm", "sglang"], default="vllm")
    subscribe.add_argument("--replay-endpoint", help="engine replay ROUTER, e.g. tcp://host:5558")
    subscribe.add_argument("--topic", default="", help="topic prefix to subscribe to")
    subscribe.add_argument("--page-size", type=int, default=16, help="index page size (tokens)")
    subscribe.add_argument("--max-entries", type=int, default=0, help="entry bound (0 = none)")
    subscribe.add_argument("--max-batches", type=int, default=0, help="stop after N (0 = never)")
    subscribe.add_argument("--duration", type=float, default=0.0, help="stop after S s (0 = never)")
    subscribe.add_argument("--report-every", type=float, default=10.0, help="seconds")
    subscribe.set_defaults(handler=_subscribe)


def _subscribe(args: argparse.Namespace) -> int:
    from kvstrata.prefix_index import PrefixIndex, PrefixIndexError
    from kvstrata.prefix_index.subscriber import Subscriber

    try:
        index = PrefixIndex(args.page_size, max_entries=args.max_entries or None)
        subscriber = Subscriber(
            index,
            endpoint=args.endpoint,
            instance=args.instance,
            format=args.format,
            replay_endpoint=args.replay_endpoint,
            topic=args.topic.encode(),
        )
    except PrefixIndexError as exc:
        print(f"kvstrata index subscribe: {exc}", file=sys.stderr)
        return 2
    start = last = time.monotonic()
    try:
        while True:
            subscriber.poll(100)
            now = time.monotonic()
            done = (args.max_batches and subscriber.stats.batches >= args.max_batches) or (
                args.duration and now - start >= args.duration
            )
            if done or now - last >= args.report_every:
                last = now
                print(json.dumps({**asdict(subscriber.stats), "entries": len(index)}), flush=True)
            if done:
                return 0
    except KeyboardInterrupt:
        print(json.dumps({**asdict(subscriber.stats), "entries": len(index)}), flush=True)
        return 0
    finally:
        subscriber.close()
