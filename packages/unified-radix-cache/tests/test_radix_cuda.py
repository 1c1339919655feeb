"""The tree over accelerator allocators: slots cross to the host once per insert and back once
per match result; frees reach the allocator on its device."""

from __future__ import annotations

import pytest
import torch

from kvstrata.allocator import MambaSlotAllocator, PagedAllocator, SWAAllocator
from kvstrata.pool import MambaPool, MambaSpec
from kvstrata.unified_radix_cache import (
    EvictRequest,
    FullComponent,
    MambaComponent,
    MambaInsert,
    RadixKey,
    SWAComponent,
    UnifiedRadixCache,
)

pytestmark = pytest.mark.cuda


def test_full_tree_on_cuda_allocator() -> None:
    alloc = PagedAllocator(size=256, page_size=4, device="cuda")
    tree = UnifiedRadixCache([FullComponent(alloc)], page_size=4)
    slots = alloc.alloc(16)
    assert slots is not None and slots.is_cuda
    tree.insert(RadixKey(list(range(16))), slots)
    m = tree.match_prefix(RadixKey(list(range(16))))
    assert m.device_indices.is_cuda and torch.equal(m.device_indices, slots)
    tree.check_integrity()
    assert tree.evict(EvictRequest.full(16)).num_evicted() == 16
    assert alloc.available_size() == alloc.size
    tree.check_integrity()


def test_swa_and_mamba_trees_on_cuda() -> None:
    swa = SWAAllocator(size=64, swa_size=32, page_size=1, device="cuda")
    tree = UnifiedRadixCache([FullComponent(swa), SWAComponent(swa, sliding_window=2)])
    slots = swa.alloc(8)
    assert slots is not None
    tree.insert(RadixKey(list(range(8))), slots)
    more = swa.alloc(6)
    assert more is not None
    result = tree.insert(RadixKey([0, 1, 2, 3, 9, 9]), more)
    swa.free(result.duplicates(more))
    tree.evict(EvictRequest(targets={"swa": 100}))
    tree.check_integrity()

    states = MambaSlotAllocator(size=4, device="cuda")
    spec = MambaSpec(num_layers=1, conv_dim=2, conv_kernel=2, num_heads=1, head_dim=2, state_size=2)
    pool = MambaPool(spec, 4, device="cuda")
    full = PagedAllocator(size=64, page_size=1, device="cuda")
    mtree = UnifiedRadixCache([FullComponent(full), MambaComponent(states, pool)])
    state = states.alloc(1)
    kv = full.alloc(4)
    assert state is not None and kv is not None
    mtree.insert(RadixKey([1, 2, 3, 4]), kv, inputs={"mamba": MambaInsert(slot=int(state))})
    m = mtree.match_prefix(RadixKey([1, 2, 3, 4]), copy_state=True)
    assert m.states["mamba"].is_cuda
    mtree.check_integrity({"mamba": 1})
