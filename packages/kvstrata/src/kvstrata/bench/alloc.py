"""`kvstrata bench alloc`: our slot allocators against SGLang 0.5.23's, same workloads, same run.

The workloads are those of `shared/bench/peer/alloc_bench.py` (its docstring is normative),
reproduced number for number:

- lengths: a fresh `numpy.random.default_rng(seed)` per (workload, page size, repeat), drawing
  per round extend `prefix = integers(0, 2048, 64, endpoint=True)` then `extend =
  integers(1, 512, 64, endpoint=True)`, or decode `seq = integers(1, 4096, 256, endpoint=True)`;
- untimed setup: each request allocates its prefix (`ceil(n / P) * P` slots), giving `last_loc`
  (-1 for an empty prefix: our allocator ignores entries it does not need);
- timed: from just before the batch call to just after `free(out)` returns: page size 1
  `alloc(sum(extend))` / `alloc(256)` on a `TokenAllocator`, else `alloc_extend(prefix, seq,
  last_loc, sum(extend))` / `alloc_decode(seq, last_loc)` on a `PagedAllocator`;
- untimed teardown: free each request's first `floor(prefix / P)` pages; the pool must be full
  again (checked every round; `check_integrity()` after every repeat);
- 20 untimed warm-up rounds on a throwaway allocator, then `--repeats` repeats of `--rounds`
  rounds, each on a fresh allocator; `tokens_per_s` and `calls_per_s` are medians over repeats;
  one torch thread; pool of 2,097,152 tokens.

Variants of ours, each measured on the same rounds: `numpy` (the default CPU backend, checked:
the headline figure), `numpy-unchecked` (`checked=False`: what the validation costs) and
`torch` (the backend CUDA uses, here on CPU). The peer runs as a subprocess of its own venv
(`shared/bench/peer/setup.sh`) right after ours on each configuration, so both see the same
load; its figures are added as `peer_tokens_per_s` and `ratio` (ours / peer).
Then the page I/O lines of `kvstrata.bench.pageio.run_page_io` (pool page read/write against a
plain copy of the same bytes; `--no-page-io` skips them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.allocator import PagedAllocator, TokenAllocator
from kvstrata.allocator.engine import Backend
from kvstrata.bench.pageio import run_page_io
from kvstrata.bench.report import emit, environment, pin_threads, ratio

__all__ = ["main"]

EXTEND_BATCH, EXTEND_PREFIX_MAX, EXTEND_LEN_MAX = 64, 2048, 512
DECODE_BATCH, DECODE_SEQ_MAX = 256, 4096
WARMUP_ROUNDS = 20
POOL_TOKENS = 2 * 1024 * 1024
DEFAULT_PEER_VENV = Path("/tmp/kvstrata-peer")
DESCRIPTION = "Slot allocators against SGLang 0.5.23's on the peer workloads, in one run."

Ints = npt.NDArray[np.int64]


@dataclass(frozen=True, kw_only=True)
class Variant:
    backend: Backend
    checked: bool


VARIANTS: dict[str, Variant] = {
    "numpy": Variant(backend="numpy", checked=True),
    "numpy-unchecked": Variant(backend="numpy", checked=False),
    "torch": Variant(backend="torch", checked=True),
}


class ExtendRound(NamedTuple):
    prefix_lens: Ints
    extend_lens: Ints


class Measurement(NamedTuple):
    tokens_per_s: float
    calls_per_s: float
    tokens_per_s_repeats: list[float]
    tokens_per_round: float


def extend_rounds(seed: int, rounds: int) -> list[ExtendRound]:
    rng = np.random.default_rng(seed)
    out: list[ExtendRound] = []
    for _ in range(rounds):
        prefix = rng.integers(0, EXTEND_PREFIX_MAX, size=EXTEND_BATCH, endpoint=True)
        ext = rng.integers(1, EXTEND_LEN_MAX, size=EXTEND_BATCH, endpoint=True)
        out.append(ExtendRound(prefix.astype(np.int64), ext.astype(np.int64)))
    return out


def decode_rounds(seed: int, rounds: int) -> list[Ints]:
    rng = np.random.default_rng(seed)
    return [
        rng.integers(1, DECODE_SEQ_MAX, size=DECODE_BATCH, endpoint=True).astype(np.int64)
        for _ in range(rounds)
    ]


def make_allocator(variant: Variant, page_size: int, pool_tokens: int) -> PagedAllocator:
    if page_size == 1:
        return TokenAllocator(size=pool_tokens, checked=variant.checked, backend=variant.backend)
    return PagedAllocator(
        size=pool_tokens, page_size=page_size, checked=variant.checked, backend=variant.backend
    )


class Held(NamedTuple):
    last_loc: torch.Tensor
    #: Slots of each request's full prefix pages: what the timed free does not release.
    keep: list[torch.Tensor]


def hold(alloc: PagedAllocator, page_size: int, held_lens: Ints) -> Held:
    """Untimed setup: request i allocates `held_lens[i]` slots (whole pages)."""
    last_loc = np.full(len(held_lens), -1, dtype=np.int64)
    keep: list[torch.Tensor] = []
    for i, n in enumerate(held_lens.tolist()):
        if n == 0:
            continue
        idx = alloc.alloc(-(-n // page_size) * page_size)
        if idx is None:
            raise RuntimeError(f"pool exhausted in setup ({alloc.size} tokens)")
        last_loc[i] = int(idx[n - 1])
        full = (n // page_size) * page_size
        if full:
            keep.append(idx[:full])
    return Held(torch.from_numpy(last_loc), keep)


def one_round(
    alloc: PagedAllocator, page_size: int, workload: str, lens: ExtendRound | Ints
) -> tuple[int, int]:
    """One round; returns (timed ns, slots allocated in the timed call)."""
    clock = time.perf_counter_ns
    if isinstance(lens, ExtendRound):
        held = hold(alloc, page_size, lens.prefix_lens)
        n = int(lens.extend_lens.sum())
        if page_size == 1:
            t0 = clock()
            out = alloc.alloc(n)
            assert out is not None, "the pool is sized so that no round runs out"
            alloc.free(out)
            t1 = clock()
        else:
            prefix = torch.from_numpy(lens.prefix_lens)
            seq = torch.from_numpy(lens.prefix_lens + lens.extend_lens)
            t0 = clock()
            out = alloc.alloc_extend(prefix, seq, held.last_loc, n)
            assert out is not None, "the pool is sized so that no round runs out"
            alloc.free(out)
            t1 = clock()
    else:
        held = hold(alloc, page_size, lens - 1)
        n = len(lens)
        if page_size == 1:
            t0 = clock()
            out = alloc.alloc(n)
            assert out is not None, "the pool is sized so that no round runs out"
            alloc.free(out)
            t1 = clock()
        else:
            seq = torch.from_numpy(lens)
            t0 = clock()
            out = alloc.alloc_decode(seq, held.last_loc)
            assert out is not None, "the pool is sized so that no round runs out"
            alloc.free(out)
            t1 = clock()
    if out.numel() != n:
        raise RuntimeError(f"{workload}: {out.numel()} slots for {n} tokens")
    if held.keep:
        alloc.free(torch.cat(held.keep))
    if alloc.available_size() != alloc.size:
        raise RuntimeError(f"{workload} P={page_size}: pool not full after a round")
    return t1 - t0, n


def measure(
    variant: Variant,
    workload: str,
    page_size: int,
    rounds: list[ExtendRound] | list[Ints],
    *,
    repeats: int,
    pool_tokens: int,
) -> Measurement:
    warm = make_allocator(variant, page_size, pool_tokens)
    for lens in rounds[:WARMUP_ROUNDS]:
        one_round(warm, page_size, workload, lens)
    del warm
    tok_s: list[float] = []
    call_s: list[float] = []
    tokens = 0
    for _ in range(repeats):
        alloc = make_allocator(variant, page_size, pool_tokens)
        ns = tokens = 0
        for lens in rounds:
            dt, n = one_round(alloc, page_size, workload, lens)
            ns += dt
            tokens += n
        alloc.check_integrity()
        tok_s.append(tokens / (ns / 1e9))
        call_s.append(len(rounds) / (ns / 1e9))
    return Measurement(
        tokens_per_s=statistics.median(tok_s),
        calls_per_s=statistics.median(call_s),
        tokens_per_s_repeats=tok_s,
        tokens_per_round=tokens / len(rounds),
    )


# ---- the peer -------------------------------------------------------------------------------


def find_peer_dir(explicit: str | None) -> Path | None:
    """`--peer-dir`, else `<workspace>/../shared/bench/peer` above this file."""
    if explicit:
        return Path(explicit)
    for parent in Path(__file__).resolve().parents:
        if (parent / "uv.lock").is_file() and (parent / "packages").is_dir():
            candidate = parent.parent / "shared" / "bench" / "peer"
            return candidate if (candidate / "alloc_bench.py").is_file() else None
    return None


def find_peer_python(explicit: str | None) -> Path | None:
    if explicit:
        return Path(explicit)
    venv = os.environ.get("PEER_VENV")
    candidate = (Path(venv) if venv else DEFAULT_PEER_VENV) / "bin" / "python"
    return candidate if candidate.exists() else None


def run_peer(
    python: Path, peer_dir: Path, args: argparse.Namespace, workload: str, page_size: int
) -> dict[str, Any] | None:
    """Run the peer script on one configuration; its JSON record, or None if it failed."""
    cmd = [
        str(python),
        str(peer_dir / "alloc_bench.py"),
        f"--rounds={args.rounds}",
        f"--repeats={args.repeats}",
        f"--page-sizes={page_size}",
        f"--workloads={workload}",
        f"--seed={args.seed}",
        f"--pool-tokens={args.pool_tokens}",
        f"--threads={args.threads}",
    ]
    done = subprocess.run(cmd, cwd=peer_dir, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(f"peer failed ({done.returncode}): {done.stderr[-2000:]}", file=sys.stderr)
        return None
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record: dict[str, Any] = json.loads(line)
            return record
    print(f"peer printed no record: {done.stdout[-2000:]}", file=sys.stderr)
    return None


def make_record(
    args: argparse.Namespace,
    workload: str,
    page_size: int,
    by_variant: dict[str, Measurement],
    peer: dict[str, Any] | None,
    peer_note: str,
) -> dict[str, Any]:
    """Our line: the first variant's figures as the headline, every variant beside it, and
    the peer's figures and ratio when it ran."""
    head = next(iter(by_variant.values()))
    peer_tok: float | None = peer["tokens_per_s"] if peer else None
    record: dict[str, Any] = {
        "impl": f"kvstrata {'TokenAllocator' if page_size == 1 else 'PagedAllocator'}",
        "variant": next(iter(by_variant)),
        "workload": workload,
        "page_size": page_size,
        "tokens_per_s": head.tokens_per_s,
        "calls_per_s": head.calls_per_s,
        "peer_tokens_per_s": peer_tok,
        "peer_calls_per_s": peer["calls_per_s"] if peer else None,
        "ratio": ratio(head.tokens_per_s, peer_tok) if peer_tok else None,
        "peer": peer["impl"] if peer else peer_note,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "stat": "median",
        "batch": EXTEND_BATCH if workload == "extend" else DECODE_BATCH,
        "tokens_per_round": head.tokens_per_round,
        "tokens_per_s_repeats": head.tokens_per_s_repeats,
        "peer_tokens_per_s_repeats": peer["tokens_per_s_repeats"] if peer else None,
        "variants": {
            name: {
                "tokens_per_s": m.tokens_per_s,
                "calls_per_s": m.calls_per_s,
                "ratio": ratio(m.tokens_per_s, peer_tok) if peer_tok else None,
            }
            for name, m in by_variant.items()
        },
        **environment(),
    }
    if "numpy" in by_variant and "numpy-unchecked" in by_variant:
        # Share of the checked call's time that validation and the page marks cost.
        checked = by_variant["numpy"].tokens_per_s
        unchecked = by_variant["numpy-unchecked"].tokens_per_s
        record["check_cost"] = round(1 - checked / unchecked, 4)
    return record


