"""`kvstrata bench l3 --peer`: FileStorage beside SGLang 0.5.23's `HiCacheFile` (one file per
page, no checksum) on the same pages, page sizes and file system.

SGLang runs in the peer venv of `shared/bench/peer/setup.sh` (`--peer-venv`, default
$PEER_VENV or /tmp/kvstrata-peer), in a subprocess that runs `_PEER_SCRIPT`: a fresh
`HiCacheFile` directory per repeat for sets (every page creates a file, as ours below), then
gets of the last repeat's pages into preallocated tensors (`batch_get` with target locations,
its zero-extra-copy path). Ours runs the same schedule in this process with checksums on,
twice (before and after the peer, so a change of load hits both); each figure is the median
over its repeats, and `ratio` is ours / HiCacheFile in GB/s (target >= 1.0 for get and set).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from kvstrata.bench.report import emit, ratio
from kvstrata.storage import FileStorage
from kvstrata.storage.file import HEADER_BYTES

_PEER_SCRIPT = r"""
import json, os, statistics, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
import peer_env  # noqa: F401  (must precede sglang)
import torch
torch.set_num_threads(1)
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

page_bytes, num_pages, repeats, root = (int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]),
                                        sys.argv[5])
gen = torch.Generator().manual_seed(0)
pages = [torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=gen)
         for _ in range(num_pages)]
outs = [torch.empty(page_bytes, dtype=torch.uint8) for _ in range(num_pages)]
def store(d):
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=True, model_name=None, extra_config={"file_storage_path": d})
    return HiCacheFile(cfg)
sets, gets = [], []
for r in range(repeats + 1):
    s = store(tempfile.mkdtemp(dir=root))
    keys = ["%064x" % (r * 100000 + i) for i in range(num_pages)]
    os.sync()
    t = time.perf_counter(); ok = s.batch_set(keys, pages); dt = time.perf_counter() - t
    assert ok, "HiCacheFile refused a page"
    t2 = time.perf_counter(); got = s.batch_get(keys, outs); dt2 = time.perf_counter() - t2
    assert all(g is not None for g in got) and all(torch.equal(o, p) for o, p in zip(outs, pages))
    if r:
        sets.append(dt); gets.append(dt2)
print(json.dumps({"set_s": statistics.median(sets), "get_s": statistics.median(gets)}))
"""


def _ours(
    page_bytes: int, num_pages: int, repeats: int, root: Path
) -> tuple[list[float], list[float]]:
    rng = np.random.default_rng(0)
    pages = [rng.integers(0, 256, page_bytes, dtype=np.uint8) for _ in range(num_pages)]
    outs = [np.empty(page_bytes, dtype=np.uint8) for _ in range(num_pages)]
    sets: list[float] = []
    gets: list[float] = []
    for r in range(repeats + 1):
        directory = Path(tempfile.mkdtemp(dir=root))
        store = FileStorage(directory, capacity_bytes=num_pages * (HEADER_BYTES + page_bytes))
        keys = [b"%064x" % (r * 100000 + i) for i in range(num_pages)]
        os.sync()
        start = time.perf_counter()
        ok = store.batch_set(keys, pages)
        set_s = time.perf_counter() - start
        assert all(ok), "FileStorage refused a page"
        start = time.perf_counter()
        found = store.batch_get(keys, outs)
        get_s = time.perf_counter() - start
        assert all(found) and all(np.array_equal(o, p) for o, p in zip(outs, pages, strict=True))
        store.close()
        if r:
            sets.append(set_s)
            gets.append(get_s)
    return sets, gets


def run(args: argparse.Namespace, root: Path) -> None:
    """One JSON line per (page size, op): ours and HiCacheFile's GB/s and their ratio."""
    python = Path(args.peer_venv) / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no peer venv at {args.peer_venv}: run shared/bench/peer/setup.sh")
    for page_bytes in args.peer_page_bytes:
        num_pages = max(1, (args.total_mib << 20) // page_bytes)
        total = num_pages * page_bytes
        sets, gets = _ours(page_bytes, num_pages, args.repeats, root)
        done = subprocess.run(
            [str(python), "-c", _PEER_SCRIPT, str(args.peer_dir), str(page_bytes),
             str(num_pages), str(args.repeats), str(root)],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        peer = json.loads(done.stdout.strip().splitlines()[-1])
        more_sets, more_gets = _ours(page_bytes, num_pages, args.repeats, root)
        for op, ours_s, peer_s in (
            ("set", statistics.median(sets + more_sets), peer["set_s"]),
            ("get", statistics.median(gets + more_gets), peer["get_s"]),
        ):
            ours, base = total / ours_s / 1e9, total / peer_s / 1e9
            emit(
                {
                    "bench": "l3",
                    "backend": "file",
                    "op": op,
                    "page_bytes": page_bytes,
                    "bytes": total,
                    "gb_per_s": round(ours, 3),
                    "checksums": True,
                    "baseline": "SGLang 0.5.23 HiCacheFile (peer venv)",
                    "baseline_gb_per_s": round(base, 3),
                    "ratio": ratio(ours, base),
                    "target_ratio": 1.0,
                }
            )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    peer_dir = Path(__file__).resolve().parents[5].parent / "shared" / "bench" / "peer"
    parser.add_argument(
        "--peer", action="store_true", help="FileStorage beside SGLang's HiCacheFile only"
    )
    parser.add_argument(
        "--peer-venv", default=os.environ.get("PEER_VENV", "/tmp/kvstrata-peer"),
        help="the SGLang peer venv (shared/bench/peer/setup.sh)",
    )  # fmt: skip
    parser.add_argument("--peer-dir", type=Path, default=peer_dir, help="shared/bench/peer")
    parser.add_argument(
        "--peer-page-bytes",
        type=lambda text: [int(p) for p in text.split(",") if p],
        default=[1 << 20, 4 << 20, 8 << 20],
        help="page sizes of --peer (default 1, 4 and 8 MiB)",
    )
