"""`kvstrata bench l2`: host-tier copy throughput against a plain torch copy of the same bytes.

For each layout and page size it measures, in one run:

    backup       all layers of N device pages -> N host pages    vs  one copy_ of as many bytes
    load_layers  every layer in turn, N host pages -> N device   vs  one copy_ per layer of
                 pages (one `load` call per layer)                    as many bytes

and prints one JSON line per figure with the baseline and the ratio (ours / baseline; the
target for page_first with pages of 64 KiB or more is >= 0.7). Device pages come either in one
run (`contiguous`) or shuffled (`scattered`); host pages come from a HostSlotAllocator, as in
production (ascending, hence contiguous). Without CUDA the "device" pool lives in CPU memory
and the lines say `"device": "cpu"`: the figures then compare memory-to-memory copies.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch

from kvstrata.bench.report import PairedTimes, emit, environment, paired_medians, pin_threads, ratio
from kvstrata.pool import MHAKVPool, MHASpec
from kvstrata.pool_host import HostLayout, HostPool, MHAHostPool

TARGET_RATIO = 0.7


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvstrata bench l2",
        description="Host-tier backup / layer-load GB/s per layout against a plain torch copy.",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[16, 64])
    parser.add_argument(
        "--layouts",
        nargs="+",
        default=[layout.value for layout in HostLayout],
        choices=[layout.value for layout in HostLayout],
    )
    parser.add_argument(
        "--patterns",
        nargs="+",
        default=["contiguous", "scattered"],
        choices=["contiguous", "scattered"],
    )
    parser.add_argument("--mib", type=int, default=128, help="bytes per backup, in MiB")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="small sizes, 3 repeats (smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.mib, args.repeats, args.page_sizes = 16, 3, args.page_sizes[:1]
    return args


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _plain_copy(
    num_bytes: int, device: torch.device, *, d2h: bool, pinned: bool, num_chunks: int = 1
) -> Callable[[], None]:
    """Plain copy_ of num_bytes between a contiguous device tensor and a contiguous host
    tensor (pinned when the host pool is), as `num_chunks` equal copies (one per layer for a
    layer-wise load), synchronised like ours."""
    dev = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    host = torch.empty(num_bytes, dtype=torch.uint8, pin_memory=pinned).fill_(2)
    src, dst = (dev, host) if d2h else (host, dev)
    pairs = list(zip(src.chunk(num_chunks), dst.chunk(num_chunks), strict=True))

    def run() -> None:
        for s, d in pairs:
            d.copy_(s, non_blocking=pinned)
        _sync(device)

    return run


def _page_ids(num_pages: int, pattern: str, *, generator: torch.Generator) -> torch.Tensor:
    ids = torch.arange(1, num_pages + 1, dtype=torch.int64)
    if pattern == "scattered":
        ids = ids[torch.randperm(num_pages, generator=generator)]
    return ids


def _tokens(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    return (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)


def _measure(
    host: HostPool[MHAKVPool],
    dev_pool: MHAKVPool,
    *,
    num_pages: int,
    pattern: str,
    args: argparse.Namespace,
) -> None:
    device = torch.device(args.device)
    page_size = dev_pool.page_size
    allocator = host.make_allocator()
    host_pages = allocator.alloc_pages(num_pages)
    assert host_pages is not None, "the host pool was sized to hold every page"
    order = _page_ids(num_pages, pattern, generator=torch.Generator().manual_seed(0))
    dev_tokens = _tokens(order, page_size).to(device)
    host_tokens = _tokens(host_pages, page_size)
    pinned = host.allocator.pinned
    common = {
        "bench": "l2",
        "family": host.family,
        "layout": str(host.layout),
        "page_size": page_size,
        "page_bytes": host.page_size_bytes,
        "pattern": pattern,
        "num_pages": num_pages,
        "device": device.type,
        "host_memory": host.allocator.kind,
    }

    def backup() -> None:
        host.backup(dev_pool, dev_tokens, host_tokens).wait()

    first = host.backup(dev_pool, dev_tokens, host_tokens)
    first.wait()
    timed = paired_medians(
        backup,
        _plain_copy(first.num_bytes, device, d2h=True, pinned=pinned),
        repeats=args.repeats,
    )
    _emit("backup", common, first.num_bytes, timed, str(first.strategy))

    # Layer-wise load of the whole batch, layer by layer as the engine runs it: it moves as
    # many bytes as the backup, so neither side fits in the CPU caches.
    def load() -> None:
        host.load_layers(dev_pool, host_tokens, dev_tokens)
        _sync(device)

    loads = host.load_layers(dev_pool, host_tokens, dev_tokens)
    _sync(device)
    load_bytes = sum(load.num_bytes for load in loads)
    timed = paired_medians(
        load,
        _plain_copy(load_bytes, device, d2h=False, pinned=pinned, num_chunks=len(loads)),
        repeats=args.repeats,
    )
    _emit("load_layers", common, load_bytes, timed, str(loads[0].strategy))


def _emit(
    op: str, common: dict[str, object], num_bytes: int, timed: PairedTimes, strategy: str
) -> None:
    ours_gbps = num_bytes / timed.ours_seconds / 1e9
    base_gbps = num_bytes / timed.baseline_seconds / 1e9
    record = {
        **common,
        "op": op,
        "bytes": num_bytes,
        "strategy": strategy,
        "seconds": round(timed.ours_seconds, 6),
        "gbps": round(ours_gbps, 3),
        "baseline": "torch copy_ of the same bytes, contiguous",
        "baseline_seconds": round(timed.baseline_seconds, 6),
        "baseline_gbps": round(base_gbps, 3),
        "ratio": round(timed.ratio, 4),
        "ratio_of_medians": ratio(ours_gbps, base_gbps),
    }
    if common["layout"] == "page_first" and int(str(common["page_bytes"])) >= 64 << 10:
        record["target_ratio"] = TARGET_RATIO
    emit(record)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    pin_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda but CUDA is not available", file=sys.stderr)
        return 2
    spec = MHASpec(
        num_layers=args.layers,
        num_kv_heads=args.heads,
        head_dim=args.head_dim,
        dtype=torch.bfloat16,
    )
    emit(
        {
            "bench": "l2",
            "environment": environment(),
            "device": device.type,
            "note": "device is CPU memory" if device.type == "cpu" else "device is a CUDA GPU",
        }
    )
    for page_size in args.page_sizes:
        page_bytes = spec.bytes_per_token * page_size
        num_pages = max(1, (args.mib << 20) // page_bytes)
        dev_pool = MHAKVPool(
            spec, size=(num_pages + 1) * page_size, page_size=page_size, device=device
        )
        for buf in dev_pool.layer_buffers():
            buf.view(torch.uint8).random_(0, 256)
        for layout_name in args.layouts:
            host = MHAHostPool(dev_pool, layout=HostLayout(layout_name), size=num_pages * page_size)
            for pattern in args.patterns:
                _measure(host, dev_pool, num_pages=num_pages, pattern=pattern, args=args)
            host.close()
    return 0
