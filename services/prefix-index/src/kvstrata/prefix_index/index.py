"""`PrefixIndex`: page key -> which instances hold it, on which tiers.

Two cores hold the entries, with the same API, answers and errors: the compiled one (`native`:
a CPython extension module built from `index_core.c`, `index_convert.c` and `index_ext.c`, the
default where a C compiler and the Python headers exist; `KVSTRATA_NATIVE=0` turns it off) and
the Python one below (whose dict, key sets and packed ints then stay empty). On the native core
`apply`, `find_matches` and `match_lengths` are the C type's methods (validation included);
instance names and ids, sequences and dumps stay here for both.

Keys are the chained page keys of `kvstrata.storage.PageKeyer` (key_i names the whole prefix up
to page i), so the index is a flat map, not a tree: the longest cached prefix of a prompt on an
instance is the longest run of its keys, from the first, that the instance holds.

    _holders:  key -> packed int: per instance id i, a group of W = 1 + tiers bits at i * W:
               bit 0 "holds the key", then one bit per tier, best first
               (OrderedDict when bounded: least recently matched first)
    _by_inst:  instance id -> set of its keys       (drop / clear of one instance in O(its keys))
    _seq:      instance name -> next expected batch sequence number

Instance names are interned to small ids (a dropped instance's id is reused, smallest first,
so the packed ints stay as short as the live instances allow). A lookup is a running AND of
the packed ints of the query's keys: the "holds" bits left set at depth d are the instances
whose run reaches d, so many instances sharing a prefix cost one AND per page, not one dict
probe per instance and page. Feeding and lookups run their per-page loops in C (map, zip,
dict.update, set.update, accumulate): no Python bytecode per page on the common paths.

Bounded memory: with `max_entries`, inserting a new key when full evicts the least recently
matched key (all its holders). `find_matches` touches the matched keys deepest first, so among
the keys of one prefix the first page is the most recent: eviction takes a prefix's tail before
its head (a head evicted first would orphan its whole tail, since matches start at page 0).

One call at a time (`guard`): a call made from Python code another call runs (a finalizer, a
key's `__hash__`, an event's attribute) or from another thread raises `ReentrantCall` before it
changes anything, on both cores; the plain reads (`stats`, `len`, `instances`...) answer.

Costs: `apply` O(pages of the events); `find_matches` O(pages matched) plus O(pages matched) per
instance whose pages are not all on one tier; `drop_instance` O(keys of the instance). Measured
(`kvstrata bench index`) bytes per entry and ops/s are in the member README.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import reduce
from itertools import accumulate, compress, repeat, takewhile
from operator import and_, not_, or_, rshift

import numpy.typing as npt

from kvstrata.prefix_index.engines import EngineKeyMap, decode_engine_batch
from kvstrata.prefix_index.errors import (
    InvalidEvent,
    InvalidInstance,
    InvalidParameter,
    ReentrantCall,
)
from kvstrata.prefix_index.guard import Guard
from kvstrata.prefix_index.native import Core, check_core, native_core
from kvstrata.prefix_index.results import InstanceMatch, PrefixMatches
from kvstrata.prefix_index.tiers import DEFAULT_TIER_WEIGHTS
from kvstrata.storage import PageKeyer
from kvstrata.unified_radix_cache import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(frozen=True, kw_only=True)
class EngineBatchResult:
    """What one engine batch did: kvstrata events applied, events of unknown type skipped (by
    tag), and the instance's running count of blocks skipped for an unknown parent."""

    applied_events: int
    unknown: Mapping[str, int]
    orphan_blocks: int


@dataclass(frozen=True, kw_only=True)
class IndexStats:
    num_entries: int
    num_instances: int
    num_pairs: int
    evicted_entries: int
    gaps: int
    max_entries: int | None


