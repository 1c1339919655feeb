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
- a warm-up (a repeat of the first 20 rounds on a throwaway allocator, its figures dropped),
  then `--repeats` repeats of `--rounds` rounds, each on a fresh allocator; `tokens_per_s` and
  `calls_per_s` are medians over repeats; one torch thread; pool of 2,097,152 tokens.

Variants of ours, each measured on the same rounds: `numpy` (the default CPU backend, checked:
the headline figure; its decode round runs compiled when the machine has a C compiler, see
`kvstrata.allocator.native`), `numpy-unchecked` (`checked=False`: what the validation costs),
`numpy-nocompile` (the fused NumPy decode round the compiled one replaces) and `torch` (the
backend CUDA uses, here on CPU).

The peer runs in its own venv (`shared/bench/peer/setup.sh`) as one long-lived subprocess
(`PEER_DRIVER`: it imports `alloc_bench.py` and calls that script's own `make_allocator`,
`one_round` and `check_free_list`, so every timed call is SGLang's and each repeat is exactly
the script's repeat). Repeats are interleaved, A B A B ...: per configuration, after both
sides' warm-ups, repeat r runs every variant of ours once and then the peer once. On a shared
machine the load drifts over seconds, so a pair measured back to back sees nearly the same
load, where "all of ours, then all of the peer's" compared two different moments (one such run
gave 1.73x where the others gave 3.7x). Each line has the medians over repeats
(`tokens_per_s`, `peer_tokens_per_s`, `ratio` = their quotient) and `paired_ratio`, the median
of the per-repeat ratios ours_r / peer_r, with their spread (`paired_ratios`), and
`round_ratio`, the median over every round of every repeat of peer time / our time for that
same round (same lengths, same repeat), with its quartiles: a round during which the process
was preempted spoils one of those pairs, where it spoils a whole repeat's sum.
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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.allocator import PagedAllocator, TokenAllocator
from kvstrata.allocator.engine import Backend
from kvstrata.bench.batch_decode import run_batch_decode
from kvstrata.bench.pageio import run_page_io
from kvstrata.bench.report import emit, environment, pin_threads, ratio
from kvstrata.pool import native

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
    #: Whether the allocator may use the compiled decode round (`kvstrata.allocator.native`).
    compiled: bool = True


VARIANTS: dict[str, Variant] = {
    "numpy": Variant(backend="numpy", checked=True),
    "numpy-unchecked": Variant(backend="numpy", checked=False),
    "numpy-nocompile": Variant(backend="numpy", checked=True, compiled=False),
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
    if not variant.compiled:
        with native.disabled():
            return make_allocator(replace(variant, compiled=True), page_size, pool_tokens)
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
    else:
        held = hold(alloc, page_size, lens - 1)
        n = len(lens)
    # Each timed region holds the one call and its free, nothing else (as the peer's).
    if page_size == 1:
        t0 = clock()
        out = alloc.alloc(n)
        assert out is not None, "the pool is sized so that no round runs out"
        alloc.free(out)
        t1 = clock()
    elif isinstance(lens, ExtendRound):
        prefix = torch.from_numpy(lens.prefix_lens)
        seq = torch.from_numpy(lens.prefix_lens + lens.extend_lens)
        t0 = clock()
        out = alloc.alloc_extend(prefix, seq, held.last_loc, n)
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


class Repeat(NamedTuple):
    """One repeat: `rounds` rounds on a fresh allocator."""

    tokens_per_s: float
    calls_per_s: float
    tokens: int
    #: Timed nanoseconds of each round, in round order.
    round_ns: list[int]


def one_repeat(
    variant: Variant,
    workload: str,
    page_size: int,
    rounds: list[ExtendRound] | list[Ints],
    *,
    pool_tokens: int,
) -> Repeat:
    alloc = make_allocator(variant, page_size, pool_tokens)
    round_ns: list[int] = []
    tokens = 0
    for lens in rounds:
        dt, n = one_round(alloc, page_size, workload, lens)
        round_ns.append(dt)
        tokens += n
    alloc.check_integrity()
    ns = sum(round_ns)
    return Repeat(tokens / (ns / 1e9), len(rounds) / (ns / 1e9), tokens, round_ns)


def summarise(repeats: list[Repeat], num_rounds: int) -> Measurement:
    tok_s = [r.tokens_per_s for r in repeats]
    return Measurement(
        tokens_per_s=statistics.median(tok_s),
        calls_per_s=statistics.median(r.calls_per_s for r in repeats),
        tokens_per_s_repeats=tok_s,
        tokens_per_round=repeats[-1].tokens / num_rounds,
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


#: Runs in the peer's venv with the peer folder as working directory: imports alloc_bench.py
#: once (sglang's import alone takes ~10 s), then answers one JSON request per stdin line.
#: "warm" runs the script's warm-up, "repeat" one repeat exactly as the script's `run()` does
#: (fresh allocator, the script's `one_round` over every round, `check_free_list`).
#: Replies are stdout lines starting with REPLY_TAG; anything else (sglang's import chatter)
#: is skipped by the reader.
PEER_DRIVER = """
import argparse, json, sys
sys.path.insert(0, ".")
import alloc_bench as peer
torch, np = peer.torch, peer.np
TAG = sys.argv[1]
a = argparse.Namespace(pool_tokens=int(sys.argv[2]), kvcache="mha", need_sort=False)
torch.set_num_threads(int(sys.argv[3]))
gen = {"extend": peer.extend_rounds, "decode": peer.decode_rounds}
print(TAG, json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    q = json.loads(line)
    w, p = q["workload"], q["page_size"]
    lens = gen[w](q["seed"], q["rounds"])
    if q["cmd"] == "warm":
        warm = peer.make_allocator(a, p)
        for x in lens[: peer.WARMUP_ROUNDS]:
            peer.one_round(warm, p, w, x)
        del warm
        print(TAG, json.dumps({"warm": True}), flush=True)
        continue
    alloc = peer.make_allocator(a, p)
    ns = tokens = 0
    round_ns = []
    for x in lens:
        dt, n = peer.one_round(alloc, p, w, x)
        ns += dt
        tokens += n
        round_ns.append(dt)
    peer.check_free_list(alloc)
    cls = "TokenToKVPoolAllocator" if p == 1 else "PagedTokenToKVPoolAllocator"
    reply = {
        "impl": "sglang-%s %s" % (peer.peer_env.versions()["sglang"], cls),
        "tokens_per_s": tokens / (ns / 1e9),
        "calls_per_s": len(lens) / (ns / 1e9),
        "use_triton_kernels": getattr(alloc, "use_triton_kernels", False),
        "round_ns": round_ns,
    }
    del alloc
    print(TAG, json.dumps(reply), flush=True)
"""

REPLY_TAG = "@kvstrata-peer"


class PeerError(RuntimeError):
    """The peer process died or answered something else than the protocol."""


class PeerRepeat(NamedTuple):
    impl: str
    tokens_per_s: float
    calls_per_s: float
    round_ns: list[int]


class Peer:
    """The long-lived peer process (see PEER_DRIVER). Not thread-safe; close() when done."""

    def __init__(self, python: Path, peer_dir: Path, *, pool_tokens: int, threads: int) -> None:
        self._proc = subprocess.Popen(
            [str(python), "-c", PEER_DRIVER, REPLY_TAG, str(pool_tokens), str(threads)],
            cwd=peer_dir,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._chatter: list[str] = []
        try:
            self._reply()
        except PeerError:
            self.close()
            raise

    def _reply(self) -> dict[str, Any]:
        out = self._proc.stdout
        assert out is not None, "stdout is a pipe"
        for line in out:
            if line.startswith(REPLY_TAG):
                reply: dict[str, Any] = json.loads(line[len(REPLY_TAG) :])
                return reply
            self._chatter = [*self._chatter[-40:], line]
        tail = "".join(self._chatter)
        raise PeerError(f"the peer exited ({self._proc.wait()}); its last output:\n{tail}")

    def _ask(self, cmd: str, workload: str, page_size: int, seed: int, rounds: int) -> Any:
        request = {"cmd": cmd, "workload": workload, "page_size": page_size}
        inp = self._proc.stdin
        assert inp is not None, "stdin is a pipe"
        inp.write(json.dumps({**request, "seed": seed, "rounds": rounds}) + "\n")
        inp.flush()
        return self._reply()

    def warm(self, workload: str, page_size: int, *, seed: int, rounds: int) -> None:
        self._ask("warm", workload, page_size, seed, rounds)

    def repeat(self, workload: str, page_size: int, *, seed: int, rounds: int) -> PeerRepeat:
        r = self._ask("repeat", workload, page_size, seed, rounds)
        if r.get("use_triton_kernels"):
            raise PeerError("SGLang chose its Triton kernels; this benchmark is for the CPU path")
        round_ns = [int(x) for x in r["round_ns"]]
        return PeerRepeat(
            str(r["impl"]), float(r["tokens_per_s"]), float(r["calls_per_s"]), round_ns
        )

    def close(self) -> None:
        """End the peer (EOF on its stdin) and wait for it."""
        for pipe in (self._proc.stdin, self._proc.stdout):
            if pipe is not None:
                pipe.close()
        self._proc.wait(timeout=60)


def round_ratios(ours: list[Repeat], peer: list[PeerRepeat]) -> list[float]:
    """Peer time / our time of the same round (same lengths) of the same repeat, for every
    round of every repeat: a preempted round spoils one pair, not a whole repeat."""
    return [
        theirs / max(mine, 1)
        for o, p in zip(ours, peer, strict=True)
        for mine, theirs in zip(o.round_ns, p.round_ns, strict=True)
    ]


def make_record(
    args: argparse.Namespace,
    workload: str,
    page_size: int,
    by_variant: dict[str, Measurement],
    peer: list[PeerRepeat] | None,
    peer_note: str,
    head_repeats: list[Repeat] | None = None,
) -> dict[str, Any]:
    """Our line: the first variant's figures as the headline, every variant beside it, and
    the peer's figures, the ratio of medians and the medians of paired ratios (per repeat;
    per round when `head_repeats`, the headline variant's repeats, are given) when it ran."""
    head = next(iter(by_variant.values()))
    peer_tok = statistics.median(r.tokens_per_s for r in peer) if peer else None
    paired = (
        [ours / r.tokens_per_s for ours, r in zip(head.tokens_per_s_repeats, peer, strict=True)]
        if peer
        else None
    )
    record: dict[str, Any] = {
        "impl": f"kvstrata {'TokenAllocator' if page_size == 1 else 'PagedAllocator'}",
        "variant": next(iter(by_variant)),
        "workload": workload,
        "page_size": page_size,
        "tokens_per_s": head.tokens_per_s,
        "calls_per_s": head.calls_per_s,
        "peer_tokens_per_s": peer_tok,
        "peer_calls_per_s": statistics.median(r.calls_per_s for r in peer) if peer else None,
        "ratio": ratio(head.tokens_per_s, peer_tok) if peer_tok else None,
        "paired_ratio": round(statistics.median(paired), 4) if paired else None,
        "paired_ratios": [round(x, 3) for x in paired] if paired else None,
        **round_figures(head_repeats, peer),
        "peer": peer[0].impl if peer else peer_note,
        "order": "interleaved: per repeat, each variant of ours, then the peer",
        "rounds": args.rounds,
        "repeats": args.repeats,
        "stat": "median",
        "batch": EXTEND_BATCH if workload == "extend" else DECODE_BATCH,
        "tokens_per_round": head.tokens_per_round,
        "tokens_per_s_repeats": head.tokens_per_s_repeats,
        "peer_tokens_per_s_repeats": [r.tokens_per_s for r in peer] if peer else None,
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
        # Share of the checked call's time that validation and the page marks cost (the
        # median of the per-repeat shares: the two ran back to back in each repeat).
        checked = by_variant["numpy"].tokens_per_s_repeats
        unchecked = by_variant["numpy-unchecked"].tokens_per_s_repeats
        shares = [1 - c / u for c, u in zip(checked, unchecked, strict=True)]
        record["check_cost"] = round(statistics.median(shares), 4)
    return record


def round_figures(ours: list[Repeat] | None, peer: list[PeerRepeat] | None) -> dict[str, Any]:
    """`round_ratio` (median of `round_ratios`) and its quartiles, when both sides ran."""
    if not ours or not peer:
        return {"round_ratio": None, "round_ratio_quartiles": None}
    ratios = round_ratios(ours, peer)
    if len(ratios) < 2:  # quantiles need two points (--rounds 1 --repeats 1)
        return {
            "round_ratio": round(ratios[0], 4) if ratios else None,
            "round_ratio_quartiles": None,
        }
    q1, q2, q3 = statistics.quantiles(ratios, n=4)
    return {"round_ratio": round(q2, 4), "round_ratio_quartiles": [round(q1, 3), round(q3, 3)]}


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
    ap.add_argument(
        "--no-batch-decode",
        action="store_true",
        help="skip the line of 256 requests decoded in one BatchAllocator call vs 256 calls",
    )
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

    peer: Peer | None = None
    peer_note = "skipped (--no-peer)"
    if not args.no_peer:
        python, peer_dir = find_peer_python(args.peer_python), find_peer_dir(args.peer_dir)
        if python is None or peer_dir is None:
            peer_note = "not found: run shared/bench/peer/setup.sh or pass --peer-python/--peer-dir"
            print(f"note: peer {peer_note}", file=sys.stderr)
        else:
            peer = Peer(python, peer_dir, pool_tokens=args.pool_tokens, threads=args.threads)
    try:
        for workload in workloads:
            for size in page_sizes:
                emit(run_configuration(args, workload, size, variants, peer, peer_note))
    finally:
        if peer is not None:
            peer.close()
    if not args.no_page_io:
        # The pool's page I/O figures, so that one command prints all of issue 3's numbers.
        for record in run_page_io(quick=args.quick):
            emit(record)
    if not args.no_batch_decode:
        # Issue 12: one decode batch call for 256 requests against 256 per-request calls.
        emit(run_batch_decode(quick=args.quick))
    return 0


def run_configuration(
    args: argparse.Namespace,
    workload: str,
    size: int,
    variants: list[str],
    peer: Peer | None,
    peer_note: str,
) -> dict[str, Any]:
    """Warm-ups, then the interleaved repeats (A B A B ...) of one (workload, page size)."""
    rounds: list[ExtendRound] | list[Ints] = (
        extend_rounds(args.seed, args.rounds)
        if workload == "extend"
        else decode_rounds(args.seed, args.rounds)
    )
    for name in variants:
        # The warm-up (as the peer's): a repeat of the first WARMUP_ROUNDS rounds on a throwaway
        # allocator, its figures dropped.
        warm = rounds[:WARMUP_ROUNDS]
        one_repeat(VARIANTS[name], workload, size, warm, pool_tokens=args.pool_tokens)
    if peer is not None:
        peer.warm(workload, size, seed=args.seed, rounds=args.rounds)
    ours: dict[str, list[Repeat]] = {name: [] for name in variants}
    theirs: list[PeerRepeat] = []
    for _ in range(args.repeats):
        for name in variants:
            ours[name].append(
                one_repeat(VARIANTS[name], workload, size, rounds, pool_tokens=args.pool_tokens)
            )
        if peer is not None:
            theirs.append(peer.repeat(workload, size, seed=args.seed, rounds=args.rounds))
    by_variant = {name: summarise(reps, len(rounds)) for name, reps in ours.items()}
    head = ours[variants[0]]
    return make_record(args, workload, size, by_variant, theirs or None, peer_note, head)
