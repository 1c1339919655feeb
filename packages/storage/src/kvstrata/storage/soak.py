"""A soak of several processes sharing one FileStorage directory (issue 17).

`python -m kvstrata.storage.soak DIR --seconds 30 --processes 3 --capacity-pages 20` starts the
worker processes, each writing, reading and checking pages of a shared key set through its own
FileStorage, while the parent samples the bytes of page and temp files in DIR. Prints one JSON
object: wrong bytes, exceptions, corrupt pages, race misses, the largest directory size seen
against the capacity, and whether the next storage to open DIR indexes every page left on disk.
Exit 0 when every check holds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
import time
from pathlib import Path

from kvstrata.storage.file import FileStorage

PAGE_BYTES = 4096
NAMESPACE = "soak"


def payload(key: bytes) -> bytes:
    """The bytes of a page, derived from its key (so any reader can check them)."""
    seed = key * (PAGE_BYTES // len(key) + 1)
    return seed[:PAGE_BYTES]


def _worker(
    root: str,
    capacity: int,
    seconds: float,
    seed: int,
    out: multiprocessing.Queue[dict[str, int | str]],
) -> None:
    report: dict[str, int | str] = {"wrong_bytes": 0, "exceptions": 0}
    try:
        storage = FileStorage(root, capacity_bytes=capacity, namespace=NAMESPACE, io_threads=2)
        rng = random.Random(seed)
        keys = [f"page-{i:04d}".encode() for i in range(60)]
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            batch = rng.sample(keys, rng.randint(1, 4))
            try:
                if rng.random() < 0.5:
                    storage.batch_set(batch, [payload(k) for k in batch])
                else:
                    outs = [bytearray(PAGE_BYTES) for _ in batch]
                    for key, ok, buf in zip(
                        batch, storage.batch_get(batch, outs), outs, strict=True
                    ):
                        if ok and bytes(buf) != payload(key):
                            report["wrong_bytes"] = int(report["wrong_bytes"]) + 1
                if rng.random() < 0.05:
                    storage.batch_exists(batch)
                    storage.check_integrity()
            except Exception as exc:  # noqa: BLE001 - counted and reported: the soak checks there are none
                report["exceptions"] = int(report["exceptions"]) + 1
                report["last_exception"] = repr(exc)
        stats = storage.stats()
        report.update(
            corrupt_pages=stats.corrupt_pages,
            race_misses=stats.race_misses,
            hits=stats.hits,
            writes=stats.pages_written,
            write_failures=stats.write_failures,
        )
    except Exception as exc:  # noqa: BLE001 - a worker that cannot start is reported, not lost
        report["exceptions"] = int(report["exceptions"]) + 1
        report["last_exception"] = repr(exc)
    out.put(report)


def _dir_bytes(root: Path) -> int:
    """Bytes of page and temp files (under the namespace directories: the storages' own probe
    file of one byte in the root is not a page)."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        if os.path.samefile(dirpath, root):
            continue
        for name in files:
            if name.endswith((".page", ".tmp")):
                try:
                    total += os.lstat(os.path.join(dirpath, name)).st_size
                except FileNotFoundError:
                    continue
    return total


def run(root: Path, *, seconds: float, processes: int, capacity_pages: int) -> dict[str, object]:
    """Run the soak on `root` (an empty directory) and return its report."""
    capacity = capacity_pages * FileStorage.page_file_bytes(PAGE_BYTES)
    ctx = multiprocessing.get_context("spawn")
    queue: multiprocessing.Queue[dict[str, int | str]] = ctx.Queue()
    workers = [
        ctx.Process(target=_worker, args=(str(root), capacity, seconds, i, queue))
        for i in range(processes)
    ]
    for w in workers:
        w.start()
    peak = 0
    reports: list[dict[str, int | str]] = []
    while len(reports) < processes:
        peak = max(peak, _dir_bytes(root))
        while not queue.empty():
            reports.append(queue.get())
        time.sleep(0.002)
    for w in workers:
        w.join()
    left = _dir_bytes(root)
    after = FileStorage(root, capacity_bytes=capacity, namespace=NAMESPACE)
    on_disk = sorted(p.name.removesuffix(".page") for p in root.rglob("*.page"))
    indexed = sorted(k.hex() for k in after.lru_keys())
    after.check_integrity()
    totals = {
        f: sum(int(r.get(f, 0)) for r in reports)
        for f in (
            "wrong_bytes",
            "exceptions",
            "corrupt_pages",
            "race_misses",
            "hits",
            "writes",
            "write_failures",
        )
    }
    return {
        "seconds": seconds,
        "processes": processes,
        "capacity_pages": capacity_pages,
        "capacity_bytes": capacity,
        "peak_dir_bytes": peak,
        "left_dir_bytes": left,
        "peak_pages": peak / FileStorage.page_file_bytes(PAGE_BYTES),
        "pages_left": len(on_disk),
        "all_left_indexed": on_disk == indexed,
        **totals,
        "exception_samples": [r["last_exception"] for r in reports if "last_exception" in r][:3],
    }


def ok(report: dict[str, object]) -> bool:
    """Whether a soak report meets issue 17's bar."""
    return (
        report["wrong_bytes"] == 0
        and report["exceptions"] == 0
        and report["corrupt_pages"] == 0
        and int(report["peak_dir_bytes"]) <= int(report["capacity_bytes"])  # pyright: ignore[reportArgumentType]
        and report["all_left_indexed"] is True
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvstrata.storage.soak", description=__doc__)
    parser.add_argument("dir", type=Path, help="an empty directory")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--processes", type=int, default=3)
    parser.add_argument("--capacity-pages", type=int, default=20)
    args = parser.parse_args(argv)
    report = run(
        args.dir.resolve(),
        seconds=args.seconds,
        processes=args.processes,
        capacity_pages=args.capacity_pages,
    )
    print(json.dumps(report))
    return 0 if ok(report) else 1


if __name__ == "__main__":
    sys.exit(main())
