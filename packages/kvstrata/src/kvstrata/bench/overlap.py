"""`kvstrata bench overlap`: does a layer-wise load hide behind the forward pass?

A simulated forward of L layers: each layer first waits for its own pages
(`LoadHandle.wait_layer`), then "computes" by busy-waiting a fixed time on the CPU. The tier
controller's load worker copies the hit pages host -> device one layer at a time meanwhile. Three
runs in the same process, each the median over `--repeats` interleaved rounds:

    compute   the forward alone (no load)
    transfer  the load alone (submit, wait for the last layer)
    overlap   both together, as an engine would run them

and the figure is overlap / max(compute, transfer): 1.0 is perfect overlap, 2.0 none at all
(target <= 1.2). Two diagnostics say whether the box allowed overlap at all:
`compute_inflation` (the compute run over its nominal time: > 1 when even one core was not ours)
and `overlap_cores_used` (CPU seconds per wall second during the overlapped runs: near 2 when the
copy and the compute ran side by side, near 1 or below when they had to take turns). The
"device" is CPU memory here (the JSON says so), and on a 2-core machine the copy and the
busy-wait each take one core (other processes on the box take from the same two).

The GIL matters as much as the cores. torch releases it inside a copy, and the load worker needs
it only between copies. `--compute native` (the default) spins in C with the GIL released, as a
real forward does (kernels, or launches of them): it hashes a 16 KiB block with zlib.crc32, which
drops the GIL, until the time is up. `--compute python` spins in the interpreter, holding the GIL
and handing it over only every switch interval: the worst case for any Python-side worker. The
benchmark sets `sys.setswitchinterval` (`--switch-interval-ms`, reported) for its duration.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvstrata.bench.report import emit, environment, median_seconds, pin_threads, ratio
from kvstrata.hybrid_cache import (
    AckStatus,
    ControllerParams,
    HybridPool,
    LoadOp,
    OpKind,
    PageMove,
    PoolGroup,
    TierController,
    WriteOp,
)
from kvstrata.pool import MHAKVPool, MHASpec
from kvstrata.pool_host import HostLayout, MHAHostPool


@dataclass(frozen=True, kw_only=True)
class OverlapConfig:
    num_layers: int
    compute_ms: float
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int
    layout: HostLayout
    compute: str

    @property
    def layer_bytes(self) -> int:
        # K and V of every hit token of one layer, bf16.
        return 2 * self.num_pages * self.page_size * self.num_kv_heads * self.head_dim * 2


_BLOCK = bytes(16 << 10)


def busy_wait_python(seconds: float) -> None:
    """Spin in the interpreter for `seconds`: one core busy, the GIL held throughout."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def busy_wait_native(seconds: float) -> None:
    """Spin in C for `seconds`: one core busy, the GIL released (zlib.crc32 drops it for
    blocks over 5 KiB), as compute kernels do."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        zlib.crc32(_BLOCK)


BUSY_WAITS: dict[str, Callable[[float], None]] = {
    "native": busy_wait_native,
    "python": busy_wait_python,
}


def run_config(cfg: OverlapConfig, *, repeats: int) -> dict[str, object]:
    spec = MHASpec(
        num_layers=cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=torch.bfloat16,
    )
    tokens = cfg.num_pages * cfg.page_size
    device_pool = MHAKVPool(spec, size=tokens, page_size=cfg.page_size, device="cpu")
    host_pool = MHAHostPool(device_pool, layout=cfg.layout, size=tokens)
    pools = HybridPool.full(device_pool)
    group = PoolGroup(pools, {"full": host_pool})
    # Device slots 1..num_pages (page 0 is the dummy), host pages 0..num_pages-1.
    device_idx = torch.arange(cfg.page_size, tokens + cfg.page_size, dtype=torch.int64)
    host_idx = torch.arange(tokens, dtype=torch.int64)
    for buf in device_pool.layer_buffers():
        buf.view(torch.uint8).random_(0, 256)
    move = {"full": PageMove(device=device_idx, host=host_idx)}
    layer_compute_s = cfg.compute_ms / 1000.0
    busy_wait = BUSY_WAITS[cfg.compute]
    layer_ids = pools.layer_ids

    with TierController(group, params=ControllerParams()) as controller:
        backup = controller.submit_write(WriteOp(moves=move))
        ack = controller.wait(backup)
        assert ack is not None and ack.ok, f"backup failed: {ack}"

        def compute_only() -> None:
            for _ in layer_ids:
                busy_wait(layer_compute_s)

        def transfer_only() -> None:
            handle = controller.submit_load(LoadOp(moves=move))
            handle.wait_all()
            done = controller.wait(handle.op_id)
            assert done is not None and done.ok, f"load failed: {done}"

        def overlapped() -> None:
            handle = controller.submit_load(LoadOp(moves=move))
            for layer in layer_ids:
                handle.wait_layer(layer)
                busy_wait(layer_compute_s)
            done = controller.wait(handle.op_id)
            assert done is not None and done.ok, f"load failed: {done}"

        # Rounds interleave the three runs, so a burst of load from other processes on the
        # shared cores hits all three alike; each figure is the median over the rounds.
        runs = {"compute": compute_only, "transfer": transfer_only, "overlap": overlapped}
        for fn in runs.values():
            fn()  # warm-up
        samples: dict[str, list[float]] = {name: [] for name in runs}
        cores: list[float] = []  # CPU seconds of this process per wall second, overlap runs
        for _ in range(repeats):
            for name, fn in runs.items():
                cpu = time.process_time()
                samples[name].append(median_seconds(fn, repeats=1, warmup=0))
                if name == "overlap":
                    cores.append((time.process_time() - cpu) / samples[name][-1])
        t_compute, t_transfer, t_overlap = (statistics.median(samples[n]) for n in runs)
        stats = controller.stats.snapshot()

    bound = max(t_compute, t_transfer)
    transfer_gbps = cfg.layer_bytes * cfg.num_layers / t_transfer / 1e9
    return {
        "bench": "overlap",
        "device": "cpu (host memory stands in for the device)",
        "layout": cfg.layout.value,
        "compute": cfg.compute,
        "layers": cfg.num_layers,
        "compute_ms_per_layer": cfg.compute_ms,
        "pages": cfg.num_pages,
        "page_size": cfg.page_size,
        "layer_mib": round(cfg.layer_bytes / 2**20, 3),
        "compute_s": round(t_compute, 6),
        # compute_s over its nominal L x compute_ms: above 1 the box lent us less than a core.
        "compute_inflation": round(t_compute / (cfg.num_layers * layer_compute_s), 3),
        # CPU seconds per wall second while overlapping: ~2 when both threads ran at once, ~1
        # when they had to take turns on one core (the other one busy with other processes).
        "overlap_cores_used": round(statistics.median(cores), 3),
        "transfer_s": round(t_transfer, 6),
        "transfer_gbps": round(transfer_gbps, 3),
        "overlap_s": round(t_overlap, 6),
        "baseline": "max(compute_s, transfer_s)",
        "baseline_s": round(bound, 6),
        "serial_s": round(t_compute + t_transfer, 6),
        "ratio": ratio(t_overlap, bound),
        "target_ratio": 1.2,
        "loads_done": stats.finished[OpKind.LOAD, AckStatus.DONE],
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvstrata bench overlap",
        description="Layer-wise host -> device load overlapped with a simulated forward pass.",
    )
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument(
        "--compute-ms",
        type=float,
        nargs="+",
        default=[1.0, 2.0, 4.0],
        help="busy-wait per layer; one JSON line per value",
    )
    parser.add_argument("--pages", type=int, default=64, help="hit pages loaded per layer")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument(
        "--layout", choices=[v.value for v in HostLayout], default=HostLayout.page_first.value
    )
    parser.add_argument("--compute", choices=sorted(BUSY_WAITS), nargs="+", default=["native"])
    parser.add_argument("--repeats", type=int, default=11, help="interleaved rounds")
    parser.add_argument("--switch-interval-ms", type=float, default=0.2)
    args = parser.parse_args(argv)

    pin_threads(1)
    previous = sys.getswitchinterval()
    sys.setswitchinterval(args.switch_interval_ms / 1000.0)
    try:
        for compute, compute_ms in [(c, ms) for c in args.compute for ms in args.compute_ms]:
            cfg = OverlapConfig(
                compute=compute,
                num_layers=args.layers,
                compute_ms=compute_ms,
                num_pages=args.pages,
                page_size=args.page_size,
                num_kv_heads=args.kv_heads,
                head_dim=args.head_dim,
                layout=HostLayout(args.layout),
            )
            record = run_config(cfg, repeats=args.repeats)
            record["switch_interval_ms"] = args.switch_interval_ms
            record["environment"] = environment()
            emit(record)
    finally:
        sys.setswitchinterval(previous)
    return 0
