"""The index workload of Dynamo's INDEXER_BENCH method, on a request trace: for each request,
its lookup, then the KV events its instance published while serving it (stored pages, and the
pages its LRU bound evicted). Built once, untimed (`build_op_stream`); replayed against an index
with every op timed (`replay_ops`); and the index's memory per entry measured
(`measure_memory`). `kvstrata bench index` prints these; the Ray bench replays the same stream.

    request r:   find_matches(keys_r)       1 op
                 apply(instance_r, [e])     1 op per event e of r (BlockStored / BlockRemoved)

Besides the timed replay: the same replay untimed (`replay_untimed`: the per-op clock reads are a
tenth of an op here), the floor any CPython dict-based index pays on this machine
(`bare_dict_floor`: the same stream as the bare dict probes it needs, nothing else), and the
floor of the compiled core (`native_floor`: the same stream as bare calls of its C type).
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat, takewhile
from typing import Protocol

import numpy as np

from kvstrata.prefix_index.index import PrefixIndex
from kvstrata.prefix_index.native import native_core
from kvstrata.prefix_index.simulate import SimInstance
from kvstrata.unified_radix_cache import BlockRemoved, BlockStored, KVEvent


@dataclass(frozen=True, kw_only=True)
class RequestOps:
    instance: str
    page_keys: tuple[bytes, ...]
    events: tuple[KVEvent, ...]


@dataclass(frozen=True, kw_only=True)
class OpStream:
    page_size: int
    requests: tuple[RequestOps, ...]

    @property
    def num_ops(self) -> int:
        return sum(1 + len(r.events) for r in self.requests)

    @property
    def num_events(self) -> int:
        return sum(len(r.events) for r in self.requests)


@dataclass(frozen=True, kw_only=True)
class OpTiming:
    ops: int
    pages: int
    seconds: float
    cpu_seconds: float
    p50_us: float
    p99_us: float
    max_us: float
    lookup_p99_us: float
    event_p99_us: float

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds else 0.0

    @property
    def ops_per_cpu_s(self) -> float:
        """Ops per second of this process's own CPU time: on a shared, oversubscribed machine
        the rate per core, without the time other processes held the core."""
        return self.ops / self.cpu_seconds if self.cpu_seconds else 0.0

    @property
    def pages_per_s(self) -> float:
        """Pages looked up or applied per wall second (an op covers ~10-25 pages here)."""
        return self.pages / self.seconds if self.seconds else 0.0


def build_op_stream(
    prompts: Sequence[Sequence[int] | array],
    *,
    num_instances: int = 1,
    capacity_pages: int,
    page_size: int = 1,
) -> OpStream:
    """Serve `prompts` round-robin on `num_instances` LRU-bounded simulated instances and
    record each request's page keys and the events it caused."""
    instances = [
        SimInstance(f"instance-{i}", capacity_pages=capacity_pages, page_size=page_size)
        for i in range(num_instances)
    ]
    keyer = instances[0].tree.keyer
    assert keyer is not None, "SimInstance trees are built with events on"
    out: list[RequestOps] = []
    for i, tokens in enumerate(prompts):
        inst = instances[i % num_instances]
        keys = keyer.page_keys(np.asarray(tokens, dtype=np.int64))
        inst.serve(tokens)
        out.append(
            RequestOps(instance=inst.name, page_keys=tuple(keys), events=tuple(inst.take_events()))
        )
    return OpStream(page_size=page_size, requests=tuple(out))


class Replayable(Protocol):
    """What a replay calls: a `PrefixIndex`, or `NullIndex` (the harness alone)."""

    def find_matches(self, tokens_or_page_keys: Sequence[bytes], /) -> object: ...

    def apply(self, instance: str, events: Iterable[KVEvent], /) -> None: ...


class NullIndex:
    """Does nothing: a replay into it costs what the replay loop and its per-op clock reads
    cost (`harness_ns_per_op`), the part of a timed replay's CPU that is not the index."""

    def find_matches(self, tokens_or_page_keys: Sequence[bytes], /) -> object:
        return None

    def apply(self, instance: str, events: Iterable[KVEvent], /) -> None:
        return None


