"""`HostWalks`: the match and insert walks a hierarchical tree sends to its `HostTier` in place
of its fast path (one walk covers both tiers; see host_tier.py for the layout).

- match: the device hit is the run of on-device nodes (ended by the Mamba or SWA rule in a
  hybrid tree); the host hit continues over off-device nodes as far as they are restorable
  (Mamba: a host state at the end; SWA: the window before the end restorable);
- insert: off-device nodes the key runs over take the caller's slots again (revive), a new leaf
  takes the rest, and a hybrid tree runs its component hooks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from kvstrata.unified_radix_cache.components.full import FullComponent
from kvstrata.unified_radix_cache.components.mamba import MambaComponent
from kvstrata.unified_radix_cache.components.swa import SWAComponent, SWAInsert
from kvstrata.unified_radix_cache.key import TOKEN_BYTES, RadixKey
from kvstrata.unified_radix_cache.node import TreeNode
from kvstrata.unified_radix_cache.policies import LeafHeap
from kvstrata.unified_radix_cache.results import InsertResult, MatchResult
from kvstrata.unified_radix_cache.walk import descend

if TYPE_CHECKING:
    import torch

    from kvstrata.unified_radix_cache.components.base import ComponentInsert
    from kvstrata.unified_radix_cache.tree import UnifiedRadixCache

_NO_SLOTS = np.empty(0, dtype=np.int64)


class HostWalks:
    """Match and insert over both tiers of a hierarchical tree, and the host heap's membership
    bookkeeping both they and `HostTier` go through (the candidates' host SWA tokens and host
    states are counted as nodes join and leave). The attributes are set by
    `HostTier.__init__`."""

    tree: UnifiedRadixCache
    heap: LeafHeap
    _full: FullComponent
    _mamba: MambaComponent | None
    _swa: SWAComponent | None
    _device_heap: LeafHeap
    _page_bytes: int
    candidate_swa_size: int
    candidate_states: int

    def _add_candidate(self, node: TreeNode) -> None:
        """`node` joins the host heap (a re-push only re-keys it; the counts move once)."""
        if node not in self.heap:
            if node.host_swa is not None:
                self.candidate_swa_size += len(node.host_swa)
            self.candidate_states += node.host_state is not None
        self.heap.push(node)

    def _drop_candidate(self, node: TreeNode) -> None:
        """`node` leaves the host heap if it is in it (lock, revive, a child, eviction)."""
        if node in self.heap:
            self.heap.discard(node)
            self._uncount_candidate(node)

    def _uncount_candidate(self, node: TreeNode) -> None:
        if node.host_swa is not None:
            self.candidate_swa_size -= len(node.host_swa)
        self.candidate_states -= node.host_state is not None

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
        to the tree's hit counters (the tree counted the query). Mamba trees: both hits end
        where a state is restorable (device state / host state); with `copy_state` the device
        state is copied into a slot the caller owns (`states["mamba"]`). Without `touch`
        (a re-match of a key already matched) no access time, hit count or heap key changes,
        so a request counts one hit per node. O(K + depth)."""
        tree = self.tree
        path = tree.walk(key.namespace, data, end)
        on_device = 0
        while on_device < len(path) and len(path[on_device].value):
            on_device += 1
        if self._mamba is not None:
            return self._match_mamba(self._mamba, path, on_device, count, copy_state, touch)
        if self._swa is not None:
            return self._match_swa(self._swa, path, on_device, count, touch)
        device_nodes, host_nodes = path[:on_device], path[on_device:]
        last = device_nodes[-1] if device_nodes else tree.root
        last_host = host_nodes[-1] if host_nodes else None
        if touch:
            self._touch(path, last, last_host)
        return self._result(device_nodes, host_nodes, last, last_host, count=count)

    def _match_mamba(
        self,
        mamba: MambaComponent,
        path: list[TreeNode],
        on_device: int,
        count: bool,
        copy_state: bool,
        touch: bool,
    ) -> MatchResult:
        """`match` of a Full + Mamba tree: the device hit ends at the last on-device node with
        a device state, the host hit at the last node after it with a host state."""
        tree = self.tree
        i = mamba.index
        device_end = 0
        for k in range(on_device, 0, -1):
            values = path[k - 1].comp_values
            assert values is not None, "a Mamba tree's node has component values"
            if values[i] is not None:
                device_end = k
                break
        host_end = device_end
        for k in range(len(path), device_end, -1):
            if path[k - 1].host_state is not None:
                host_end = k
                break
        device_nodes, host_nodes = path[:device_end], path[device_end:host_end]
        last = device_nodes[-1] if device_nodes else tree.root
        last_host = host_nodes[-1] if host_nodes else None
        # Raises (StateSlotsExhausted) before the match changes anything else.
        copied = mamba.finalize_match(last, copy_state)
        if touch:
            for item in device_nodes:
                mamba.on_access(item)
            self._touch(path, last, last_host)
        states = {mamba.name: copied} if copied is not None else None
        return self._result(device_nodes, host_nodes, last, last_host, count=count, states=states)

    def _match_swa(
        self, swa: SWAComponent, path: list[TreeNode], on_device: int, count: bool, touch: bool
    ) -> MatchResult:
        """`match` of a Full + SWA tree: the device hit ends where the SWA rule says, the host
        hit at the last node (with a host value) whose window is restorable."""
        tree = self.tree
        device_end = swa.match_end(path[:on_device])
        host_end = device_end
        for k in range(len(path), device_end, -1):
            if path[k - 1].host_value is not None and self.window_restorable(path[k - 1]):
                host_end = k
                break
        device_nodes, host_nodes = path[:device_end], path[device_end:host_end]
        last = device_nodes[-1] if device_nodes else tree.root
        last_host = host_nodes[-1] if host_nodes else None
        if touch:
            for item in path[:on_device]:
                swa.on_access(item)
            self._touch(path, last, last_host)
        return self._result(device_nodes, host_nodes, last, last_host, count=count)

    def _result(
        self,
        device_nodes: list[TreeNode],
        host_nodes: list[TreeNode],
        last: TreeNode,
        last_host: TreeNode | None,
        *,
        count: bool,
        states: Mapping[str, torch.Tensor] | None = None,
    ) -> MatchResult:
        """The MatchResult of a walk split into its device and host hits (counted into the
        tree's hit counters when `count`)."""
        tree = self.tree
        device_len = sum(len(n.value) for n in device_nodes)
        host_len = sum(n.num_tokens for n in host_nodes)
        if count:
            tree.hit_tokens += device_len
            tree.host_hit_tokens += host_len
        slots = np.concatenate([n.value for n in device_nodes]) if device_nodes else _NO_SLOTS
        device = self._full.to_device(slots)
        if states is None:
            return MatchResult(device_len, device, last, host_len, last_host)
        return MatchResult(device_len, device, last, host_len, last_host, states)

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

    def window_restorable(self, node: TreeNode) -> bool:
        """SWA trees: whether the sliding window before the end of `node` can be restored:
        each node of it on the device with live SWA slots, or off the device with a host SWA
        copy (a path without a gap back to the root counts too). O(nodes in the window)."""
        swa = self._swa
        assert swa is not None, "window_restorable on a tree without SWA"
        covered = 0
        probe = node
        while probe.parent is not None and covered < swa.sliding_window:
            if not (swa.is_live(probe) if len(probe.value) else probe.host_swa is not None):
                return False
            covered += probe.num_tokens
            probe = probe.parent
        return True

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

    def insert(
        self,
        key: RadixKey,
        data: bytes,
        end: int,
        slots: npt.NDArray[np.int64],
        cached_len: int,
        priority: int,
        inputs: Mapping[str, ComponentInsert] | None = None,
    ) -> InsertResult:
        """The tree's insert: off-device nodes the key runs over take the caller's slots again
        (revive; listed in `adopted`), a new leaf takes the rest; a Mamba tree's node ending at
        the key adopts `inputs["mamba"]`'s state when it has no device state. An SWA tree runs
        its hooks (revive device tombstones, split the new leaf at `evicted_len`), and a revived
        node's SWA slots stay live from `inputs["swa"].evicted_len` on (before it they are
        freed: a tombstone). O(K + depth)."""
        tree = self.tree
        mamba = self._mamba
        swa = self._swa
        swa_input = inputs.get(swa.name) if swa is not None and inputs else None
        evicted_len = swa_input.evicted_len if isinstance(swa_input, SWAInsert) else 0
        tick = tree.next_tick()
        namespace = key.namespace
        adopted: list[tuple[int, int]] = []

        def visit(node: TreeNode, at: int) -> None:
            node.last_access = tick
            if priority > node.priority:
                node.priority = priority
            if mamba is not None:
                mamba.on_access(node)
            start = at // TOKEN_BYTES
            if not len(node.value):
                assert start >= cached_len, (
                    f"insert: node {node.id} is off the device inside the caller's cached prefix"
                )
                self._revive(node, slots[start : start + node.num_tokens].copy())
                adopted.append((start, start + node.num_tokens))
                if swa is not None:
                    swa.on_revive(node, live=start >= evicted_len)
            elif swa is not None:
                swa.on_access(node)
                if swa.on_insert_overlap(node, start, slots, swa_input, cached_len):
                    adopted.append((start, start + node.num_tokens))

        path, pos, _ = descend(
            tree.root, self._page_bytes, namespace, data, end, tree.split_node, visit
        )
        node = path[-1] if path else tree.root
        prefix_len = pos // TOKEN_BYTES
        inserted = 0
        if pos < end:
            node = tree.add_leaf(node, data, pos, end, slots, namespace, tick, priority)
            inserted = (end - pos) // TOKEN_BYTES
            if swa is not None:
                # May split the leaf at the window boundary; `node` keeps the tail.
                swa.on_insert_new(node, prefix_len, swa_input)
        elif node in self._device_heap:
            self._device_heap.push(node)
        if swa is not None:
            tree.flush_pending()
        states: tuple[str, ...] = ()
        if (
            mamba is not None
            and inputs
            and node.parent is not None
            and mamba.on_insert_commit(node, inputs.get(mamba.name))
        ):
            states = (mamba.name,)
        return InsertResult(prefix_len, inserted, node, tuple(adopted), states, cached_len)

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