class PrefixIndex:
    """Page key -> set of (instance, tier), fed by kvstrata KV events.

    `page_size`: tokens per page of every instance feeding this index (events with another
    `tokens_per_page` are refused: their keys could never match a query keyed at this size).
    `keyer`: turns tokens into keys for queries given as token ids; built for `page_size` when
    None (it must be configured like the instances' keyers: namespace and hash).
    `tier_weights`: weight of a page per tier for `score`; events on a tier absent from it are
    refused. `max_entries`: bound on distinct keys (None: unbounded).

    Every method that changes or walks entries raises `ReentrantCall`, before any change, when
    called while another call of the same index runs (from a finalizer or other Python code
    that call runs, or from another thread); the counters (`stats`, `len`, `instances`) are
    plain reads, answered at any time.
    """

    def __init__(
        self,
        page_size: int,
        *,
        keyer: PageKeyer | None = None,
        tier_weights: Mapping[str, float] | None = None,
        max_entries: int | None = None,
    ) -> None:
        if page_size < 1:
            raise InvalidParameter(f"page_size must be >= 1, got {page_size}")
        if keyer is not None and keyer.page_size != page_size:
            raise InvalidParameter(f"keyer page size {keyer.page_size} != index {page_size}")
        weights = dict(DEFAULT_TIER_WEIGHTS if tier_weights is None else tier_weights)
        if not weights or any(w < 0 for w in weights.values()) or len(weights) > 12:
            raise InvalidParameter(f"tier weights must be 1..12 non-negative values: {weights}")
        if max_entries is not None and max_entries < 1:
            raise InvalidParameter(f"max_entries must be >= 1 or None, got {max_entries}")
        self.page_size = page_size
        self.keyer = keyer if keyer is not None else PageKeyer(page_size=page_size)
        self.max_entries = max_entries
        self.tier_weights: dict[str, float] = weights
        # One group of bits per instance: bit 0 "holds the key", then one bit per tier, best
        # tier first (so the lowest tier bit of a group names its best tier).
        ordered = sorted(weights, key=lambda t: -weights[t])
        self._width = len(ordered) + 1
        self._group = (1 << self._width) - 1
        self._tier_bit: dict[str, int] = {t: 2 << i for i, t in enumerate(ordered)}
        self._all_tiers = self._group ^ 1
        # Per group value: its best tier ("" without one) and its set of tiers.
        self._best_tier: tuple[str, ...] = tuple(
            ordered[((g >> 1) & -(g >> 1)).bit_length() - 1] if g >> 1 else ""
            for g in range(self._group + 1)
        )
        self._tier_sets: tuple[frozenset[str], ...] = tuple(
            frozenset(t for t, b in self._tier_bit.items() if g & b) for g in range(self._group + 1)
        )
        # key -> packed groups of its holders (insertion order = least recently matched first
        # when bounded: an OrderedDict then, for O(1) move_to_end / popitem(last=False)).
        self._holders: dict[bytes, int] = OrderedDict() if max_entries is not None else {}
        self._by_inst: dict[int, set[bytes]] = {}
        self._ids: dict[str, int] = {}
        self._names: dict[int, str] = {}
        self._free_ids: list[int] = []  # ids of dropped instances, reused smallest first
        self._next_id = 0
        self._present = 0  # the "holds" bit of every id handed out so far
        self._below_best = 0  # the bits of every tier but the best, of every id handed out
        self._seq: dict[str, int] = {}
        self._awaiting_dump: set[str] = set()
        self._engine_maps: dict[str, EngineKeyMap] = {}
        self._evicted = 0
        # The entries in C when the compiled core is available (see `native`): the dict, the
        # key sets and the packed ints above then stay empty.
        self._core: Core | None = native_core(
            self.keyer.key_bytes,
            {t: 1 << i for i, t in enumerate(ordered)},
            max_entries,
            page_size=page_size,
            ids=self._ids,
            intern=self._intern,
            as_keys=self._as_keys,
        )
        # `with self._guard:` holds the index for a method (see `guard`); the Python core's
        # hot paths test and set `self._flag.busy` inline.
        self._flag = Guard()
        self._guard: Core | Guard = self._flag if self._core is None else self._core
        self.gaps = 0
        self.unknown_engine_events = 0
        if self._core is not None:
            # The hot calls go straight to the C core's methods (same positional-only
            # signatures, answers and errors as the methods below, which then only delegate):
            # no Python frame per call. A subclass's override keeps its own method.
            fast = {
                "apply": self._core.apply,
                "find_matches": self._core.find_matches,
                "match_lengths": self._core.lengths,
            }
            for name, call in fast.items():
                if getattr(type(self), name) is getattr(PrefixIndex, name):
                    self.__dict__[name] = call

    # ------------------------------------------------------------------------------------------
    # Feeding
    # ------------------------------------------------------------------------------------------
    def apply(self, instance: str, events: Iterable[KVEvent], /) -> None:
        """Apply `instance`'s events in order. Mutates the entries of that instance (and, when
        bounded, may evict other keys). Raises InvalidInstance / InvalidEvent, before any
        change, for a bad name, an unknown event, a tier absent from the weights or a page size
        other than the index's; ReentrantCall inside another call of the index."""
        if self._core is not None:  # the C core guards, validates and applies in one call
            self._core.apply(instance, events)
            return
        guard = self._flag
        if guard.busy:
            raise ReentrantCall
        guard.busy = True
        try:
            self._apply_python(instance, events)
        finally:
            guard.busy = False

    def _apply_held(self, instance: str, events: Iterable[KVEvent]) -> None:
        """`apply` from a method that holds the guard."""
        if self._core is not None:
            self._core.apply_held(instance, events)
        else:
            self._apply_python(instance, events)

    def _apply_python(self, instance: str, events: Iterable[KVEvent]) -> None:
        iid = self._ids.get(instance) if type(instance) is str else None
        if iid is None:
            self._check_instance(instance)
        batch = events if type(events) is tuple or type(events) is list else list(events)
        self._check_events(batch)
        if iid is None:
            iid = self._intern(instance)
        tier_bit = self._tier_bit
        for event in batch:
            if isinstance(event, BlockStored):
                self._store(iid, event.page_keys, tier_bit[event.tier])
            elif isinstance(event, BlockRemoved):
                self._remove(iid, event.page_keys, tier_bit[event.tier])
            else:
                tier = event.tier
                bits = self._all_tiers if tier is None else tier_bit[tier]
                self._remove(iid, list(self._by_inst[iid]), bits)

    def apply_engine_batch(
        self, instance: str, payload: bytes, format: str = "vllm", *, group: int = 0
    ) -> EngineBatchResult:
        """Decode a vLLM or SGLang msgpack EventBatch and apply it as `instance`'s events, keys
        re-derived from the token ids with this index's keyer (see `engines`). `group`: the
        KV-cache group indexed for hybrid models. Raises UnknownFormat / EngineDecodeError /
        InvalidEvent before any change."""
        self._check_instance(instance)
        with self._guard:
            decoded = decode_engine_batch(payload, format)
            for event in decoded.events:
                tier = getattr(event, "tier", None)
                if tier is not None:
                    self._check_tier(tier)
            keymap = self._engine_maps.get(instance)
            if keymap is None:
                keymap = self._engine_maps[instance] = EngineKeyMap(self.keyer, group=group)
            events = keymap.convert(decoded.events)
            self._apply_held(instance, events)
            self.unknown_engine_events += sum(decoded.unknown.values())
        return EngineBatchResult(
            applied_events=len(events),
            unknown=decoded.unknown,
            orphan_blocks=keymap.orphan_blocks,
        )

    def apply_sequenced(self, instance: str, seq: int, events: Iterable[KVEvent]) -> bool:
        """Apply batch number `seq` of `instance` if it is the next one expected (0 first).

        A gap (a batch lost) drops every entry of the instance, counts it in `gaps` and marks
        the instance as awaiting a dump; until `load_dump` arrives, later batches are ignored.
        Returns whether the batch was applied. A batch older than expected (a duplicate) is
        ignored. Validation errors are raised before any change, gap or not."""
        self._check_instance(instance)
        with self._guard:
            batch = list(events)
            self._check_events(batch)
            if seq < 0:
                raise InvalidEvent(f"sequence numbers start at 0, got {seq}")
            if instance in self._awaiting_dump:
                return False
            expected = self._seq.get(instance, 0)
            if seq < expected:
                return False
            if seq > expected:
                self.gaps += 1
                self._drop(instance)
                self._awaiting_dump.add(instance)
                return False
            self._apply_held(instance, batch)
            self._seq[instance] = seq + 1
            return True

    def needs_dump(self, instance: str) -> bool:
        """True after a gap in `instance`'s sequence until `load_dump` is called."""
        return instance in self._awaiting_dump

    def load_dump(self, instance: str, events: Iterable[KVEvent], next_seq: int) -> None:
        """Replace `instance`'s entries by a dump of its whole cache (`BlockStored` events, see
        `dump_tree`), taken just before its batch `next_seq`. Clears the awaiting-dump mark."""
        self._check_instance(instance)
        with self._guard:
            batch = list(events)
            self._check_events(batch)
            if next_seq < 0:
                raise InvalidEvent(f"sequence numbers start at 0, got {next_seq}")
            self._drop(instance)
            self._apply_held(instance, batch)
            self._seq[instance] = next_seq
            self._awaiting_dump.discard(instance)

    def drop_instance(self, instance: str) -> int:
        """Forget `instance` (dead engine, node gone): its entries, sequence and dump state.
        Returns how many (key, instance) pairs went. Unknown instances are a no-op (0)."""
        self._check_instance(instance)
        with self._guard:
            removed = self._drop(instance)
            self._engine_maps.pop(instance, None)
            self._seq.pop(instance, None)
            self._awaiting_dump.discard(instance)
            iid = self._ids.pop(instance, None)
            if iid is not None:
                del self._names[iid]
                del self._by_inst[iid]
                if self._core is not None:
                    self._core.set_name(iid, None)
                heapq.heappush(self._free_ids, iid)  # its bits are clear in every entry now
            return removed

    # ------------------------------------------------------------------------------------------
    # Queries
    # ------------------------------------------------------------------------------------------
    def page_keys(
        self,
        tokens: npt.ArrayLike,
        *,
        extra_key: str | None = None,
        cache_salt: str | None = None,
    ) -> list[bytes]:
        """Keys of the whole pages of `tokens` in namespace (`extra_key`, `cache_salt`)."""
        return self.keyer.page_keys(tokens, extra_key=extra_key, cache_salt=cache_salt)

    def find_matches(
        self,
        tokens_or_page_keys: Sequence[bytes] | npt.ArrayLike,
        /,
        *,
        extra_key: str | None = None,
        cache_salt: str | None = None,
    ) -> PrefixMatches:
        """Per instance, the longest run of consecutive pages from the first that it holds,
        with the best tier of each page. Page keys (a sequence of bytes) are used as they are
        (they already fold in their namespace); token ids are keyed with `keyer` in the
        namespace (`extra_key`, `cache_salt`). Touches the matched keys (bounded mode)."""
        if self._core is not None:  # one C call, the result tuples built there
            return self._core.find_matches(
                tokens_or_page_keys, extra_key=extra_key, cache_salt=cache_salt
            )
        guard = self._flag
        if guard.busy:
            raise ReentrantCall
        guard.busy = True
        try:
            keys = self._as_keys(tokens_or_page_keys, extra_key, cache_salt)
            return self._find_python(keys)
        finally:
            guard.busy = False

    def _find_python(self, keys: Sequence[bytes]) -> PrefixMatches:
        vals, runs, uniform = self._runs(keys)
        if not uniform and not reduce(or_, vals, 0) & self._below_best:
            # Every holder holds every page it holds on the best tier: one tier for all.
            uniform = True
        names = self._names
        best = self._best_tier
        group = self._group
        width = self._width
        out: dict[str, InstanceMatch] = {}
        for iid, run in runs.items():
            shift = iid * width
            if uniform:
                tiers = (best[(vals[0] >> shift) & group],) * run
            else:
                gs = list(map(and_, map(rshift, vals[:run], repeat(shift)), repeat(group)))
                g0 = gs[0]
                if gs.count(g0) == run:
                    tiers = (best[g0],) * run
                else:
                    tiers = tuple(map(best.__getitem__, gs))
            out[names[iid]] = InstanceMatch(run, tiers)
        return PrefixMatches(len(keys), out)

    def match_lengths(self, page_keys: Sequence[bytes], /) -> dict[str, int]:
        """Per instance, pages matched from the first (the hot path of routing: no tiers)."""
        core = self._core
        if core is not None:
            return core.lengths(page_keys)
        guard = self._flag
        if guard.busy:
            raise ReentrantCall
        guard.busy = True
        try:
            names = self._names
            return {names[iid]: run for iid, run in self._runs(page_keys)[1].items()}
        finally:
            guard.busy = False

    def score(
        self,
        tokens_or_page_keys: Sequence[bytes] | npt.ArrayLike,
        *,
        extra_key: str | None = None,
        cache_salt: str | None = None,
    ) -> dict[str, float]:
        """Per instance, the sum over its matched pages of the weight of each page's best tier
        (device > host > storage by default). Instances without the first page are absent."""
        matches = self.find_matches(tokens_or_page_keys, extra_key=extra_key, cache_salt=cache_salt)
        weights = self.tier_weights
        return {name: sum(weights[t] for t in m.tiers) for name, m in matches.by_instance.items()}

    def holdings(self, instance: str) -> dict[bytes, frozenset[str]]:
        """Every key `instance` holds and its tiers (tests, dumps, debugging). O(its keys)."""
        self._check_instance(instance)
        with self._guard:
            iid = self._ids.get(instance)
            if iid is None:
                return {}
            sets = self._tier_sets
            if self._core is not None:
                return {key: sets[bits << 1] for key, bits in self._core.holdings(iid)}
            shift, holders, group = iid * self._width, self._holders, self._group
            return {key: sets[(holders[key] >> shift) & group] for key in self._by_inst[iid]}

    def instances(self) -> list[str]:
        """Names of the instances with at least one entry or sequence state, sorted. A plain
        read (each set made by one C call): no guard, see `stats`."""
        return sorted(set(self._ids) | set(self._seq) | self._awaiting_dump)

    @property
    def core(self) -> str:
        """Which core holds the entries: "native" (the C extension) or "python"
        (`native.native_status()` says why)."""
        return "python" if self._core is None else "native"

    @property
    def evicted_entries(self) -> int:
        """Entries evicted by the `max_entries` bound so far."""
        return self._evicted if self._core is None else self._core.stats()[2]

    def native_bytes(self) -> int:
        """Bytes the C core has allocated (its table, entries, holder and key lists; not
        seen by tracemalloc); 0 on the Python core."""
        return 0 if self._core is None else self._core.stats()[3]

    def stats(self) -> IndexStats:
        """The index's counters. A plain read, with no guard: a metrics scrape reads it from
        its own thread, and a finalizer may read it, while a call runs (seeing that call's
        changes made so far)."""
        core = self._core
        if core is not None:
            entries, pairs, evicted, _ = core.stats()
        else:
            entries, evicted = len(self._holders), self._evicted
            # One C call copies the sets: a generator over the live dict could see it change.
            pairs = sum(map(len, list(self._by_inst.values())))
        return IndexStats(
            num_entries=entries,
            num_instances=len(self._ids),
            num_pairs=pairs,
            evicted_entries=evicted,
            gaps=self.gaps,
            max_entries=self.max_entries,
        )

    def __len__(self) -> int:
        return len(self._holders) if self._core is None else self._core.stats()[0]

    def check_integrity(self) -> None:
        """Every entry's groups are valid (holds bit set exactly when a tier bit is) and name
        live instances whose key sets hold the key, and nothing else is in those sets; the id
        maps agree; the bound holds. On the native core: its own invariants (`Core.check`) and
        no entry held by an id not in use."""
        with self._guard:
            self._check_integrity()

    def _check_integrity(self) -> None:
        assert set(self._ids.values()) == set(self._names), "instance id maps disagree"
        assert not set(self._free_ids) & set(self._names), "a free id is in use"
        if self._core is not None:
            check_core(self._core)
            for iid in range(self._next_id):
                if iid not in self._names:
                    assert not self._core.holdings(iid), f"free id {iid} still holds keys"
            return
        width, group = self._width, self._group
        pairs = 0
        for key, packed in self._holders.items():
            assert packed > 0, f"key {key.hex()} has no holder but stays in the index"
            iid, rest = 0, packed
            while rest:
                g = rest & group
                if g:
                    assert g & 1 and g >> 1, f"bad group {g:b} of instance {iid} on {key.hex()}"
                    assert iid in self._names, f"key {key.hex()} held by unknown id {iid}"
                    assert key in self._by_inst[iid], "holder missing from instance set"
                    pairs += 1
                rest >>= width
                iid += 1
        assert pairs == sum(len(s) for s in self._by_inst.values()), (
            "per-instance key sets hold keys the holders map does not"
        )
        assert set(self._by_inst) == set(self._names), "key sets and instances disagree"
        if self.max_entries is not None:
            assert len(self._holders) <= self.max_entries, "entry bound exceeded"

    # ------------------------------------------------------------------------------------------
    # Internals
    # ------------------------------------------------------------------------------------------
    def _runs(self, keys: Sequence[bytes]) -> tuple[list[int], dict[int, int], bool]:
        """The packed holders of the keys up to the first key nobody holds, instance id -> its
        run of pages from the first, and whether every one of those pages has the very same
        holders and tiers (the common case: one answer for all). The loops run in C (map,
        takewhile, accumulate, count): a Python-level loop per page cost 3-5x more."""
        if not keys:
            return [], {}, True
        holders = self._holders
        vals = list(takewhile(bool, map(holders.get, keys, repeat(0))))
        num = len(vals)
        if not num:
            return vals, {}, True
        first = vals[0]
        width = self._width
        uniform = vals.count(first) == num
        runs: dict[int, int] = {}
        if uniform:
            for iid in _ids_of(first & self._present, width):
                runs[iid] = num
            depth = num
        else:
            # Running AND of the "holds" bits: the set of instances still matching at each depth,
            # shrinking; each distinct set is one contiguous stretch.
            alive = list(map(and_, accumulate(vals, and_), repeat(self._present)))
            depth = 0
            prev = alive[0]
            for mask in dict.fromkeys(alive):
                if mask != prev:
                    for iid in _ids_of(prev & ~mask, width):
                        runs[iid] = depth
                    prev = mask
                if not mask:
                    break
                depth += alive.count(mask)
            for iid in _ids_of(prev, width):
                runs[iid] = depth
        if self.max_entries is not None:
            # Deepest first, so the head of a prefix is the most recent of its keys.
            any(map(holders.move_to_end, reversed(keys[:depth])))  # type: ignore[attr-defined]
        return vals, runs, uniform

    def _as_keys(
        self,
        query: Sequence[bytes] | npt.ArrayLike,
        extra_key: str | None,
        cache_salt: str | None,
    ) -> Sequence[bytes]:
        if isinstance(query, list | tuple) and query and isinstance(query[0], bytes):
            return query  # type: ignore[return-value]
        return self.keyer.page_keys(query, extra_key=extra_key, cache_salt=cache_salt)

    def _intern(self, instance: str) -> int:
        iid = self._ids.get(instance)
        if iid is None:
            if self._free_ids:
                iid = heapq.heappop(self._free_ids)
            else:
                iid = self._next_id
                self._next_id += 1
                self._present |= 1 << (iid * self._width)
                self._below_best |= (self._all_tiers ^ 2) << (iid * self._width)
            self._ids[instance] = iid
            self._names[iid] = instance
            self._by_inst[iid] = set()
            # The C core records the name itself: it calls this inside `apply`.
        return iid

    def _store(self, iid: int, keys: Sequence[bytes], bit: int) -> None:
        """OR (holds | tier) of `iid` into every key's groups: the hot path of `apply`, in C
        loops (map / zip / dict.update / set.update) unless a bounded index must evict."""
        entries = self._holders
        mine = self._by_inst[iid]
        mark = (bit | 1) << (iid * self._width)
        vals = list(map(entries.get, keys, repeat(0)))
        cap = self.max_entries
        if cap is None or len(entries) + vals.count(0) <= cap:
            entries.update(zip(keys, map(or_, vals, repeat(mark)), strict=True))
            mine.update(keys)
            return
        get = entries.get
        for key in keys:
            packed = get(key, 0)
            if not packed and len(entries) >= cap:
                self._evict_one()
            entries[key] = packed | mark
            mine.add(key)

    def _remove(self, iid: int, keys: Sequence[bytes], bits: int) -> None:
        """Clear tier `bits` of `iid` on `keys`; a key left on no tier of `iid` loses its holds
        bit and leaves `iid`'s set, and a key left with no holder leaves the index."""
        entries = self._holders
        shift = iid * self._width
        holds = 1 << shift
        drop = bits << shift
        vals = list(map(entries.get, keys, repeat(0)))
        mine_tiers = self._all_tiers << shift
        if 0 not in vals and not any(map(and_, vals, repeat(~(holds | drop)))):
            # Every key is held by `iid` alone, on no tier but those dropped: all go.
            deque(map(entries.pop, keys, repeat(None)), maxlen=0)
            self._by_inst[iid].difference_update(keys)
            return
        if not any(map(and_, vals, repeat(mine_tiers & ~drop))):
            # `iid` holds none of the keys on a tier it keeps (the common case: one tier per
            # instance): its whole group goes from every key, in C loops.
            new = list(map(and_, vals, repeat(~(holds | drop))))
            if 0 in new:
                deque(map(entries.pop, compress(keys, map(not_, new)), repeat(None)), maxlen=0)
                entries.update(compress(zip(keys, new, strict=True), new))
            else:
                entries.update(zip(keys, new, strict=True))
            self._by_inst[iid].difference_update(keys)
            return
        gone: list[bytes] = []
        for key, packed in zip(keys, vals, strict=True):
            if not packed & drop:
                continue
            packed &= ~drop
            if not packed & mine_tiers:
                packed &= ~holds
                gone.append(key)
            if packed:
                entries[key] = packed
            else:
                entries.pop(key, None)
        if gone:
            self._by_inst[iid].difference_update(gone)

    def _drop(self, instance: str) -> int:
        iid = self._ids.get(instance)
        if iid is None:
            return 0
        if self._core is not None:
            return self._core.drop(iid)
        keys = list(self._by_inst[iid])
        self._remove(iid, keys, self._all_tiers)
        return len(keys)

    def _evict_one(self) -> None:
        key, packed = self._holders.popitem(last=False)  # type: ignore[call-arg]
        for iid in _ids_of(packed & self._present, self._width):
            self._by_inst[iid].discard(key)
        self._evicted += 1

    def _check_instance(self, instance: str) -> None:
        if not isinstance(instance, str) or not instance:
            raise InvalidInstance(f"an instance is named by a non-empty str, got {instance!r}")

    def _check_events(self, events: Sequence[KVEvent]) -> None:
        key_bytes = self.keyer.key_bytes
        for event in events:
            if isinstance(event, BlockStored):
                if event.tokens_per_page != self.page_size:
                    raise InvalidEvent(
                        f"BlockStored of {event.tokens_per_page}-token pages on an index of "
                        f"{self.page_size}-token pages"
                    )
                self._check_tier(event.tier)
                self._check_keys(event.page_keys, key_bytes)
            elif isinstance(event, BlockRemoved):
                self._check_tier(event.tier)
                self._check_keys(event.page_keys, key_bytes)
            elif isinstance(event, AllBlocksCleared):
                if event.tier is not None:
                    self._check_tier(event.tier)
            else:
                raise InvalidEvent(f"not a kvstrata KV event: {type(event).__name__}")

    def _check_tier(self, tier: str) -> None:
        if tier not in self._tier_bit:
            raise InvalidEvent(f"tier {tier!r} has no weight; known: {sorted(self._tier_bit)}")

    @staticmethod
    def _check_keys(keys: Sequence[bytes], key_bytes: int) -> None:
        # Two C-level passes (type, length) instead of a Python loop per key; the loop only
        # when they see something else (a subclass of bytes is a bytes: no error for it).
        if keys and (set(map(type, keys)) != {bytes} or set(map(len, keys)) != {key_bytes}):
            for key in keys:
                if not isinstance(key, bytes) or len(key) != key_bytes:
                    raise InvalidEvent(f"page keys are {key_bytes}-byte bytes, got {key!r:.80}")


def _ids_of(holds: int, width: int) -> list[int]:
    """Instance ids whose holds bit is set in `holds` (bit iid * width)."""
    out: list[int] = []
    while holds:
        low = holds & -holds
        out.append((low.bit_length() - 1) // width)
        holds ^= low
    return out