def replay_ops(index: Replayable, stream: OpStream) -> OpTiming:
    """Replay `stream` into `index`, timing every op (perf_counter_ns around each call). The
    garbage collector is collected before and left on."""
    lookups = array("q")
    events = array("q")
    find, apply = index.find_matches, index.apply
    clock = time.perf_counter_ns
    gc.collect()
    start = time.perf_counter()
    cpu_start = time.process_time()
    for req in stream.requests:
        t0 = clock()
        find(req.page_keys)
        t1 = clock()
        lookups.append(t1 - t0)
        name = req.instance
        for event in req.events:
            t0 = clock()
            apply(name, (event,))
            events.append(clock() - t0)
    seconds = time.perf_counter() - start
    cpu_seconds = time.process_time() - cpu_start
    pages = sum(
        len(r.page_keys) + sum(len(getattr(e, "page_keys", ())) for e in r.events)
        for r in stream.requests
    )
    both = np.concatenate([np.frombuffer(lookups, np.int64), np.frombuffer(events, np.int64)])
    return OpTiming(
        ops=int(both.size),
        pages=pages,
        seconds=seconds,
        cpu_seconds=cpu_seconds,
        p50_us=float(np.percentile(both, 50)) / 1e3,
        p99_us=float(np.percentile(both, 99)) / 1e3,
        max_us=float(both.max()) / 1e3,
        lookup_p99_us=float(np.percentile(np.frombuffer(lookups, np.int64), 99)) / 1e3,
        event_p99_us=float(np.percentile(np.frombuffer(events, np.int64), 99)) / 1e3
        if len(events)
        else 0.0,
    )


def replay_untimed(index: Replayable, stream: OpStream) -> float:
    """Replay `stream` into `index` with no per-op clock; returns this process's CPU seconds."""
    find, apply = index.find_matches, index.apply
    gc.collect()
    cpu_start = time.process_time()
    for req in stream.requests:
        find(req.page_keys)
        name = req.instance
        for event in req.events:
            apply(name, (event,))
    return time.process_time() - cpu_start


def bare_dict_floor(stream: OpStream) -> float:
    """CPU seconds of the stream as bare dict probes, no index logic: a lookup reads keys up
    to the first miss, a store writes its keys, a removal pops them (one dict, one holder).
    What a CPython index keyed by these keys cannot go below: on a large dict each probe is a
    few cache misses (key slot, entry, key object)."""
    table: dict[bytes, int] = {}
    get, pop = table.get, table.pop
    gc.collect()
    cpu_start = time.process_time()
    for req in stream.requests:
        deque(takewhile(bool, map(get, req.page_keys, repeat(0))), maxlen=0)
        for event in req.events:
            if isinstance(event, BlockStored):
                table.update(dict.fromkeys(event.page_keys, 3))
            elif isinstance(event, BlockRemoved):
                deque(map(pop, event.page_keys, repeat(None)), maxlen=0)
    return time.process_time() - cpu_start


def native_floor(stream: OpStream) -> tuple[int, float] | None:
    """(ops, CPU seconds) of the stream as bare calls of the compiled core: each lookup one
    `match_count` (no result objects) and each event one `apply_keys` (no event objects, no
    validation but the keys', no instance names): what the native index cannot go below on
    this machine. None without the compiled core."""
    first = next((k for r in stream.requests for k in r.page_keys), None)
    core = native_core(len(first), {"device": 1}, None) if first is not None else None
    if core is None:
        return None
    ops: list[tuple[int, tuple[bytes, ...]]] = []
    for req in stream.requests:
        ops.append((-1, req.page_keys))
        ops.extend(
            (int(isinstance(e, BlockRemoved)), e.page_keys)
            for e in req.events
            if isinstance(e, BlockStored | BlockRemoved)
        )
    match, apply_keys = core.match_count, core.apply_keys
    gc.collect()
    cpu_start = time.process_time()
    for kind, keys in ops:
        if kind < 0:
            match(keys)
        else:
            apply_keys(0, kind, 1, keys)
    return len(ops), time.process_time() - cpu_start


