"""`UnifiedRadixCache`: one radix tree over token prefixes for every model family.

The tree works on keys; the state for a prefix (full KV, sliding-window KV, Mamba state) is held
by components through hooks (components/base.py). FullComponent is always component 0 and its
data sits in plain node attributes, so a Full-only tree runs match and insert without a single
hook call: per node one dict lookup on the first page's bytes and one memcmp of the whole run.

Positions inside the walk are byte offsets into the key's int64 token bytes:

    key bytes:  | page 0 | page 1 | page 2 | ... |      (page = page_size * 8 bytes)
    node.key:            |<-- child run -->|           pos advances by len(node.key)
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from time import perf_counter
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt
import torch

from kvstrata.storage.keys import PageKeyer
from kvstrata.unified_radix_cache import locks, structure
from kvstrata.unified_radix_cache import request as request_ops
from kvstrata.unified_radix_cache.components.base import ComponentInsert, TreeComponent
from kvstrata.unified_radix_cache.components.full import FullComponent
from kvstrata.unified_radix_cache.errors import (
    InvalidConfig,
    InvalidInsert,
    TreeLocked,
)
from kvstrata.unified_radix_cache.events import EventLog, KVEvent
from kvstrata.unified_radix_cache.evict_undo import EvictJournal, evict_full_tiered, evict_targets
from kvstrata.unified_radix_cache.hybrid import insert_slow, match_hybrid
from kvstrata.unified_radix_cache.insert_inputs import as_priority, check_inputs, slots_of
from kvstrata.unified_radix_cache.integrity import check_tree
from kvstrata.unified_radix_cache.key import TOKEN_BYTES, Namespace, RadixKey
from kvstrata.unified_radix_cache.native_core import RadixCore, install, native_core
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.policies import EvictionPolicy, make_policy
from kvstrata.unified_radix_cache.render import render_tree
from kvstrata.unified_radix_cache.request import CacheRequest
from kvstrata.unified_radix_cache.results import (
    NO_STATES,
    EvictRequest,
    EvictResult,
    InsertCall,
    InsertResult,
    LockReceipt,
    MatchResult,
    new_result,
)
from kvstrata.unified_radix_cache.slot_checks import SlotChecker
from kvstrata.unified_radix_cache.walk import descend

if TYPE_CHECKING:
    from kvstrata.unified_radix_cache.tier_hooks import TreeTier

# Shared by every empty match result: a tensor over it has no element to write and its storage
# (numpy's) cannot be resized, so no caller can change it.
_EMPTY_SLOTS = np.empty(0, dtype=np.int64)
_INT64 = np.dtype(np.int64)
_tree_ids = itertools.count(1)


class UnifiedRadixCache:
    """A prefix cache of whole pages shared by every namespace.

    `components`: FullComponent first, then any of SWAComponent / MambaComponent (one each).
    `page_size`: tokens per page; only whole pages are stored and matched.
    `eviction_policy`: lru, lfu, fifo, mru, filo or priority (orders Full's evictable leaves).
    `disable`: a disabled cache never hits and stores nothing (insert adopts no slot).
    `enable_events`: queue KV events for `take_events()`; page keys come from `keyer` (a
    `kvstrata.storage.PageKeyer`; one is built for `page_size` when none is given).
    `check_slots`: `insert` refuses (InvalidSlots, before any change) slots outside the pool,
    not handed out by the allocator, given twice, or already held by the tree; an engine that
    trusts its own bookkeeping may turn the check off.
    """

    def __init__(
        self,
        components: Sequence[TreeComponent],
        page_size: int = 1,
        eviction_policy: str = "lru",
        *,
        disable: bool = False,
        enable_events: bool = False,
        keyer: PageKeyer | None = None,
        check_slots: bool = True,
    ) -> None:
        if page_size < 1:
            raise InvalidConfig(f"page_size must be >= 1, got {page_size}")
        if not components or not isinstance(components[0], FullComponent):
            raise InvalidConfig("the first component must be a FullComponent")
        names = [c.name for c in components]
        if len(set(names)) != len(names):
            raise InvalidConfig(f"component names must be unique, got {names}")
        if any(isinstance(c, FullComponent) for c in components[1:]):
            raise InvalidConfig("only one FullComponent per tree")
        if any(c.index >= 0 for c in components):
            raise InvalidConfig("a component is already bound to another tree")
        if enable_events and not disable:
            if keyer is None:
                keyer = PageKeyer(page_size=page_size)
            if keyer.page_size != page_size:
                raise InvalidConfig(
                    f"keyer page size {keyer.page_size} != tree page size {page_size}"
                )
        self.page_size = page_size
        self.policy: EvictionPolicy = make_policy(eviction_policy)
        self.disabled = disable
        self._uid = next(_tree_ids)
        self._page_bytes = page_size * TOKEN_BYTES
        self._full: FullComponent = components[0]
        self._components: tuple[TreeComponent, ...] = tuple(components)
        self._extras: tuple[TreeComponent, ...] = tuple(components[1:])
        self._by_name = {c.name: c for c in components}
        self._num_components = len(components)
        self._tick = 0
        self._ids: Iterator[int] = itertools.count(1)
        self._receipts: dict[int, LockReceipt] = {}
        self._receipt_ids: Iterator[int] = itertools.count(1)
        self._root = structure.new_root(self._num_components)
        #: The compiled walks and slot check (native_core.py), None for the Python paths.
        self._native: RadixCore | None = native_core()
        #: Set while an `evict` with state components or a host tier runs (evict_undo.py).
        self._journal: EvictJournal | None = None
        #: The Full-only match's walk (key, end, path, bytes matched), reused by an insert of
        #: the same key object while the tree keeps that path: dropped by any split or new node,
        #: and by a removal unless the path's end is locked (then no evict can touch the path).
        self._last_walk: tuple[RadixKey, int, list[TreeNode], int] | None = None
        # Bound last: every check above ran first, so a refused tree leaves its components free.
        for index, component in enumerate(components):
            component.bind(self, index)
        heap = self._full.heap
        assert heap is not None
        self._heap = heap
        self._on_cpu = self._full.device.type == "cpu"
        self.check_slots = check_slots
        self._slot_checker: SlotChecker | None = None
        if check_slots and not disable:
            native = self._native
            compiled = native.check_slots if native is not None else None
            self._slot_checker = SlotChecker(self._full, page_size, compiled)
        self._events: EventLog | None = None
        if keyer is not None and enable_events and not disable:
            self._events = EventLog(keyer)
        if self._native is not None and type(self._full) is FullComponent:
            self._full.drain = self._native.drain  # a subclass keeps its own take_pending
        if self._native is not None and not self._extras and type(self) is UnifiedRadixCache:
            install(self._native, self, events=self._events is not None)
        # Hierarchical mode (host_tier.py). `_slow` sends match and insert off the Full-only
        # fast path, so a device-only tree pays one attribute test per call and nothing more.
        self.host_tier: TreeTier | None = None
        self._slow = bool(self._extras)
        # Counters read by RadixCacheCollector (tokens unless said otherwise).
        self.queried_tokens = 0
        self.hit_tokens = 0
        self.host_hit_tokens = 0
        self.inserted_tokens = 0
        self.evict_calls = 0
        self.evict_seconds = 0.0
        self.num_nodes = 0

    # ------------------------------------------------------------------------------------------
    # Introspection
    # ------------------------------------------------------------------------------------------
    @property
    def root(self) -> TreeNode:
        return self._root

    @property
    def components(self) -> tuple[TreeComponent, ...]:
        return self._components

    def component(self, name: str) -> TreeComponent:
        """The component called `name`; KeyError if the tree has none."""
        return self._by_name[name]

    def evictable_size(self, component: str = "full") -> int:
        """Data of `component` no lock protects (tokens; states for Mamba). O(1)."""
        return self._by_name[component].evictable_size

    def protected_size(self, component: str = "full") -> int:
        """Data of `component` held by at least one lock. O(1)."""
        return self._by_name[component].protected_size

    def total_size(self, component: str = "full") -> int:
        c = self._by_name[component]
        return c.evictable_size + c.protected_size

    @property
    def full_device(self) -> torch.device:
        """Device of the Full slot tensors this tree returns."""
        return self._full.device

    def iter_nodes(self) -> list[TreeNode]:
        """Every node but the root, parents before children. O(n); for checks and tools."""
        out: list[TreeNode] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def prefix_slots(self, node: TreeNode) -> torch.Tensor:
        """Full slots of the whole prefix ending at `node` (root first). Valid while `node` is
        locked. O(depth)."""
        parts: list[npt.NDArray[np.int64]] = []
        probe = node
        while probe.parent is not None:
            parts.append(probe.value)
            probe = probe.parent
        slots = np.concatenate(parts[::-1]) if parts else _EMPTY_SLOTS.copy()
        return self._full.to_device(slots)

    def free_slots(self, component: str, slots: torch.Tensor) -> None:
        """Free slots a request holds outside the tree into `component`'s pool (the request
        life cycle uses it for duplicates and tails)."""
        self._by_name[component].give_back(slots)

    def flush_pending(self) -> None:
        """Hand every component's queued frees to its allocator now (component API: for a hook
        that evicts outside `evict`, e.g. Mamba making room for a copy-on-write slot)."""
        for component in self._components:
            component.flush()

    @property
    def keyer(self) -> PageKeyer | None:
        """The page keyer of this tree's events (None when events are off)."""
        return self._events.keyer if self._events is not None else None

    def attach_host_tier(self, tier: TreeTier) -> None:
        """Hierarchical mode: from now on match, insert and Full eviction take `tier`'s walks
        (host values on the nodes; the other components reach the tier through their host
        hooks). Refused on a non-empty or already tiered tree."""
        if self.host_tier is not None:
            raise InvalidConfig("this tree already has a host tier")
        if self.num_nodes:
            raise InvalidConfig("attach the host tier to an empty tree")
        self.host_tier = tier
        self._slow = True
        self._full.drop_compiled()  # the host tier's walks take Full eviction over
        self._full.tiered = True

    @property
    def num_locked(self) -> int:
        """Outstanding lock receipts."""
        return len(self._receipts)

    # ------------------------------------------------------------------------------------------
    # Match
    # ------------------------------------------------------------------------------------------
    def match_prefix(
        self, key: RadixKey, *, max_len: int | None = None, copy_state: bool = False
    ) -> MatchResult:
        """The longest cached prefix of `key` (at most `max_len` tokens), in whole pages, that
        every component can restore.

        Mutates: access time and hit count along the matched path (eviction order), the query
        and hit counters, and may split the node where the match ends so that `last_node` ends
        exactly at `prefix_len` (invisible to callers: sizes and locks are unchanged). With
        `copy_state`, a MambaComponent copies the matched state into a fresh slot the caller
        owns (`result.states["mamba"]`). Cost: O(K) bytes compared plus O(depth) dict lookups.
        Returned indices stay valid until the next evict/reset unless `last_node` is locked.
        """
        data = key.cached_bytes or key.token_bytes()
        total = len(data)
        self.queried_tokens += total // TOKEN_BYTES
        end = total if max_len is None else min(total, max(max_len, 0) * TOKEN_BYTES)
        end -= end % self._page_bytes
        root = self._root
        if end == 0 or self.disabled:
            return MatchResult(0, self._full.to_device(_EMPTY_SLOTS), root)
        if self._slow:
            if self.host_tier is not None:
                return self.host_tier.match(key, data, end, copy_state=copy_state)
            return match_hybrid(self, key, data, end, copy_state)
        self._tick += 1
        tick = self._tick
        if self._native is not None:
            # Compiled: the same walk and splits, the same writes per node, the slots joined.
            path, pos, joined = self._native.match(
                root, self._page_bytes, key.namespace, data, end, self.split_node, tick
            )
            if joined is None:
                found = None
            elif self._on_cpu:  # one conversion, no numpy array in between
                found = torch.frombuffer(joined, dtype=torch.int64)
            else:
                found = self._full.to_device(np.frombuffer(joined, dtype=_INT64))
        else:
            path, pos, _ = descend(
                root, self._page_bytes, key.namespace, data, end, self.split_node
            )
            for node in path:
                node.last_access = tick
                node.hit_count += 1
            # A copy (concatenate copies too): the caller may write into the tensor it gets.
            values = [node.value for node in path]
            found = (
                self._full.to_device(
                    np.concatenate(values) if len(values) > 1 else values[0].copy()
                )
                if path
                else None
            )
        self._last_walk = (key, end, path, pos)
        node = path[-1] if path else root
        if node.heap_entry is not None:
            self._heap.push(node)  # re-key the leaf for its new access time
        prefix_len = pos // TOKEN_BYTES
        self.hit_tokens += prefix_len
        if found is None:
            return MatchResult(0, self._full.to_device(_EMPTY_SLOTS), root)
        return new_result(MatchResult, (prefix_len, found, node, 0, None, NO_STATES))

    # ------------------------------------------------------------------------------------------
    # Insert
    # ------------------------------------------------------------------------------------------
    def insert(
        self,
        key: RadixKey,
        value: torch.Tensor | npt.NDArray[np.integer],
        *,
        cached_len: int = 0,
        priority: int = 0,
        inputs: Mapping[str, ComponentInsert] | None = None,
    ) -> InsertResult:
        """Store the whole pages of `key` with `value[i]` the Full slot of token i.

        `value` must have one slot per token of `key` (an unaligned tail is not stored and stays
        the caller's). `cached_len`: `value[:cached_len]` are slots the caller got from this tree
        (its locked prefix); components never adopt or free those. `priority` raises the priority
        of every node on the path (priority policy). `inputs`: per component name, e.g.
        `{"mamba": MambaInsert(slot=...)}`, `{"swa": SWAInsert(evicted_len=...)}`.

        Returns the length already present (the caller frees `result.duplicates(value)`), the
        length adopted, and the node ending at the key. The tree copies the slots it adopts, so
        the caller may reuse `value`'s memory. Mutates: nodes (new leaf, split), sizes, access
        times, event queue. Raises InvalidInsert before changing anything.
        """
        data = key.cached_bytes or key.token_bytes()
        num_tokens = len(data) // TOKEN_BYTES
        slots = slots_of(value, num_tokens)
        if not 0 <= cached_len <= num_tokens:
            raise InvalidInsert(f"cached_len {cached_len} outside the key's 0..{num_tokens}")
        if type(priority) is not int:
            priority = as_priority(priority)
        comp_inputs = check_inputs(self, inputs, num_tokens) if inputs else None
        end = len(data) - len(data) % self._page_bytes
        root = self._root
        if end == 0 or self.disabled:
            return InsertResult(0, 0, root, cached_len=cached_len)
        checker = self._slot_checker
        if self._slow:  # hybrid.py: components or a host tier
            # Every field given: built without the generated `__new__`'s frame (per insert).
            call = new_result(
                InsertCall, (key, data, end, slots, cached_len, priority, comp_inputs)
            )
            return insert_slow(self, call, checker)
        # Full-only fast path: the one walk, then two attribute writes per node (no hook call).
        namespace = key.namespace
        page_bytes = self._page_bytes
        last = self._last_walk
        if last is not None and last[0] is key and last[1] == end:
            # The match just before walked this key and split where it ends: its walk holds.
            path, pos, partial = last[2], last[3], 0
        else:
            # With the check, the walk without its split finds the held prefix first.
            split = self.split_node if checker is None else None
            if self._native is not None:
                path, pos, partial = self._native.walk(
                    root, page_bytes, namespace, data, end, split
                )
            else:
                path, pos, partial = descend(root, page_bytes, namespace, data, end, split)
        self._last_walk = None
        if checker is not None:
            # The slots past the held prefix (the ones the new leaf adopts) are checked, and
            # marked held, before anything changes.
            held = (pos + partial) // TOKEN_BYTES
            hi = end // TOKEN_BYTES
            # A cached_len inside the unaligned tail claims nothing past the stored pages.
            lo = min(max(cached_len, held), hi)
            compiled = checker.compiled_alone
            if compiled is None or not compiled(slots, lo, hi, checker.table, True):
                checker.check(slots, lo, hi, keep=True)  # the allocator's check, or the error
            if lo > held:  # value[held:cached_len] claimed as the tree's: adopted unchecked
                checker.hold(slots[held:lo])
            if partial:
                parent = path[-1] if path else root
                first = data[pos : pos + page_bytes]
                child = parent.children[(namespace, first) if parent is root else first]
                path.append(self.split_node(child, partial // TOKEN_BYTES))
                pos += partial
        self._tick += 1
        tick = self._tick
        node = root
        for node in path:
            node.last_access = tick
            if priority > node.priority:
                node.priority = priority
        prefix_len = pos // TOKEN_BYTES
        if pos < end:
            leaf = structure.add_leaf(
                self, node, data, pos, end, slots, namespace, tick, priority, mark=False
            )
            return new_result(InsertResult, (prefix_len, len(leaf.value), leaf, (), (), cached_len))
        if node.heap_entry is not None:
            self._heap.push(node)  # re-key the leaf for its new access time
        return new_result(InsertResult, (prefix_len, 0, node, (), (), cached_len))

    # ------------------------------------------------------------------------------------------
    # Structure (component API: components call these from their hooks)
    # ------------------------------------------------------------------------------------------
    def split_node(self, node: TreeNode, num_tokens: int) -> TreeNode:
        """Split `node` after its first `num_tokens` tokens (a whole number of pages, less than
        the node): a new node takes that head and `node`'s place under its parent; `node` keeps
        the tail, its children and its identity. Returns the new upper node. Sizes and locks are
        unchanged (the upper node copies the lock counts)."""
        if self._journal is not None:
            self._journal.node(node)
        self._last_walk = None
        return structure.split_node(self, node, num_tokens)

    def remove_leaf(self, node: TreeNode, *, evicted: bool) -> int:
        """Take leaf `node` (unlocked, childless) out of the tree, releasing every component's
        data on it; its parent joins the evictable leaves if it is now an unlocked leaf. Slots
        are queued and reach the allocators at the end of the calling operation. Returns the
        Full tokens removed."""
        if self._journal is not None:
            self._journal.node(node)
        if self._last_walk is not None:
            self._forget_walk()
        return structure.remove_leaf(self, node, evicted=evicted)

    def truncate_leaf(self, node: TreeNode, keep: int) -> int:
        """Evict the tail of unlocked leaf `node`, keeping its first `keep` tokens (whole pages,
        0 < keep < size). Every component releases the tail with it: on a Full-only tree the
        node is cut in place; otherwise it is split and the tail node removed, so the split and
        release hooks see it. Returns the Full tokens freed."""
        size = len(node.value)
        assert 0 < keep < size and keep % self.page_size == 0, (
            f"truncate_leaf({node.id}, {keep}): not a page boundary inside the leaf"
        )
        assert not node.children and node.lock_ref == 0, (
            f"truncate_leaf({node.id}): not an unlocked leaf"
        )
        if self._last_walk is not None:
            self._forget_walk()
        if self._extras:
            self.split_node(node, keep)
            if node.heap_entry is not None:
                self._heap.discard(node)
            return self.remove_leaf(node, evicted=True)
        return structure.cut_leaf_tail(self, node, keep)

    def note_evicting(self, node: TreeNode) -> None:
        """A host tier's walk inside `evict` is about to split, demote or remove device leaf
        `node`: the journal records it as it is (heap entry included) for a refused evict."""
        if self._journal is not None:
            self._journal.node(node)

    def evict_component(self, node: TreeNode, component: TreeComponent) -> int:
        """`component` gives up its data on `node` (its own eviction, e.g. SWA or Mamba LRU):
        an unlocked leaf leaves the tree whole; otherwise the node keeps its Full data and
        becomes a tombstone for `component` and every component of lower or equal priority.
        Returns what `component` freed."""
        self._last_walk = None
        # A leaf with a host copy stays (hierarchical mode): it only loses device state here.
        if not node.children and node.lock_ref == 0 and node.host_value is None:
            before = component.evicted_total
            self.remove_leaf(node, evicted=True)
            return component.evicted_total - before
        return structure.tombstone(self, node, component)

    def _forget_walk(self) -> None:
        """A node leaves or shrinks: drop the match's walk unless its path is locked (or empty:
        no removal makes a child appear where the walk found none)."""
        last = self._last_walk
        if last is not None and last[2] and last[2][-1].lock_ref == 0:
            self._last_walk = None

    # -- hierarchical mode (host_tier.py walks the nodes with these) -----------------------
    def next_tick(self) -> int:
        """Advance and return the access clock (one tick per match or insert)."""
        self._tick += 1
        return self._tick

    def walk(self, namespace: Namespace | None, data: bytes, end: int) -> list[TreeNode]:
        """The nodes matching `data[:end]` (whole pages of token bytes) from the root, the last
        one split where the match ends inside it, so the path covers exactly the matched
        prefix. Mutates only by that split (sizes and locks unchanged). The walk of the hybrid
        and hierarchical paths; the Full-only fast paths inline it. O(K + depth)."""
        if self._native is not None:
            return self._native.walk(
                self._root, self._page_bytes, namespace, data, end, self.split_node
            )[0]
        return descend(self._root, self._page_bytes, namespace, data, end, self.split_node)[0]

    def add_off_device_child(
        self, parent: TreeNode, key: bytes, namespace: Namespace | None, tick: int
    ) -> TreeNode:
        """A new node under `parent` for `key` that holds no device slots (the caller gives it
        a host value). Only the structure changes: no size, heap or event."""
        self._last_walk = None
        return structure.add_off_device_child(self, parent, key, namespace, tick)

    def emit_stored(self, node: TreeNode) -> None:
        """Queue a device-tier BlockStored for `node`'s pages (when events are on)."""
        if self._events is not None:
            self._events.stored(self, node)

    def emit_removed(self, node: TreeNode) -> None:
        """Queue a device-tier BlockRemoved for `node`'s pages (when events are on)."""
        if self._events is not None:
            self._events.removed(self, node)

    # ------------------------------------------------------------------------------------------
    # Eviction
    # ------------------------------------------------------------------------------------------
    def evict(self, request: EvictRequest) -> EvictResult:
        """Free at least each component's target (or all it can): Full from the evictable
        leaves in policy order, page-granular at the last leaf; SWA and Mamba from their own
        LRU lists (internal nodes become tombstones). Locked data is never touched. The slots
        reach the allocators in one `free` call per component before this returns, after a
        check that each allocator takes them: an evict that raises (HeldSlotsNotAllocated,
        HeldSlotsRepeated) changed nothing: tree, host tier and allocators are as they were.
        Cost: O(k log n) for k nodes evicted. `evict` with all targets 0 is a no-op."""
        targets = request.targets
        start = perf_counter()
        nodes_before = self.num_nodes
        full_only = not targets or (len(targets) == 1 and "full" in targets)
        if not self._slow and full_only:
            # Full-only device tree: checked (a free behind the tree's back raises with
            # nothing changed).
            full = self._full
            before = full.evicted_total
            amount = targets.get("full", 0)
            if amount > 0:
                queue = self._events.queue if self._events is not None else None
                full.evict_checked(amount, queue, repeats=not self.check_slots)
            evicted = {"full": full.evicted_total - before}
        elif not self._extras and full_only:
            # Full-only tree with a host tier: one pass (evict_undo.evict_full_tiered).
            full = self._full
            before = full.evicted_total
            amount = targets.get("full", 0)
            if amount > 0:
                evict_full_tiered(self, amount)
            else:
                full.flush()
            evicted = {"full": full.evicted_total - before}
        else:
            evicted = evict_targets(self, targets)
        seconds = perf_counter() - start
        self.evict_calls += 1
        self.evict_seconds += seconds
        return EvictResult.of(evicted, nodes_before - self.num_nodes, seconds)

    # ------------------------------------------------------------------------------------------
    # Locks
    # ------------------------------------------------------------------------------------------
    #: `lock(node) -> LockReceipt`: protect what a request ending at `node` needs, per
    #: component (Full: the path to the root; SWA: one window upward; Mamba: this node's
    #: state). Moves that data from evictable to protected. Locking the root is allowed and
    #: protects nothing. O(depth). Raises ForeignNode for a node not in this tree (e.g. one
    #: evicted since the match). `locks.lock` itself, bound as a method (once per request:
    #: no forwarding frame).
    lock = locks.lock

    #: `unlock(receipt)`: release exactly the lock `receipt` proves. Raises
    #: ReceiptAlreadyReleased for a second unlock, UnknownReceipt for a receipt this tree never
    #: issued, ReceiptMismatch for an altered one, all before changing anything. `locks.unlock`
    #: itself, bound as a method.
    unlock = locks.unlock

    def outstanding_receipts(self) -> list[LockReceipt]:
        return list(self._receipts.values())

    # ------------------------------------------------------------------------------------------
    # Request life cycle (request.py)
    # ------------------------------------------------------------------------------------------
    def begin_request(
        self, key: RadixKey, *, priority: int = 0, copy_state: bool = True
    ) -> CacheRequest:
        """Start a request: match at most `len(key) - 1` tokens (an engine always computes at
        least the last one), lock the match, and return the request's hold: its
        `kv_indices` start as the matched slots (`cached_len` of them); with Mamba,
        `state_slot` is the request's own copy of the matched state. The caller allocates
        slots for `key[cached_len:]` and appends them with `req.extend(slots)`."""
        return request_ops.begin_request(self, key, priority=priority, copy_state=copy_state)

    def cache_unfinished_request(self, req: CacheRequest) -> TreeNode:
        """Chunked prefill: insert the whole pages that have KV so far, free the request's
        duplicate slots, move its lock to the new prefix and replace `req.kv_indices[:cached_len]`
        by the tree's slots (write them into your req-to-token table). With Mamba and an aligned
        length, the tree keeps a copy of the request's state. The request keeps running.
        Returns the node ending at the new `cached_len` (the one the request now locks)."""
        return request_ops.cache_unfinished_request(self, req)

    def cache_finished_request(self, req: CacheRequest) -> TreeNode:
        """The request is done: insert its whole pages (and its Mamba state when its length is
        aligned), free its duplicate slots and unaligned tail (and its state if not adopted),
        unlock. `req` is finished afterwards (RequestFinished on reuse). Returns the node ending
        at the whole pages the tree now holds of the request (the root when none)."""
        return request_ops.cache_finished_request(self, req)

    def abort_request(self, req: CacheRequest) -> None:
        """Drop the request without inserting: free its own slots and state, unlock."""
        request_ops.abort_request(self, req)

    # ------------------------------------------------------------------------------------------
    # Reset, events, integrity, display
    # ------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty the tree and give every slot back to its allocator. Refused (TreeLocked) while
        any lock receipt is outstanding. Queues AllBlocksCleared. O(n)."""
        if self._receipts:
            raise TreeLocked(
                f"{len(self._receipts)} lock receipt(s) outstanding; unlock them first"
            )
        self._last_walk = None
        structure.clear(self)
        if self._events is not None:
            self._events.cleared()

    def take_events(self) -> list[KVEvent]:
        """Drain the queued KV events (oldest first). Always empty when events are disabled."""
        return self._events.drain() if self._events is not None else []

    def page_keys(self, node: TreeNode) -> list[bytes]:
        """Chained page keys of `node`'s pages (computed on first use, cached on the node)."""
        if self._events is None:
            raise InvalidConfig("page keys need a keyer: build the tree with enable_events=True")
        return self._events.page_keys(self, node)

    def check_integrity(self, held: Mapping[str, int] | None = None) -> None:
        """Verify structure, sizes, locks and pools; raise IntegrityError on the first fault.

        Per pool: free (allocator) + evictable + protected + held == capacity, where `held`
        maps a component name to slots running requests hold outside the tree (e.g.
        `req.held()`). Also: child keys match first pages, no empty non-root node, namespaces
        kept below the root, lock counts equal the outstanding receipts, the evictable-leaf heap
        and the component LRU lists hold exactly what they should. O(n)."""
        check_tree(self, held or {})

    def pretty_print(self, *, max_tokens: int = 8) -> str:
        """A text picture of the tree: per node its first tokens, size, locks and per-component
        state (tombstones shown as `-`). Returns the text (print it yourself)."""
        return render_tree(self, max_tokens=max_tokens)
