"""`kvstrata bench l3 --peer`: FileStorage beside SGLang 0.5.23's `HiCacheFile` (one file per
page, no checksum) on the same pages, page sizes and file system.

SGLang runs in the peer venv of `shared/bench/peer/setup.sh` (`--peer-venv`, default
$PEER_VENV or /tmp/kvstrata-peer), in a subprocess that runs `_PEER_SCRIPT`: a fresh
`HiCacheFile` directory per round, a set of every page (every page creates a file, as ours
below), then a get of them into preallocated tensors (`batch_get` with target locations, its
zero-extra-copy path). Ours runs the same round in this process with checksums on. The two
take turns round by round (the peer process stays up and runs one round per line it reads;
who goes first alternates), so that a change of load on the shared machine hits both; each
figure is the median over `--repeats` rounds after a warm-up round, and `ratio` is ours /
HiCacheFile in GB/s (target >= 1.0 for get and set).
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
import json, os, sys, tempfile, time
sys.path.insert(0, sys.argv[1])
import peer_env  # noqa: F401  (must precede sglang)
import torch
torch.set_num_threads(1)
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

page_bytes, num_pages, root = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
gen = torch.Generator().manual_seed(0)
pages = [torch.randint(0, 256, (page_bytes,), dtype=torch.uint8, generator=gen)
         for _ in range(num_pages)]
outs = [torch.empty(page_bytes, dtype=torch.uint8) for _ in range(num_pages)]
def store(d):
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=True, model_name=None, extra_config={"file_storage_path": d})
    return HiCacheFile(cfg)
print("ready", flush=True)
for line in sys.stdin:  # one round per line: its number
    r = int(line)
    s = store(tempfile.mkdtemp(dir=root))
    keys = ["%064x" % (r * 100000 + i) for i in range(num_pages)]
    os.sync()
    t = time.perf_counter(); ok = s.batch_set(keys, pages); dt = time.perf_counter() - t
    assert ok, "HiCacheFile refused a page"
    t2 = time.perf_counter(); got = s.batch_get(keys, outs); dt2 = time.perf_counter() - t2
    assert all(g is not None for g in got) and all(torch.equal(o, p) for o, p in zip(outs, pages))
    print(json.dumps({"set_s": dt, "get_s": dt2}), flush=True)
"""


def _our_round(
    r: int, pages: list[np.ndarray], outs: list[np.ndarray], root: Path
) -> tuple[float, float]:
    """One round of ours, the same schedule as the peer's: a fresh FileStorage on a fresh
    directory, a set of every page (each creates a file), then a get of them all."""
    page_bytes, num_pages = pages[0].nbytes, len(pages)
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
    return set_s, get_s


def _side_by_side(
    args: argparse.Namespace, python: Path, page_bytes: int, num_pages: int, root: Path
) -> dict[str, list[float]]:
    """Ours and the peer (a subprocess that runs one round per line it reads) take turns
    round by round, who goes first alternating, so that load drifting on the shared machine
    hits both; round 0 of each is a warm-up."""
    rng = np.random.default_rng(0)
    pages = [rng.integers(0, 256, page_bytes, dtype=np.uint8) for _ in range(num_pages)]
    outs = [np.empty(page_bytes, dtype=np.uint8) for _ in range(num_pages)]
    t: dict[str, list[float]] = {"set": [], "get": [], "peer_set": [], "peer_get": []}
    with subprocess.Popen(
        [str(python), "-c", _PEER_SCRIPT, str(args.peer_dir), str(page_bytes),
         str(num_pages), str(root)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    ) as peer:  # fmt: skip
        assert peer.stdin is not None and peer.stdout is not None, "pipes were asked for"
        if peer.stdout.readline().strip() != "ready":
            raise SystemExit("the SGLang peer did not start (see its stderr above)")

        def peer_round(r: int) -> tuple[float, float]:
            assert peer.stdin is not None and peer.stdout is not None, "pipes were asked for"
            peer.stdin.write(f"{r}\n")
            peer.stdin.flush()
            line = json.loads(peer.stdout.readline())
            return line["set_s"], line["get_s"]

        for r in range(args.repeats + 1):
            turns = [("", lambda r=r: _our_round(r, pages, outs, root)), ("peer_", peer_round)]
            for prefix, run in turns if r % 2 == 0 else turns[::-1]:
                set_s, get_s = run(r)
                if r:
                    t[prefix + "set"].append(set_s)
                    t[prefix + "get"].append(get_s)
        peer.stdin.close()
        if peer.wait() != 0:
            raise SystemExit(f"the SGLang peer exited with {peer.returncode}")
    return t


def run(args: argparse.Namespace, root: Path) -> None:
    """One JSON line per (page size, op): ours and HiCacheFile's GB/s and their ratio."""
    python = Path(args.peer_venv) / "bin" / "python"
    if not python.exists():
        raise SystemExit(f"no peer venv at {args.peer_venv}: run shared/bench/peer/setup.sh")
    for page_bytes in args.peer_page_bytes:
        num_pages = max(1, (args.total_mib << 20) // page_bytes)
        total = num_pages * page_bytes
        t = _side_by_side(args, python, page_bytes, num_pages, root)
        for op in ("set", "get"):
            ours = total / statistics.median(t[op]) / 1e9
            base = total / statistics.median(t["peer_" + op]) / 1e9
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
                    "repeats": len(t[op]),
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
