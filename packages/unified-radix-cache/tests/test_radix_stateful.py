"""Hypothesis state machines over insert, match, lock, unlock, evict and reset for every
component mix and two page sizes, with every invariant checked after every step
(free + evictable + protected + held == capacity per pool, locks == receipts, structure)."""

from __future__ import annotations

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
    LockReceipt,
    MambaInsert,
    RadixKey,
    SWAInsert,
    TreeNode,
)
from kvstrata.unified_radix_cache.errors import (
    ForeignNode,
    ReceiptAlreadyReleased,
    StateSlotsExhausted,
    TreeLocked,
)

TOKENS = st.lists(st.integers(0, 3), min_size=1, max_size=12)
NAMESPACES = st.sampled_from([None, "lora"])


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
        result = self.tree.insert(key, slots, inputs=inputs or None)
        duplicates = result.duplicates(slots)
        if len(duplicates):
            self.kit.full.free(duplicates)
        kept = result.prefix_len + result.inserted_len
        assert kept == len(tokens) - len(tokens) % page
        if kept < len(tokens):
            self.kit.full.free(slots[kept:])
        if state is not None and "mamba" not in result.adopted_states:
            assert self.kit.mamba is not None
            self.kit.mamba.free(state)
        if self.family == "full":
            assert self.tree.match_prefix(key).prefix_len == kept
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