# ---- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="kvstrata bench alloc", description=DESCRIPTION)
    ap.add_argument("--rounds", type=int, help="rounds per repeat (default 200; --quick 20)")
    ap.add_argument("--repeats", type=int, help="repeats (default 5; --quick 1)")
    ap.add_argument("--page-sizes", default="1,16,64")
    ap.add_argument("--workloads", default="extend,decode")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="of: " + ", ".join(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pool-tokens", type=int, default=POOL_TOKENS)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (peer too)")
    ap.add_argument("--quick", action="store_true", help="fewer rounds and repeats: a smoke run")
    ap.add_argument("--no-peer", action="store_true", help="skip the SGLang peer")
    ap.add_argument("--peer-python", help="peer venv python (default $PEER_VENV/bin/python)")
    ap.add_argument("--peer-dir", help="folder of alloc_bench.py (default: found from here)")
    ap.add_argument("--no-page-io", action="store_true", help="skip the page I/O lines")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 20 if args.quick else 200
    if args.repeats is None:
        args.repeats = 1 if args.quick else 5
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    pin_threads(args.threads)
    page_sizes = [int(p) for p in args.page_sizes.split(",")]
    workloads = args.workloads.split(",")
    variants = args.variants.split(",")
    for name in variants:
        if name not in VARIANTS:
            print(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}", file=sys.stderr)
            return 2
    for workload in workloads:
        if workload not in ("extend", "decode"):
            print(f"unknown workload {workload!r}", file=sys.stderr)
            return 2
    for size in page_sizes:
        if size < 1 or args.pool_tokens % size:
            print(f"page size {size} must be >= 1 and divide --pool-tokens", file=sys.stderr)
            return 2

    python: Path | None = None
    peer_dir: Path | None = None
    peer_note = "skipped (--no-peer)"
    if not args.no_peer:
        python, peer_dir = find_peer_python(args.peer_python), find_peer_dir(args.peer_dir)
        if python is None or peer_dir is None:
            peer_note = "not found: run shared/bench/peer/setup.sh or pass --peer-python/--peer-dir"
            print(f"note: peer {peer_note}", file=sys.stderr)
        else:
            peer_note = "failed (see stderr)"

    for workload in workloads:
        rounds: list[ExtendRound] | list[Ints] = (
            extend_rounds(args.seed, args.rounds)
            if workload == "extend"
            else decode_rounds(args.seed, args.rounds)
        )
        for size in page_sizes:
            by_variant = {
                name: measure(
                    VARIANTS[name],
                    workload,
                    size,
                    rounds,
                    repeats=args.repeats,
                    pool_tokens=args.pool_tokens,
                )
                for name in variants
            }
            # The peer runs right after ours on the same configuration, so that both see
            # the same load on a shared machine.
            peer = None
            if python is not None and peer_dir is not None:
                peer = run_peer(python, peer_dir, args, workload, size)
            emit(make_record(args, workload, size, by_variant, peer, peer_note))
    if not args.no_page_io:
        # The pool's page I/O figures, so that one command prints all of issue 3's numbers.
        for record in run_page_io(quick=args.quick):
            emit(record)
    return 0
