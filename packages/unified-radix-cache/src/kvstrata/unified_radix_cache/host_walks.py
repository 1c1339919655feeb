"""`HostWalks`: the match and insert walks a hierarchical tree sends to its `HostTier` in place
of its fast path (one walk covers both tiers; see host_tier.py for the layout).

- match: the device hit is the run of on-device nodes, cut where a component cannot restore its
  device data (`match_end`); the host hit continues over the nodes beyond it as far as every
  component can restore its data from the host (`host_hit_may_end`);
- insert: off-device nodes the key runs over take the caller's slots again (revive, with each
  component's `on_revive`), a new leaf takes the rest, and the component hooks run as in the
  device-only walk. A Full-only tree has no hook to run: `insert_full` walks once without a
  callback per node (the device-only tree's insert plus the revive).

The walks know components only through their hooks (components/base.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvstrata.unified_radix_cache import structure
from kvstrata.unified_radix_cache.components.full import FullComponent
from kvstrata.unified_radix_cache.errors import InvalidInsert
from kvstrata.unified_radix_cache.hybrid import insert_walk
from kvstrata.unified_radix_cache.key import TOKEN_BYTES, RadixKey
from kvstrata.unified_radix_cache.node import NO_CHILDREN, TreeNode
from kvstrata.unified_radix_cache.policies import LeafHeap
from kvstrata.unified_radix_cache.results import InsertCall, InsertResult, MatchResult, new_result
from kvstrata.unified_radix_cache.walk import descend

if TYPE_CHECKING:
    import torch

    from kvstrata.unified_radix_cache.components.base import TreeComponent
    from kvstrata.unified_radix_cache.slot_checks import SlotChecker
    from kvstrata.unified_radix_cache.tree import UnifiedRadixCache

_NO_SLOTS = np.empty(0, dtype=np.int64)


class HostWalks:
    """Match and insert over both tiers of a hierarchical tree, and the host heap's membership
    bookkeeping both they and `HostTier` (its subclass) go through (each candidate's host slots
    are counted per component as nodes join and leave).

    `tree`: the tree (Full first); `heap`: the host eviction heap (the candidates)."""

    def __init__(self, tree: UnifiedRadixCache, heap: LeafHeap) -> None:
        full = tree.components[0]
        assert isinstance(full, FullComponent) and full.heap is not None, "a bound Full tree"
        self.tree = tree
        self.heap = heap
        self._full = full
        self._extras: tuple[TreeComponent, ...] = tuple(tree.components[1:])
        self._device_heap = full.heap
        self._page_bytes = tree.page_size * TOKEN_BYTES
        #: Per component index: host slots held by host eviction candidates (the members of
        #: `heap`), what evicting every candidate would give back to that pool. Kept in step by
        #: `_add_candidate` / `_drop_candidate`, `HostTier.set_host` and `HostTier.on_split`,
        #: so `HostTier.evict_for` knows in O(1) whether evicting can help at all.
        self.candidate_sizes = [0] * len(tree.components)
        #: Whether the compiled match and the inline path revive may serve this tier: only
        #: exact classes (`HostTier` sets it, `host_evict.serves`), since both inline
        #: overridable steps (`tree.walk`, `_touch`, `_result`, `tree.insert`, `insert_full`).
        self._one_frame = False

    def _add_candidate(self, node: TreeNode) -> None:
        """`node` joins the host heap (a re-push only re-keys it; the counts move once)."""
        if node not in self.heap and node.comp_hosts is not None:
            for component in self._extras:
                self.candidate_sizes[component.index] += component.host_size(node)
        self.heap.push(node)

    def _drop_candidate(self, node: TreeNode) -> None:
        """`node` leaves the host heap if it is in it (lock, revive, a child, eviction)."""
        if node in self.heap:
            self.heap.discard(node)
            self._uncount_candidate(node)

    def _uncount_candidate(self, node: TreeNode) -> None:
        if node.comp_hosts is not None:
            for component in self._extras:
                self.candidate_sizes[component.index] -= component.host_size(node)

    def match(
        self,
        key: RadixKey,
        data: bytes,
        end: int,
        *,
        count: bool = True,
        copy_state: bool = False,
        touch: bool = True,
    ) -> MatchResult:
        """The device hit of `data[:end]` and the host hit beyond it. Splits the node where the
        match ends; touches the matched nodes (both heaps re-keyed). With `count`, adds the hits
        to the tree's hit counters (the tree counted the query). The device hit ends where
        every component can restore its device data (`match_end`), the host hit at the last
        node after it where every component can restore its data from the host
        (`host_hit_may_end`); then each component finalises the match at the device hit's end
        (with `copy_state`, a component may copy its data into slots the caller owns,
        `MatchResult.states[name]`). Without `touch` (a re-match of a key already matched) no
        access time, hit count or heap key changes, so a request counts one hit per node.
        O(K + depth x components)."""
        tree = self.tree
        extras = self._extras
        native = tree._native
        if native is not None and self._one_frame and touch:
            # Full-only of the exact classes, compiled: one call walks, splits, touches the
            # path and joins the device slots (the Python below gives the same answers; a
            # subclass keeps its `walk` / `_touch` / `_result` overrides there).
            tick = tree.next_tick()
            path, on_device, host_bytes, joined = native.match_tiered(
                tree.root, self._page_bytes, key.namespace, data, end, tree.split_node, tick
            )
            last = path[on_device - 1] if on_device else tree.root
            last_host = path[-1] if len(path) > on_device else None
            if last in self._device_heap:
                self._device_heap.push(last)
            if last_host is not None and last_host in self.heap:
                self.heap.push(last_host)
            slots = _NO_SLOTS if joined is None else np.frombuffer(joined, dtype=np.int64)
            device_len = len(slots)
            host_len = host_bytes // TOKEN_BYTES
            if count:
                tree.hit_tokens += device_len
                tree.host_hit_tokens += host_len
            return MatchResult(device_len, self._full.to_device(slots), last, host_len, last_host)
        path = tree.walk(key.namespace, data, end)
        on_device = 0
        while on_device < len(path) and len(path[on_device].value):
            on_device += 1
        device_end = on_device
        for component in extras:
            device_end = min(device_end, component.match_end(path[:on_device]))
        host_end = device_end
        for k in range(len(path), device_end, -1):
            node = path[k - 1]
            if all(component.host_hit_may_end(node) for component in extras):
                host_end = k
                break
        device_nodes, host_nodes = path[:device_end], path[device_end:host_end]
        last = device_nodes[-1] if device_nodes else tree.root
        last_host = host_nodes[-1] if host_nodes else None
        # Raises (e.g. StateSlotsExhausted) before the match changes anything else.
        copies: dict[str, torch.Tensor] = {}
        for component in extras:
            copied = component.finalize_match(last, copy_state)
            if copied is not None:
                copies[component.name] = copied
        if touch:
            if extras:
                for item in path[:on_device]:
                    for component in extras:
                        component.on_access(item)
            self._touch(path, last, last_host)
        return self._result(
            device_nodes, host_nodes, last, last_host, count=count, copies=copies or None
        )

    def _result(
        self,
        device_nodes: list[TreeNode],
        host_nodes: list[TreeNode],
        last: TreeNode,
        last_host: TreeNode | None,
        *,
        count: bool,
        copies: Mapping[str, torch.Tensor] | None = None,
    ) -> MatchResult:
        """The MatchResult of a walk split into its device and host hits (counted into the
        tree's hit counters when `count`)."""
        tree = self.tree
        # A copy (concatenate copies too): the caller may write into the tensor it gets.
        if len(device_nodes) > 1:
            slots = np.concatenate([n.value for n in device_nodes])
        else:
            slots = device_nodes[0].value.copy() if device_nodes else _NO_SLOTS
        device_len = len(slots)
        host_len = sum(len(n.key) for n in host_nodes) // TOKEN_BYTES if host_nodes else 0
        if count:
            tree.hit_tokens += device_len
            tree.host_hit_tokens += host_len
        device = self._full.to_device(slots)
        if copies is None:
            return MatchResult(device_len, device, last, host_len, last_host)
        return MatchResult(device_len, device, last, host_len, last_host, copies)

    def _touch(self, path: list[TreeNode], last: TreeNode, last_host: TreeNode | None) -> None:
        """A counted access of the matched `path`: new access time and one more hit on each
        node, the device and host heaps re-keyed for the new time."""
        tick = self.tree.next_tick()
        for item in path:
            item.last_access = tick
            item.hit_count += 1
        if last in self._device_heap:
            self._device_heap.push(last)
        if last_host is not None and last_host in self.heap:
            self.heap.push(last_host)

    def match_key(self, key: RadixKey, max_len: int | None = None) -> MatchResult:
        """`match` of at most `max_len` whole pages of `key` without touching any counter, access
        time or hit count (for a cache re-matching a key it already counted). Still splits the
        node where the match ends."""
        data = key.cached_bytes or key.token_bytes()
        end = len(data) if max_len is None else min(len(data), max(max_len, 0) * TOKEN_BYTES)
        end -= end % self._page_bytes
        if end == 0 or self.tree.disabled:
            return MatchResult(0, self._full.to_device(_NO_SLOTS), self.tree.root)
        return self.match(key, data, end, count=False, touch=False)

    def insert(self, call: InsertCall) -> InsertResult:
        """The tree's insert (`hybrid.insert_walk`, the one component walk): off-device nodes
        the key runs over take the caller's slots again (revive; listed in `adopted`; each
        component's `on_revive` with its input), a new leaf takes the rest; on the nodes still
        on the device the components run their overlap hooks, on the new leaf `on_insert_new`,
        and on the node ending at the key `on_insert_commit` (the names of those that adopted
        their input are in the result). O(K + depth x components)."""
        return insert_walk(self.tree, call, self._revive_on_insert)

    def insert_full(self, call: InsertCall, checker: SlotChecker | None) -> InsertResult:
        """`insert` on a Full-only tree (no other component, so no hook to run): one walk
        without a closure per node. Off-device nodes the key runs over take the caller's slots
        again (revive, listed in `adopted`); the nodes still on the device only get the access
        time and priority. The slot check (`checker`, None when off) runs before anything
        changes: over the slots past the held prefix (the new leaf's: the device-only tree's
        check) when nothing is revived, else over every slot past `cached_len` as `insert`
        checks them; what the tree adopts is marked held. Same result, events and heaps as
        `insert`. Cost: the walk plus O(depth) attribute writes.

        The tier of the exact classes without events takes the compiled walk
        (`insert_tiered`, radix_insert.c): the same steps in one call, calling the same
        hooks (`split_node`, `_revive`, the checker, the heap); it leaves the rare cases
        (a revive inside the cached prefix, a cached_len past the held prefix) to the Python
        below, changing nothing first."""
        tree = self.tree
        native = tree._native
        if native is not None and self._one_frame:
            out = native.insert_tiered(
                tree,
                self._device_heap,
                checker,
                self._revive,
                TreeNode,
                NO_CHILDREN,
                call.key.namespace,
                call.data,
                call.end,
                call.slots,
                call.cached_len,
                call.priority,
            )
            if out is not None:
                return new_result(InsertResult, out)
        root = tree.root
        page_bytes = self._page_bytes
        key, data, end, slots, cached_len, priority = (
            call.key,
            call.data,
            call.end,
            call.slots,
            call.cached_len,
            call.priority,
        )
        namespace = key.namespace
        # The compiled walk when built (reads keys and children only).
        walk = native.walk if native is not None else descend
        path, pos, partial = walk(root, page_bytes, namespace, data, end, None)
        child = None
        if partial:
            parent = path[-1] if path else root
            first = data[pos : pos + page_bytes]
            child = parent.children[(namespace, first) if parent is root else first]
        # Device values are prefix-closed: only the tail of the walk can be off the device.
        revives = (path and not len(path[-1].value)) or (child is not None and not len(child.value))
        if revives and cached_len:
            _refuse_cached_off_device(path, pos, cached_len)
        if checker is not None:
            held = (pos + partial) // TOKEN_BYTES
            checker.check(
                slots, cached_len if revives else max(cached_len, held), end // TOKEN_BYTES
            )
        if child is not None:
            path.append(tree.split_node(child, partial // TOKEN_BYTES))
            pos += partial
        tick = tree.next_tick()
        adopted: list[tuple[int, int]] = []
        node = root
        at = 0
        for node in path:
            node.last_access = tick
            if priority > node.priority:
                node.priority = priority
            n = node.num_tokens
            if revives and not len(node.value):
                assert at >= cached_len, (
                    f"insert: node {node.id} is off the device inside the caller's cached prefix"
                )
                value = slots[at : at + n].copy()
                self._revive(node, value)
                if checker is not None:
                    checker.hold(value)
                adopted.append((at, at + n))
            at += n
        prefix_len = pos // TOKEN_BYTES
        if pos < end:
            leaf = structure.add_leaf(tree, node, data, pos, end, slots, namespace, tick, priority)
            return InsertResult(prefix_len, len(leaf.value), leaf, tuple(adopted), (), cached_len)
        if node in self._device_heap:
            self._device_heap.push(node)  # re-key the leaf for its new access time
        return InsertResult(prefix_len, 0, node, tuple(adopted), (), cached_len)

    def revive_path(
        self, node: TreeNode, slots: npt.NDArray[np.int64], checker: SlotChecker | None
    ) -> bool:
        """`insert_full` of the key ending exactly at `node` with `slots` for the nodes below
        its nearest on-device ancestor (all off the device; one slot per token of theirs, top
        down) and the rest of the key the caller's cached prefix, without walking the key: a
        Full-only load-back's commit when nothing can have changed the path since the load
        was planned (`TierLoader`, inline). The same slot check and marks, tick, access times,
        priorities (insert's priority 0), revives and heap pushes. O(depth).

        Returns False, changing nothing, when the off-device nodes above `node` do not hold
        exactly `len(slots)` tokens: something revived part of the path since the load was
        planned (the device room's poll may commit another load of it); the caller then
        commits through the insert, which gives back the slots loaded twice."""
        path: list[TreeNode] = []
        off_device = 0
        probe = node
        while probe.parent is not None:
            path.append(probe)
            if not len(probe.value):
                off_device += probe.num_tokens
            probe = probe.parent
        if off_device != len(slots):
            return False
        path.reverse()
        if checker is not None:
            checker.check(slots, 0, len(slots))
        tick = self.tree.next_tick()
        at = 0
        for item in path:
            item.last_access = tick
            if item.priority < 0:
                item.priority = 0
            if not len(item.value):
                n = item.num_tokens
                value = slots[at : at + n].copy()
                self._revive(item, value)
                if checker is not None:
                    checker.hold(value)
                at += n
        if node in self._device_heap:
            self._device_heap.push(node)  # re-key the leaf for its new access time
        return True

    def _revive_on_insert(self, node: TreeNode, start: int, call: InsertCall) -> None:
        """Off-device `node`, at token `start` of an insert's key, takes the caller's slots."""
        assert start >= call.cached_len, (
            f"insert: node {node.id} is off the device inside the caller's cached prefix"
        )
        self._revive(node, call.slots[start : start + node.num_tokens].copy())
        inputs = call.inputs
        for component in self._extras:
            component.on_revive(node, start, inputs.get(component.name) if inputs else None)

    def _revive(self, node: TreeNode, value: npt.NDArray[np.int64]) -> None:
        """Off-device `node` takes device slots `value` (its parent is on the device now)."""
        assert node.lock_ref == 0, f"off-device node {node.id} holds a device lock"
        self._drop_candidate(node)
        node.value = value
        self._full.evictable_size += len(value)
        parent = node.parent
        assert parent is not None, "the root is never off the device"
        self._device_heap.discard(parent)
        self._device_heap.push(node)  # its children are all off the device (closure)
        self.tree.emit_stored(node)


def _refuse_cached_off_device(path: list[TreeNode], pos: int, cached_len: int) -> None:
    """InvalidInsert, before any change, when the caller's cached prefix (`cached_len`, slots
    it got from this tree) reaches into a node that is off the device: the tree gave out no
    device slots there. `path` is the walk's (device values are prefix-closed, so the first
    off-device node starts the tail; with none on `path`, the split child at `pos` bytes)."""
    start = 0
    for node in path:
        if not len(node.value):
            break
        start += node.num_tokens
    else:
        start = pos // TOKEN_BYTES
    if start < cached_len:
        raise InvalidInsert(
            f"insert: cached_len {cached_len} reaches past the device prefix ({start} tokens): "
            "the tree gave out no device slots beyond it"
        )
