"""Hypothesis state machine: a scheduler's life cycle through `BatchAllocator` on a tight
memory system built by `kvstrata.build` (admit, extend a chunk, decode the prefilled batch,
finish, retract and re-admit, abort), for the MHA, SWA-hybrid and Mamba-hybrid layouts.

After every step: the system's integrity with what the running requests hold (allocators,
pools, request table, tree: free + evictable + protected + held == capacity), the allocator's
own bookkeeping (every row holds exactly its request's slots), and the KV itself: every
running request's table row reads back K = token id and V = position for each token with KV,
so a prefix the cache hands out for other tokens, a row pointing at a freed slot that was
reused, or a wrong scatter fails at once.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstrata.allocation import BatchAllocator, Running
from kvstrata.build import MemorySystem
from kvstrata.testkit.tiny_models import tiny_system

PREFIXES = (tuple(range(1, 11)), tuple(range(20, 26)))
suffixes = st.lists(st.integers(30, 60), min_size=1, max_size=14)


def stand_in_write(
    system: MemorySystem,
    layer: int,
    starts: torch.Tensor,
    lens: torch.Tensor,
    loc: torch.Tensor,
    tokens: list[int],
) -> None:
    """K = token id, V = position of each written token, in one attention layer."""
    spans = zip(starts.tolist(), lens.tolist(), strict=True)
    positions = torch.cat([torch.arange(s, s + n) for s, n in spans])
    shape = system.layers.get_key_buffer(layer).shape[1:]
    k = torch.tensor(tokens, dtype=torch.float32).reshape(-1, 1, 1).expand(-1, *shape)
    v = positions.to(torch.float32).reshape(-1, 1, 1).expand(-1, *shape)
    system.layers.set_kv(layer, loc, k.contiguous(), v.contiguous())


class AllocationMachine(RuleBasedStateMachine):
    kind = "mha"

    @initialize()
    def build(self) -> None:
        self.system = tiny_system(self.kind, kv_tokens=96, mamba_slots=9)
        assert self.system.req_to_token is not None
        self.alloc = BatchAllocator(
            self.system.cache,
            kv_allocator=self.system.kv_allocator,
            req_to_token=self.system.req_to_token,
            state_pool=self.system.mamba_pool,
        )
        self.layer = self.system.layers.layer_ids[1] if self.kind != "mha" else 0
        self.retracted: list[list[int]] = []

    # --- rules ---------------------------------------------------------------------------------
    @rule(prefix=st.sampled_from(PREFIXES), suffix=suffixes)
    def admit(self, prefix: tuple[int, ...], suffix: list[int]) -> None:
        running = self.alloc.admit([*prefix, *suffix])
        if running is not None:
            assert running.seq_len == running.hit_len <= len(running.tokens) - 1
            assert running.hit_len % self.system.page_size == 0

    @precondition(lambda self: bool(self.retracted))
    @rule()
    def readmit(self) -> None:
        tokens = self.retracted[0]
        if self.alloc.admit(tokens) is not None:
            self.retracted.pop(0)

    @precondition(lambda self: any(not r.prefilled for r in self.alloc.running))
    @rule(data=st.data(), cache_chunk=st.booleans())
    def extend(self, data: st.DataObject, cache_chunk: bool) -> None:
        pending = [r for r in self.alloc.running if not r.prefilled]
        chunks = []
        for r in pending:
            left = len(r.tokens) - r.seq_len
            chunks.append((r, data.draw(st.integers(1, left))))
        before = [(r.seq_len, list(r.tokens)) for r in pending]
        batch = self.alloc.prepare_extend(chunks)
        if batch is None:
            assert [(r.seq_len, list(r.tokens)) for r in pending] == before
            return
        written = [t for r, n in chunks for t in r.tokens[r.seq_len - n : r.seq_len]]
        assert len(batch.out_cache_loc) == len(written) == int(batch.extend_lens.sum())
        stand_in_write(
            self.system,
            self.layer,
            batch.prefix_lens,
            batch.extend_lens,
            batch.out_cache_loc,
            written,
        )
        assert (batch.swa_cache_loc is None) == (self.system.swa_allocator is None)
        if cache_chunk:
            for r, _ in chunks:
                if not r.prefilled:
                    self.alloc.cache_chunk(r)

    @precondition(lambda self: any(r.prefilled for r in self.alloc.running))
    @rule(token=st.integers(30, 60))
    def decode(self, token: int) -> None:
        batch = [r for r in self.alloc.running if r.prefilled]
        lens = [r.seq_len for r in batch]
        out = self.alloc.prepare_decode(batch, [token] * len(batch))
        if out is None:
            assert [r.seq_len for r in batch] == lens
            return
        assert out.seq_lens.tolist() == [n + 1 for n in lens]
        stand_in_write(
            self.system,
            self.layer,
            torch.tensor(lens),
            torch.ones(len(batch), dtype=torch.int64),
            out.out_cache_loc,
            [token] * len(batch),
        )
        if out.state_slots is not None:
            assert out.state_slots.tolist() == [r.state_slot for r in batch]

    @precondition(lambda self: bool(self.alloc.running))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.alloc.finish(data.draw(st.sampled_from(self.alloc.running)))

    @precondition(lambda self: bool(self.alloc.running))
    @rule(data=st.data())
    def retract(self, data: st.DataObject) -> None:
        r: Running = data.draw(st.sampled_from(self.alloc.running))
        tokens = list(r.tokens)
        assert self.alloc.retract(r) == tokens
        self.retracted.append(tokens)

    @precondition(lambda self: bool(self.alloc.running))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        self.alloc.abort(data.draw(st.sampled_from(self.alloc.running)))

    # --- invariants ----------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "alloc"):
            return
        self.alloc.check_integrity()
        self.system.check_integrity(held=self.alloc.held())
        table = self.system.req_to_token
        assert table is not None
        k = self.system.layers.get_key_buffer(self.layer)
        v = self.system.layers.get_value_buffer(self.layer)
        for r in self.alloc.running:
            slots = table.req_to_token[r.row, : r.seq_len].to(torch.int64)
            assert k[slots, 0, 0].tolist() == [float(t) for t in r.tokens[: r.seq_len]]
            assert v[slots, 0, 0].tolist() == [float(p) for p in range(r.seq_len)]


class SWAAllocationMachine(AllocationMachine):
    kind = "swa"


class MambaAllocationMachine(AllocationMachine):
    kind = "mamba"


@pytest.mark.parametrize(
    "machine",
    [AllocationMachine, SWAAllocationMachine, MambaAllocationMachine],
    ids=["mha", "swa", "mamba"],
)
def test_allocation_state_machine(machine: type[AllocationMachine]) -> None:
    machine.TestCase().runTest()
