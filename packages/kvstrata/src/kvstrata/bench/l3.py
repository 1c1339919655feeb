"""`kvstrata bench l3`: L3 storage throughput against plain Python I/O of the same bytes.

One JSON line per figure, each beside a baseline measured in the same run:

- `file` set / get: `FileStorage.batch_set` / `batch_get` (batches of `--batch` pages, one file
  per page, header and xxh3_64 checksum included) against two baselines moving the same bytes
  into / out of the same buffers:
  - `ratio` (the issue's, target >= 0.8): ONE plain sequential file written page by page with
    the same fsync policy (`page`: fsync after each page; `batch`: after each batch; `never`)
    and read back page by page with `readinto`. It pays for no file creation or open per page,
    so with one file per page (which the issue also mandates) a set can only approach it for
    pages large enough that creating a file costs little next to writing it.
  - `per_file_ratio`: one plain file per page (open, write or readinto, close: no header,
    checksum, temp file, rename or fan-out directory), which isolates what FileStorage adds to
    the cost of the file system itself.
  `set` is measured three times: `store: new` (a fresh FileStorage on a fresh directory every
  round, nothing removed until the end: every page creates a file), `store: cleared` (the same
  store cleared before each round, so every create follows the removal of as many files; on a
  journal-less ext4 a create then scans past every inode freed in the last 30 s, which is what
  this line measures), and `store: full` (the steady state of an L3 tier: the store holds one
  round's worth of pages and every page written evicts one, whose file FileStorage recycles;
  its eviction is timed, the baselines' unlinks are not). The per-file baseline of `new` and
  `full` writes into a fresh directory, that of `cleared` into an emptied one. Every write case
  starts after `os.sync()` (untimed) so that none pays for the writeback of the case before
  it; reads come from the page cache (the pages were just written), as they do for a warm L3.
- `memory` set / get: `MemoryStorage` against a memcpy (bytearray slice assignment) of the same
  pages. Sets run in the steady state of an L3 tier: the store is full and every page written
  evicts one (a fresh store would mostly time the kernel faulting in new memory).
- `--peer` (only): `FileStorage` beside SGLang 0.5.23's `HiCacheFile` at 1, 4 and 8 MiB pages
  (`bench/l3_peer.py`); `--ray` (only): the shared L3 tier of `kvstrata-l3-store`, same-node
  and cross-node get / put beside memcpy and raw `ray.get`, and 1-page p99
  (`kvstrata.l3_store.measure`).
- `keyer`: `PageKeyer.page_keys` tokens/s per hash and page size against `hashlib.sha256` over
  the same token bytes in one call (the throughput ceiling of the hash alone).

Medians over `--repeats`, ours and its baselines taking turns within each round (the machine is
shared, and load that drifts should hit both). `--io-threads` (a comma-separated list) runs the
file figures once per FileStorage thread count, each line saying which. All file figures, ours
and the baselines, use one temp directory under `--dir` (default /tmp), so they run on the same
file system; the environment line names it (`bench_fs`: the type of the mount holding it). The
temp directory is removed at the end.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from kvstrata.bench import l3_peer
from kvstrata.bench.report import emit, environment, pin_threads, ratio
from kvstrata.storage import FileStorage, MemoryStorage, PageKeyer, Storage
from kvstrata.storage.file import DEFAULT_IO_THREADS, FSYNC_POLICIES, HEADER_BYTES, FsyncPolicy
from kvstrata.storage.keys import KEY_BYTES, HashName

__all__ = ["main"]


def _nothing() -> None:
    pass


class _Case(NamedTuple):
    run: Callable[[], object]
    setup: Callable[[], object] = _nothing


def _interleaved(cases: dict[str, _Case], *, repeats: int) -> dict[str, float]:
    """Median seconds of each case's `run` (after its untimed `setup`). The cases take turns
    within every round, in order, so that a change of load on the shared machine hits ours and
    the baselines alike; round 0 is an untimed warm-up."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for round_ in range(repeats + 1):
        for name, case in cases.items():
            case.setup()
            start = time.perf_counter()
            case.run()
            if round_:
                samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(times) for name, times in samples.items()}


