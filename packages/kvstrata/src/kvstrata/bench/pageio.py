"""Page I/O: `read_pages` / `write_pages` GB/s against a plain contiguous copy of the same bytes.

Workload, per page size P (default 1, 16, 64):

- an `MHAKVPool`, bf16, 28 layers x 2 KV heads x head_dim 128 (Qwen2.5-1.5B's KV shape: 28 KiB
  a token, one K or V row 512 bytes), holding `2 * num_pages` pages plus the dummy page, every
  byte random;
- `num_pages` (default 256) distinct page ids drawn from a seeded generator;
- read: `read_pages(ids, out)` into a preallocated CPU uint8 `[num_pages, page_size_bytes]`;
  write: `write_pages(ids, src)` from such a buffer (all layers of every page, flat format);
- baseline: `dst.copy_(src)` between two contiguous uint8 tensors of exactly the same number of
  bytes, timed in the same loop, alternating with the operation so both see the same load.

Each line: `gbps` = bytes / median seconds, `baseline_gbps` likewise, `ratio` = gbps / baseline,
and `paired_ratio`, the median over the alternating pairs of copy time / operation time (each
pair measured back to back, so a load change between moments cancels).
Target ratio >= 0.8. One torch thread by default (`--threads`), as every kvstrata benchmark.

On the CPU each line also has `path` (the pools' copy path: "native", the compiled copies of
`kvstrata.pool.native`, or "numpy", the fallback; `KVSTRATA_NATIVE=0` forces the fallback) and
`reference_ratios`: the paired ratio against the same plain copy of one `numpy.take` (read) or
`numpy.put` (write) of exactly the same pieces from the same pool memory, the ceiling of the
NumPy fallback (see `gather_ref`).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvstrata.bench.gather_ref import reference_ops
from kvstrata.bench.report import emit, environment, paired_medians, pin_threads, ratio
from kvstrata.pool import MHAKVPool, MHASpec

DEFAULT_PAGE_SIZES = (1, 16, 64)

#: The raw operations (`gather_ref`) each of ours is set beside.
REFERENCES = {"read_pages": "numpy_take", "write_pages": "numpy_put"}


def run_page_io(
    *,
    quick: bool = False,
    page_sizes: Sequence[int] = DEFAULT_PAGE_SIZES,
    num_pages: int | None = None,
    num_layers: int = 28,
    num_kv_heads: int = 2,
    head_dim: int = 128,
    dtype: torch.dtype = torch.bfloat16,
    repeats: int | None = None,
    device: str = "cpu",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One record per (operation, page size), as the module docstring describes. `quick`
    shrinks the run (64 pages, 3 repeats) unless `num_pages` / `repeats` are given. Prints
    nothing; the caller emits. Does not change torch's thread count."""
    pages = num_pages if num_pages is not None else (64 if quick else 256)
    reps = repeats if repeats is not None else (3 if quick else 7)
    dev = torch.device(device)
    cuda = dev.type == "cuda"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    spec = MHASpec(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    records: list[dict[str, Any]] = []
    for page_size in page_sizes:
        pool = MHAKVPool(spec, size=2 * pages * page_size, page_size=page_size, device=dev)
        for buf in pool.layer_buffers():
            buf.view(torch.uint8).random_(0, 256)
        ids = (torch.randperm(pool.num_pages - 1, generator=gen)[:pages] + 1).to(dev)
        flat = torch.empty((pages, pool.page_size_bytes), dtype=torch.uint8, device=dev)
        scratch = torch.empty_like(flat).random_(0, 256)
        nbytes = flat.numel()

        def plain_copy(dst: torch.Tensor = flat, src: torch.Tensor = scratch) -> None:
            dst.copy_(src)

        ops: dict[str, Callable[[], None]] = {
            "read_pages": lambda p=pool, i=ids, f=flat: p.read_pages(i, f),
            "write_pages": lambda p=pool, i=ids, f=flat: p.write_pages(i, f),
        }
        refs = {} if cuda else _references(pool, ids, flat)
        for name, op in ops.items():
            timed = paired_medians(op, plain_copy, repeats=reps, sync=sync)
            reference_ratios = {
                ref: round(paired_medians(refs[ref], plain_copy, repeats=reps).ratio, 4)
                for ref in (REFERENCES[name],)
                if ref in refs
            }
            seconds, base_seconds = timed.ours_seconds, timed.baseline_seconds
            gbps = nbytes / seconds / 1e9
            baseline_gbps = nbytes / base_seconds / 1e9
            records.append(
                {
                    "bench": "pageio",
                    "workload": f"page_io_{name.split('_')[0]}",
                    "op": name,
                    "family": "mha",
                    "dtype": str(dtype).removeprefix("torch."),
                    "device": dev.type,
                    "path": "native" if pool.native_page_copies else ("torch" if cuda else "numpy"),
                    "page_size": page_size,
                    "num_pages": pages,
                    "num_layers": num_layers,
                    "bytes": nbytes,
                    "seconds": round(seconds, 6),
                    "gbps": round(gbps, 3),
                    "baseline": "contiguous torch copy_ of the same bytes",
                    "baseline_gbps": round(baseline_gbps, 3),
                    "ratio": ratio(gbps, baseline_gbps),
                    # Median over the back-to-back (operation, copy) pairs: steadier under load.
                    "paired_ratio": round(timed.ratio, 4),
                    "reference_ratios": reference_ratios,
                    "repeats": reps,
                }
            )
        del pool, flat, scratch
    return records


def _references(
    pool: MHAKVPool, ids: torch.Tensor, flat: torch.Tensor
) -> dict[str, Callable[[], None]]:
    """`gather_ref.reference_ops` over the pool's own memory: its layer buffers seen as one
    run of bytes (they are one stack: buffer b starts b buffers after buffer 0; checked), piece
    `b * num_pages + id` = buffer b's bytes of page `id`, in the flat page's order. Each
    reference is checked to read exactly what `read_pages` reads."""
    buffers = pool.layer_buffers()
    buffer_bytes = buffers[0].numel() * buffers[0].element_size()
    base = buffers[0].data_ptr()
    assert all(b.data_ptr() == base + k * buffer_bytes for k, b in enumerate(buffers)), (
        "the page I/O references need the layer buffers as one stack"
    )
    whole = torch.as_strided(
        buffers[0].view(torch.uint8).reshape(-1), (len(buffers) * buffer_bytes,), (1,)
    )
    first = torch.arange(len(buffers), dtype=torch.int64) * pool.num_pages
    pieces = (ids[:, None] + first).reshape(-1).numpy()
    refs = reference_ops(whole.numpy(), flat.numpy(), pieces, buffer_bytes // pool.num_pages)
    pool.read_pages(ids, flat)
    expected = flat.clone()
    flat.zero_()
    refs["numpy_take"]()
    if not torch.equal(flat, expected):
        raise RuntimeError("reference numpy_take read other bytes than read_pages")
    return refs


def _parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="kvstrata bench pageio", description=(__doc__ or "").split("\n")[0]
    )
    ap.add_argument("--page-sizes", type=int, nargs="+", default=list(DEFAULT_PAGE_SIZES))
    ap.add_argument("--num-pages", type=int, default=None, help="pages per call (default 256)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--heads", type=int, default=2, help="KV heads")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats (default 7)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="64 pages, 3 repeats")
    return ap.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("--device cuda but CUDA is not available")
        return 2
    pin_threads(args.threads)
    emit({"bench": "pageio", "environment": environment()})
    for record in run_page_io(
        quick=args.quick,
        page_sizes=args.page_sizes,
        num_pages=args.num_pages,
        num_layers=args.layers,
        num_kv_heads=args.heads,
        head_dim=args.head_dim,
        repeats=args.repeats,
        device=args.device,
        seed=args.seed,
    ):
        emit(record)
    return 0
