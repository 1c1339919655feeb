"""Hypothesis state machines over insert, match, lock, unlock, evict and reset for every
component mix and two page sizes, with every invariant checked after every step
(free + evictable + protected + held == capacity per pool, locks == receipts, structure).
`evict_refused` injects a free the allocator refuses (the engine freed slots the tree holds
behind its back) and checks the refused evict left the tree exactly as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvstrata.allocator import SWAAllocator
from kvstrata.testkit.trees import TreeKit, make_tree
from kvstrata.unified_radix_cache import (
    ComponentInsert,
    EvictRequest,
    InsertResult,
    LockReceipt,
    MambaInsert,
    RadixKey,
    SWAInsert,
    TreeNode,
)
from kvstrata.unified_radix_cache.components.base import LRUListComponent
from kvstrata.unified_radix_cache.components.full import FullComponent
from kvstrata.unified_radix_cache.errors import (
    ForeignNode,
    HeldSlotsNotAllocated,
    ReceiptAlreadyReleased,
    StateSlotsExhausted,
    TreeLocked,
)
from kvstrata.unified_radix_cache.tree import UnifiedRadixCache

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=12)
NAMESPACES = st.sampled_from([None, "lora"])


def snapshot(tree: UnifiedRadixCache) -> tuple[object, ...]:
    """Structure, per-component data, locks, sizes, LRU orders and the Full heap (read-only)."""
    nodes = []
    for n in sorted(tree.iter_nodes(), key=lambda n: n.id):
        values = [v.tolist() if isinstance(v, np.ndarray) else v for v in (n.comp_values or [])[1:]]
        assert n.parent is not None
        nodes.append((n.id, n.parent.id, n.key, n.value.tolist(), values, n.heap_entry))
    comps = tree.components
    sizes = [(c.evictable_size, c.protected_size, c.evicted_total) for c in comps]
    lrus = [[n.id for n in c.lru.nodes()] for c in comps if isinstance(c, LRUListComponent)]
    return (tuple(nodes), sizes, lrus, tree.num_nodes, [c.free_size() for c in comps])


class TreeMachine(RuleBasedStateMachine):
    family = "full"
    page_size = 1

    nodes = Bundle("nodes")
    receipts = Bundle("receipts")

    def __init__(self) -> None:
        super().__init__()
        self.kit: TreeKit = make_tree(
            self.family,
            size=64,
            swa_size=48,
            page_size=self.page_size,
            sliding_window=3,
            mamba_slots=6,
        )
        self.copies: list[torch.Tensor] = []
        self.released: list[LockReceipt] = []
        self.keys: list[RadixKey] = []

    @property
    def tree(self):
        return self.kit.tree

    def _make_room(self, need: int) -> torch.Tensor | None:
        full = self.kit.full
        slots = full.alloc(need)
        if slots is None:
            targets = {"full": need}
            if isinstance(full, SWAAllocator):
                targets["swa"] = need
            self.tree.evict(EvictRequest(targets=targets))
            slots = full.alloc(need)
        return slots

    def _state(self) -> torch.Tensor | None:
        assert self.kit.mamba is not None
        slot = self.kit.mamba.alloc(1)
        if slot is None:
            self.tree.evict(EvictRequest(targets={"mamba": 1}))
            slot = self.kit.mamba.alloc(1)
        return slot

    @rule(target=nodes, tokens=TOKENS, ns=NAMESPACES, dropped=st.integers(0, 12))
    def insert(self, tokens: list[int], ns: str | None, dropped: int):
        page = self.page_size
        slots = self._make_room(-(-len(tokens) // page) * page)
        if slots is None:
            return multiple()
        slots = slots[: len(tokens)]
        inputs: dict[str, ComponentInsert] = {}
        state = None
        if self.family == "swa" and dropped:
            dropped = min(dropped, len(tokens))
            assert isinstance(self.kit.full, SWAAllocator)
            self.kit.full.free_swa(slots[:dropped])
            inputs["swa"] = SWAInsert(evicted_len=dropped)
        if self.family == "mamba" and len(tokens) % page == 0:
            state = self._state()
            if state is not None:
                inputs["mamba"] = MambaInsert(slot=int(state))
        key = RadixKey(tokens, extra_key=ns)
        self.keys = [*self.keys[-5:], key]
        result = self.tree.insert(key, slots, inputs=inputs or None)
        kept = self._free_unkept(result, slots, len(tokens))
        if state is not None and "mamba" not in result.adopted_states:
            assert self.kit.mamba is not None
            self.kit.mamba.free(state)
        if self.family == "full":
            assert self.tree.match_prefix(key).prefix_len == kept
        return result.last_node

    def _free_unkept(self, result: InsertResult, slots: torch.Tensor, num_tokens: int) -> int:
        """Give back what the tree did not keep (its duplicates and the partial page's slots):
        returns the tokens kept, whole pages of the key."""
        duplicates = result.duplicates(slots)
        if len(duplicates):
            self.kit.full.free(duplicates)
        kept = result.prefix_len + result.inserted_len
        assert kept == num_tokens - num_tokens % self.page_size
        if kept < num_tokens:
            self.kit.full.free(slots[kept:])
        return kept

    @rule(target=nodes, tokens=TOKENS, ns=NAMESPACES, lock=st.booleans(), evict=st.integers(0, 8))
    def match_evict_insert(self, tokens: list[int], ns: str | None, lock: bool, evict: int):
        """A scheduler's order on one key object: match, (lock), evict, insert, (unlock). A
        Full-only insert reuses the match's walk while it holds (walk_reuse tests)."""
        key = RadixKey(tokens, extra_key=ns)
        m = self.tree.match_prefix(key)
        receipt = self.tree.lock(m.last_node) if lock else None
        if evict:
            self.tree.evict(EvictRequest.full(evict))
        page = self.page_size
        slots = self._make_room(-(-len(tokens) // page) * page)
        if slots is None:
            if receipt is not None:
                self.tree.unlock(receipt)
            return multiple()
        slots = slots[: len(tokens)]
        result = self.tree.insert(key, slots)
        assert result.prefix_len >= (m.prefix_len if lock else 0)
        kept = self._free_unkept(result, slots, len(tokens))
        if receipt is not None:
            self.tree.unlock(receipt)
        if self.family == "full":
            assert self.tree.match_prefix(RadixKey(tokens, extra_key=ns)).prefix_len == kept
        return result.last_node

    @rule(target=nodes, tokens=TOKENS, ns=NAMESPACES, copy=st.booleans())
    def match(self, tokens: list[int], ns: str | None, copy: bool):
        key = RadixKey(tokens, extra_key=ns)
        try:
            m = self.tree.match_prefix(key, copy_state=copy)
        except StateSlotsExhausted:
            # every state slot is in use and none but the matched one could be evicted
            assert self.kit.mamba is not None and self.kit.mamba.available_size() == 0
            m = self.tree.match_prefix(key)
        assert m.prefix_len % self.page_size == 0 and m.prefix_len <= len(tokens)
        assert m.device_indices.numel() == m.prefix_len
        if "mamba" in m.states:
            self.copies.append(m.states["mamba"])
        return m.last_node

    @rule(target=receipts, node=nodes)
    def lock(self, node: TreeNode):
        try:
            receipt = self.tree.lock(node)
        except ForeignNode:
            assert node.parent is None and node is not self.tree.root
            return multiple()
        assert self.tree.protected_size() >= node.num_tokens
        return receipt

    @rule(receipt=consumes(receipts))
    def unlock(self, receipt: LockReceipt) -> None:
        self.tree.unlock(receipt)
        self.released.append(receipt)

    @precondition(lambda self: bool(self.released))
    @rule(index=st.integers(0, 100))
    def unlock_twice(self, index: int) -> None:
        with pytest.raises(ReceiptAlreadyReleased):
            self.tree.unlock(self.released[index % len(self.released)])

    @rule(full=st.integers(0, 20), swa=st.integers(0, 20), mamba=st.integers(0, 3))
    def evict(self, full: int, swa: int, mamba: int) -> None:
        targets = {"full": full}
        if self.family == "swa":
            targets["swa"] = swa
        if self.family == "mamba":
            targets["mamba"] = mamba
        before = self.tree.evictable_size()
        result = self.tree.evict(EvictRequest(targets=targets))
        if self.family == "full":
            want = min(full, before)
            assert want <= result.num_evicted() < want + self.page_size or want == 0
        assert result.num_evicted() <= before

    @rule(
        victim=st.sampled_from(["full", "swa", "mamba"]),
        full=st.integers(1, 20),
        swa=st.integers(0, 20),
        mamba=st.integers(0, 3),
    )
    def evict_refused(self, victim: str, full: int, swa: int, mamba: int) -> None:
        """The engine frees slots the tree holds (behind its back) that this evict must free:
        the last page of the first leaf Full evicts, the full slots of the first SWA leaf, or
        the state slot Mamba evicts first. The evict raises and changes nothing; then the
        engine's mistake is undone (allocator state restored) and every invariant holds."""
        tree, kit, page = self.tree, self.kit, self.page_size
        # Matched first: a match may split a node, which changes what evicts first.
        matched = [tree.match_prefix(k).device_indices.tolist() for k in self.keys]
        targets = {"full": full if victim == "full" else 0}
        allocator = kit.full
        freed: torch.Tensor | None = None
        if victim == "full":
            component = tree.components[0]
            assert isinstance(component, FullComponent) and component.heap is not None
            leaf = component.heap.peek()
            if leaf is not None:
                freed = torch.from_numpy(leaf.value[-page:].copy())
        elif victim == "swa" and self.family == "swa":
            component = tree.component("swa")
            assert isinstance(component, LRUListComponent)
            first = next(iter(component.lru.nodes()), None)
            targets["swa"] = max(swa, 1)
            if first is not None and not first.children and first.lock_ref == 0:
                freed = torch.from_numpy(first.value.copy())  # the whole leaf goes
        elif victim == "mamba" and self.family == "mamba":
            component = tree.component("mamba")
            assert isinstance(component, LRUListComponent) and kit.mamba is not None
            first = next(iter(component.lru.nodes()), None)
            targets["mamba"] = max(mamba, 1)
            if first is not None:
                assert first.comp_values is not None
                freed = torch.tensor([first.comp_values[component.index]])
                allocator = kit.mamba
        if freed is None:
            return
        state = allocator.backup_state()
        allocator.free(freed)
        before = snapshot(tree)
        with pytest.raises(HeldSlotsNotAllocated):
            tree.evict(EvictRequest(targets=targets))
        assert snapshot(tree) == before
        allocator.restore_state(state)
        assert [tree.match_prefix(k).device_indices.tolist() for k in self.keys] == matched

    @precondition(lambda self: bool(self.copies))
    @rule()
    def drop_state_copy(self) -> None:
        assert self.kit.mamba is not None
        self.kit.mamba.free(self.copies.pop())

    @rule()
    def reset(self) -> None:
        if self.tree.num_locked:
            with pytest.raises(TreeLocked):
                self.tree.reset()
        else:
            self.tree.reset()
            assert self.tree.num_nodes == 0
            for component in self.tree.components:
                assert component.free_size() == component.capacity() - (
                    len(self.copies) if component.name == "mamba" else 0
                )

    @invariant()
    def integrity(self) -> None:
        self.kit.check({"mamba": len(self.copies)})


def _machine(family: str, page_size: int) -> type[TreeMachine]:
    return type(
        f"{family.title()}P{page_size}Machine",
        (TreeMachine,),
        {"family": family, "page_size": page_size},
    )


# Half the profile's examples (six machines share the suite's time budget); the `thorough`
# profile scales them up with the rest.
_SETTINGS = settings(max_examples=max(settings().max_examples // 2, 10))

TestFullP1 = _SETTINGS(_machine("full", 1)).TestCase
TestFullP2 = _SETTINGS(_machine("full", 2)).TestCase
TestSwaP1 = _SETTINGS(_machine("swa", 1)).TestCase
TestSwaP2 = _SETTINGS(_machine("swa", 2)).TestCase
TestMambaP1 = _SETTINGS(_machine("mamba", 1)).TestCase
TestMambaP2 = _SETTINGS(_machine("mamba", 2)).TestCase