def _pages(total_bytes: int, page_bytes: int) -> list[bytearray]:
    rng = np.random.default_rng(0)
    return [
        bytearray(rng.integers(0, 256, page_bytes, dtype=np.uint8).tobytes())
        for _ in range(max(1, total_bytes // page_bytes))
    ]


def _batches(n: int, batch: int) -> list[slice]:
    return [slice(i, min(i + batch, n)) for i in range(0, n, batch)]


def _plain_write(path: Path, pages: list[bytearray], fsync: FsyncPolicy, batch: int) -> None:
    with open(path, "wb", buffering=0) as f:
        for part in _batches(len(pages), batch):
            for page in pages[part]:
                f.write(page)
                if fsync == "page":
                    os.fsync(f.fileno())
            if fsync == "batch":
                os.fsync(f.fileno())


def _plain_read(path: Path, outs: list[bytearray]) -> None:
    with open(path, "rb", buffering=0) as f:
        for out in outs:
            f.readinto(out)


def _per_file_write(root: Path, pages: list[bytearray], fsync: FsyncPolicy, batch: int) -> None:
    for part in _batches(len(pages), batch):
        files = []
        for i in range(part.start, part.stop):
            f = open(root / f"{i}.bin", "wb", buffering=0)  # noqa: SIM115 (closed below)
            f.write(pages[i])
            if fsync == "page":
                os.fsync(f.fileno())
            files.append(f)
        for f in files:
            if fsync == "batch":
                os.fsync(f.fileno())
            f.close()


def _per_file_read(root: Path, outs: list[bytearray]) -> None:
    for i, out in enumerate(outs):
        with open(root / f"{i}.bin", "rb", buffering=0) as f:
            f.readinto(out)


def _settled(setup: Callable[[], object]) -> None:
    """Run a write case's setup, then flush the file systems: dirty pages and unlinks left by
    the previous case would otherwise be written back during this one's timing."""
    setup()
    os.sync()


def _empty_dir(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir()


def _storage_set(storage: Storage, keys: list[bytes], pages: list[bytearray], batch: int) -> None:
    for part in _batches(len(keys), batch):
        results = storage.batch_set(keys[part], pages[part])
        assert all(results), "a benchmark write failed: is the disk full?"


def _storage_get(storage: Storage, keys: list[bytes], outs: list[bytearray], batch: int) -> None:
    for part in _batches(len(keys), batch):
        assert all(storage.batch_get(keys[part], outs[part])), "a benchmark page went missing"


def _line(
    backend: str,
    op: str,
    page_bytes: int,
    total: int,
    ours_s: float,
    base_s: float,
    **extra: object,
) -> dict[str, object]:
    ours, base = total / ours_s / 1e9, total / base_s / 1e9
    return {
        "bench": "l3",
        "backend": backend,
        "op": op,
        "page_bytes": page_bytes,
        "bytes": total,
        "gb_per_s": round(ours, 3),
        **extra,
        "baseline_gb_per_s": round(base, 3),
        "ratio": ratio(ours, base),
    }


class _FileCase(NamedTuple):
    """The pages of one page size and thread count, and the directory its figures write in."""

    page_bytes: int
    io_threads: int
    pages: list[bytearray]
    keys: list[bytes]
    work: Path

    @property
    def total(self) -> int:
        return len(self.pages) * self.page_bytes

    def open_store(self, directory: Path, fsync: FsyncPolicy) -> FileStorage:
        # Room for exactly one set of pages: a "full" set evicts (and recycles) one page per page.
        capacity = len(self.pages) * (HEADER_BYTES + self.page_bytes)
        return FileStorage(
            directory, capacity_bytes=capacity, fsync=fsync, io_threads=self.io_threads
        )


def _file_case(root: Path, page_bytes: int, io_threads: int, total_mib: int) -> _FileCase:
    pages = _pages(total_mib << 20, page_bytes)
    keys = [hashlib.sha256(b"%d" % i).digest() for i in range(len(pages))]
    work = root / f"file-{page_bytes}-{io_threads}"
    work.mkdir()
    return _FileCase(page_bytes, io_threads, pages, keys, work)


def _bench_file_new(args: argparse.Namespace, case: _FileCase) -> dict[str, float]:
    """Sets into new stores (and files into new directories): run before any file of the
    bench is removed, since creates right after removals measure the removals' aftermath."""
    fsync, batch = args.fsync, args.batch
    plain = case.work / "plain-new.bin"
    generation = itertools.count()
    fresh: list[FileStorage] = []
    fresh_files: list[Path] = []

    def set_new() -> None:
        for old in fresh:
            old.close()
        directory = case.work / f"new-{next(generation)}"
        directory.mkdir()
        fresh[:] = [case.open_store(directory, fsync)]

    def per_file_new() -> None:
        fresh_files[:] = [case.work / f"per-file-new-{next(generation)}"]
        fresh_files[0].mkdir()

    t = _interleaved(
        {
            "set_new": _Case(
                lambda: _storage_set(fresh[0], case.keys, case.pages, batch),
                lambda: _settled(set_new),
            ),
            "file_set_new": _Case(
                lambda: _per_file_write(fresh_files[0], case.pages, fsync, batch),
                lambda: _settled(per_file_new),
            ),
            "plain_set_new": _Case(
                lambda: _plain_write(plain, case.pages, fsync, batch),
                lambda: _settled(lambda: plain.unlink(missing_ok=True)),
            ),
        },
        repeats=args.repeats,
    )
    outs = [bytearray(case.page_bytes) for _ in case.pages]
    _storage_get(fresh[0], case.keys, outs, batch)
    assert outs == case.pages, "FileStorage returned other bytes than were written"
    fresh[0].close()
    return t


def _bench_file_main(args: argparse.Namespace, case: _FileCase) -> dict[str, float]:
    """Sets into a cleared store and into a full one, and gets, with their baselines."""
    fsync, batch = args.fsync, args.batch
    store_dir, plain, per_file = case.work / "store", case.work / "plain.bin", case.work / "pf"
    store_dir.mkdir()
    storage = case.open_store(store_dir, fsync)
    keys, pages = case.keys, case.pages
    outs = [bytearray(case.page_bytes) for _ in pages]
    current = list(keys)  # the keys the store holds now, which "get" reads
    generation = itertools.count()

    def set_cleared() -> None:
        storage.clear()
        current[:] = keys

    def set_full() -> None:
        # New keys for every repeat, so each page written evicts one of the previous repeat.
        g = next(generation)
        current[:] = [hashlib.sha256(b"full-%d-%d" % (g, i)).digest() for i in range(len(keys))]

    t = _interleaved(
        {
            "plain_set": _Case(
                lambda: _plain_write(plain, pages, fsync, batch),
                lambda: _settled(lambda: plain.unlink(missing_ok=True)),
            ),
            "set_cleared": _Case(
                lambda: _storage_set(storage, keys, pages, batch), lambda: _settled(set_cleared)
            ),
            "file_set_cleared": _Case(
                lambda: _per_file_write(per_file, pages, fsync, batch),
                lambda: _settled(lambda: _empty_dir(per_file)),
            ),
            "get": _Case(lambda: _storage_get(storage, current, outs, batch)),
            "plain_get": _Case(lambda: _plain_read(plain, outs)),
            "file_get": _Case(lambda: _per_file_read(per_file, outs)),
            "set_full": _Case(
                lambda: _storage_set(storage, current, pages, batch), lambda: _settled(set_full)
            ),
        },
        repeats=args.repeats,
    )
    _storage_get(storage, current, outs, batch)
    assert outs == pages, "FileStorage returned other bytes than were written"
    assert storage.stats().evictions >= len(pages), "the full-store sets did not evict"
    storage.close()
    return t


def _emit_file(args: argparse.Namespace, case: _FileCase, t: dict[str, float]) -> None:
    # (op, store, ours, sequential baseline, per-file baseline)
    figures = (
        ("set", "new", "set_new", "plain_set_new", "file_set_new"),
        ("set", "cleared", "set_cleared", "plain_set", "file_set_cleared"),
        ("set", "full", "set_full", "plain_set", "file_set_new"),
        ("get", None, "get", "plain_get", "file_get"),
    )
    total = case.total
    for op, store, ours, base, per_file_base in figures:
        ours_gbps, per_file_gbps = total / t[ours] / 1e9, total / t[per_file_base] / 1e9
        emit(
            _line(
                "file", op, case.page_bytes, total, t[ours], t[base],
                fsync=args.fsync,
                io_threads=case.io_threads,
                **({"store": store} if store else {}),
                baseline="plain sequential file",
                target_ratio=0.8,
                per_file_baseline_gb_per_s=round(per_file_gbps, 3),
                per_file_ratio=ratio(ours_gbps, per_file_gbps),
            )
        )  # fmt: skip


def _bench_files(args: argparse.Namespace, root: Path) -> None:
    """Every new-store figure first, then the rest: removing files (clears, evictions that
    unlink, the per-file baseline's emptied directory) slows the creates that follow on some
    file systems, so nothing is removed before the new-store figures, and the bench's files
    are removed only at the end."""
    cases = [
        _file_case(root, page_bytes, io_threads, args.total_mib)
        for page_bytes in args.page_bytes
        for io_threads in args.io_threads
    ]
    times = [_bench_file_new(args, case) for case in cases]
    for case, t in zip(cases, times, strict=True):
        _emit_file(args, case, {**t, **_bench_file_main(args, case)})


def _bench_memory(args: argparse.Namespace, page_bytes: int) -> None:
    pages = _pages(args.total_mib << 20, page_bytes)
    keys: list[bytes] = []
    outs = [bytearray(page_bytes) for _ in pages]
    total = len(pages) * page_bytes
    storage = MemoryStorage(capacity_bytes=total)
    generation = itertools.count()

    def fresh_keys() -> None:
        # New keys for every repeat, so each page written evicts one of the previous repeat.
        g = next(generation)
        keys[:] = [hashlib.sha256(b"%d-%d" % (g, i)).digest() for i in range(len(pages))]

    def memcpy() -> None:
        for out, page in zip(outs, pages, strict=True):
            out[:] = page

    fresh_keys()
    _storage_set(storage, keys, pages, args.batch)  # fill the store
    t = _interleaved(
        {
            "set": _Case(lambda: _storage_set(storage, keys, pages, args.batch), fresh_keys),
            "get": _Case(lambda: _storage_get(storage, keys, outs, args.batch)),
            "memcpy": _Case(memcpy),
        },
        repeats=args.repeats,
    )
    set_s, get_s, copy_s = t["set"], t["get"], t["memcpy"]
    emit(_line("memory", "set", page_bytes, total, set_s, copy_s, baseline="memcpy", store="full"))
    emit(_line("memory", "get", page_bytes, total, get_s, copy_s, baseline="memcpy"))


def _bench_keyer(args: argparse.Namespace, page_size: int, hash_name: HashName) -> None:
    tokens = np.random.default_rng(1).integers(0, 150_000, args.num_tokens, dtype=np.int64)
    raw = tokens.astype("<i8").tobytes()
    keyer = PageKeyer(page_size=page_size, namespace=b"bench", hash=hash_name)
    t = _interleaved(
        {
            "keys": _Case(lambda: keyer.page_keys(tokens)),
            "sha256": _Case(lambda: hashlib.sha256(raw).digest()),
        },
        repeats=4 * args.repeats,  # milliseconds each: more rounds to ride out scheduler noise
    )
    keys_s, hash_s = t["keys"], t["sha256"]
    ours, base = args.num_tokens / keys_s, args.num_tokens / hash_s
    emit(
        {
            "bench": "l3",
            "backend": "keyer",
            "op": "page_keys",
            "hash": hash_name,
            "page_size": page_size,
            "key_bytes": KEY_BYTES[hash_name],
            "tokens": args.num_tokens,
            "tokens_per_s": round(ours),
            "baseline": "hashlib.sha256 over all token bytes in one call",
            "baseline_tokens_per_s": round(base),
            "ratio": ratio(ours, base),
        }
    )


def _sizes(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def _file_system(path: Path) -> str:
    """The type of the mount holding `path` (longest matching mount point in /proc/mounts),
    or "unknown" where /proc/mounts is not there."""
    target, best, kind = str(path.resolve()), -1, "unknown"
    try:
        with open("/proc/self/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                fields = line.split()
                if len(fields) < 3:
                    continue
                point = fields[1].replace("\\040", " ")
                inside = target == point or target.startswith(point.rstrip("/") + "/")
                if inside and len(point) > best:
                    best, kind = len(point), fields[2]
    except OSError:
        return "unknown"
    return kind


def _bench_extras(args: argparse.Namespace, root: Path) -> None:
    """`--peer`: FileStorage beside SGLang's HiCacheFile (bench/l3_peer.py); `--ray`: the
    shared L3 tier (`kvstrata.l3_store.measure`, which owns every Ray call)."""
    if args.peer:
        l3_peer.run(args, root)
    if args.ray:
        # Ray reads this when it is imported (measure imports it): under `uv run` it would
        # otherwise package the whole worktree as the job's working_dir for every worker,
        # which share this venv anyway (and start slower for it).
        os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
        from kvstrata.l3_store import measure

        for line in measure.run(
            page_bytes=args.ray_page_bytes, num_pages=args.ray_pages, repeats=args.repeats
        ):
            emit(line)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kvstrata bench l3", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument(
        "--page-bytes",
        type=_sizes,
        default=[64 << 10, 1 << 20],
        help="comma-separated page sizes in bytes (default 65536,1048576)",
    )
    parser.add_argument("--total-mib", type=int, default=64, help="bytes moved per figure (MiB)")
    parser.add_argument("--batch", type=int, default=128, help="pages per batch call")
    parser.add_argument("--fsync", choices=FSYNC_POLICIES, default="never")
    parser.add_argument(
        "--io-threads",
        type=_sizes,
        default=[DEFAULT_IO_THREADS],
        help=f"comma-separated FileStorage io_threads to run (default {DEFAULT_IO_THREADS})",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path("/tmp"),
        help="where the temp directory of the file figures goes (its file system is measured)",
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--token-page-sizes", type=_sizes, default=[16, 64])
    parser.add_argument("--num-tokens", type=int, default=1 << 18)
    parser.add_argument("--skip", nargs="*", default=[], choices=["file", "memory", "keyer"])
    parser.add_argument(
        "--ray", action="store_true",
        help="only the shared L3 tier on a 2-node loopback Ray cluster (needs kvstrata[ray])",
    )  # fmt: skip
    parser.add_argument("--ray-page-bytes", type=int, default=4 << 20, help="--ray page size")
    parser.add_argument("--ray-pages", type=int, default=16, help="--ray pages per batch")
    l3_peer.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.batch < 1 or args.total_mib < 1 or args.num_tokens < 1:
        parser.error("--repeats, --batch, --total-mib and --num-tokens must be >= 1")
    if not args.io_threads or min(args.io_threads) < 1:
        parser.error("--io-threads must list thread counts >= 1")
    if not args.dir.is_dir():
        parser.error(f"--dir {args.dir} is not a directory")
    pin_threads()
    root = Path(tempfile.mkdtemp(prefix="kvstrata-bench-l3-", dir=args.dir))
    emit(
        {
            "bench": "l3",
            "environment": {
                **environment(),
                "bench_dir": str(root),
                "bench_fs": _file_system(root),
            },
        }
    )
    try:
        if args.ray or args.peer:
            _bench_extras(args, root)
            return 0
        if "file" not in args.skip:
            _bench_files(args, root)
        for page_bytes in args.page_bytes:
            if "memory" not in args.skip:
                _bench_memory(args, page_bytes)
        if "keyer" not in args.skip:
            for page_size in args.token_page_sizes:
                for hash_name in KEY_BYTES:
                    _bench_keyer(args, page_size, hash_name)  # pyright: ignore[reportArgumentType]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0