@dataclass(frozen=True, kw_only=True)
class LookupCost:
    """CPU ns of one dict probe with a key object other than the stored one (as a query's
    keys are), on a dict of `small_entries` (cache-resident) and of `large_entries` keys."""

    small_entries: int
    small_ns: float
    large_entries: int
    large_ns: float


def dict_lookup_cost(stream: OpStream, *, probes: int = 100_000) -> LookupCost:
    """Random probes of 256 keys and of every key the stream stores: how far the memory
    hierarchy of this machine (shared, contended) slows a probe once the index outgrows the
    caches."""
    keys: list[bytes] = []
    for req in stream.requests:
        for event in req.events:
            if isinstance(event, BlockStored):
                keys.extend(event.page_keys)
    keys = sorted(set(keys))
    rng = np.random.default_rng(0)

    def cost(pool: list[bytes]) -> float:
        table = dict.fromkeys(pool, 3)
        picks = rng.integers(0, len(pool), size=probes)
        query = [bytes(bytearray(pool[i])) for i in picks]
        best = float("inf")
        for _ in range(3):
            start = time.process_time()
            deque(map(table.get, query, repeat(0)), maxlen=0)
            best = min(best, time.process_time() - start)
        return best / probes * 1e9

    small = keys[:256]
    return LookupCost(
        small_entries=len(small),
        small_ns=cost(small),
        large_entries=len(keys),
        large_ns=cost(keys),
    )


@dataclass(frozen=True, kw_only=True)
class MemoryFigures:
    """Traced bytes of an index holding `num_entries` keys, once by one instance and once by
    two (every key held twice): `bytes_per_entry` is the cost of a key held by one instance,
    `bytes_per_extra_holder` what each further holder of a key adds. On the native core the
    bytes its C code allocated (`PrefixIndex.native_bytes`, capacity included) are added to
    what tracemalloc sees of the Python side."""

    core: str
    num_entries: int
    one_holder_bytes: int
    two_holder_bytes: int

    @property
    def bytes_per_entry(self) -> float:
        return self.one_holder_bytes / self.num_entries if self.num_entries else 0.0

    @property
    def bytes_per_extra_holder(self) -> float:
        extra = self.two_holder_bytes - self.one_holder_bytes
        return extra / self.num_entries if self.num_entries else 0.0


def measure_memory(stream: OpStream, *, max_entries: int | None = None) -> MemoryFigures:
    """Build an index from every stored key of `stream` (fresh key objects, as a decoder makes
    them) under tracemalloc, then add a second holder of every key. The index gets the core
    `PrefixIndex` picks (inside `kvstrata.pool.native.disabled()`: the Python one)."""
    keys: set[bytes] = set()
    for req in stream.requests:
        for event in req.events:
            if isinstance(event, BlockStored):
                keys.update(event.page_keys)
    ordered = sorted(keys)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        index = PrefixIndex(stream.page_size, max_entries=max_entries)
        # bytes(bytearray(k)) forces a new key object, owned by the index from here on.
        fresh = tuple(bytes(bytearray(k)) for k in ordered)
        stored = BlockStored(page_keys=fresh, parent_key=None, tokens_per_page=stream.page_size)
        index.apply("holder-a", [stored])
        del fresh, stored
        gc.collect()
        one = tracemalloc.get_traced_memory()[0] - base + index.native_bytes()
        index.apply(
            "holder-b",
            [
                BlockStored(
                    page_keys=tuple(ordered), parent_key=None, tokens_per_page=stream.page_size
                )
            ],
        )
        gc.collect()
        two = tracemalloc.get_traced_memory()[0] - base + index.native_bytes()
    finally:
        tracemalloc.stop()
    assert len(index) == len(ordered)
    return MemoryFigures(
        core=index.core, num_entries=len(ordered), one_holder_bytes=one, two_holder_bytes=two
    )
