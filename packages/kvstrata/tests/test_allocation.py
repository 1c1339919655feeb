"""`BatchAllocator`: error paths (raised before any change), out-of-memory answers that change
nothing, retraction keeping the computed prefix cached, and decode locations."""

from __future__ import annotations

import pytest

from kvstrata.allocation import BatchAllocator, ContextTooLong, InvalidBatch, InvalidSetup
from kvstrata.allocator import PagedAllocator
from kvstrata.build import MemorySystem
from kvstrata.testkit.tiny_models import tiny_system


def _setup(kv_tokens: int = 96) -> tuple[MemorySystem, BatchAllocator]:
    system = tiny_system("mha", kv_tokens=kv_tokens, rows=3)
    assert system.req_to_token is not None
    alloc = BatchAllocator(
        system.cache, kv_allocator=system.kv_allocator, req_to_token=system.req_to_token
    )
    return system, alloc


def test_bad_batches_are_refused_before_any_change() -> None:
    system, alloc = _setup()
    a = alloc.admit(list(range(1, 10)))
    assert a is not None
    free = system.kv_allocator.available_size()
    with pytest.raises(InvalidBatch):
        alloc.prepare_extend([])
    with pytest.raises(InvalidBatch):
        alloc.prepare_extend([(a, 3), (a, 3)])
    with pytest.raises(InvalidBatch):
        alloc.prepare_extend([(a, 10)])
    with pytest.raises(InvalidBatch):
        alloc.prepare_extend([(a, 0)])
    with pytest.raises(InvalidBatch):
        alloc.prepare_decode([a], [5])  # not prefilled
    assert alloc.prepare_extend([(a, 9)]) is not None
    with pytest.raises(InvalidBatch):
        alloc.prepare_decode([a], [5, 6])
    with pytest.raises(ContextTooLong):
        alloc.admit(list(range(65)))
    with pytest.raises(InvalidBatch):
        alloc.admit([])
    assert a.seq_len == 9 and system.kv_allocator.available_size() == free - 12
    alloc.finish(a)
    with pytest.raises(InvalidBatch):
        alloc.finish(a)
    with pytest.raises(InvalidBatch):
        alloc.prepare_decode([a], [1])
    system.check_integrity()


def test_context_limit_in_decode() -> None:
    system, alloc = _setup()
    a = alloc.admit(list(range(1, 65)))
    assert a is not None and alloc.prepare_extend([(a, 64)]) is not None
    with pytest.raises(ContextTooLong):
        alloc.prepare_decode([a], [3])
    alloc.abort(a)
    system.check_integrity()


def test_mismatched_page_size_is_refused() -> None:
    system, _ = _setup()
    with pytest.raises(InvalidSetup):
        BatchAllocator(
            system.cache,
            kv_allocator=PagedAllocator(size=64, page_size=8),
            req_to_token=system.req_to_token,  # type: ignore[arg-type]
        )


def test_out_of_rows_and_out_of_memory_change_nothing() -> None:
    system, alloc = _setup(kv_tokens=64)
    running = [alloc.admit([i, i + 1]) for i in (1, 10, 20)]
    assert all(r is not None for r in running)
    assert alloc.admit([7, 8]) is None  # three rows only
    a = running[0]
    assert a is not None
    alloc.abort(a)
    b = alloc.admit(list(range(100, 160)))
    assert b is not None and alloc.prepare_extend([(b, 60)]) is not None
    old = running[1]
    assert old is not None
    alloc.abort(old)
    free = system.kv_allocator.available_size()
    c = alloc.admit(list(range(300, 302 + free)))  # nothing cached to evict: b holds the rest
    assert c is not None
    assert alloc.prepare_extend([(c, free + 2)]) is None
    assert c.seq_len == 0 and system.kv_allocator.available_size() == free
    alloc.check_integrity()
    system.check_integrity(held=alloc.held())


def test_retraction_keeps_the_computed_prefix_and_decode_fills_pages() -> None:
    system, alloc = _setup()
    a = alloc.admit(list(range(1, 7)))
    assert a is not None and alloc.prepare_extend([(a, 6)]) is not None
    slots = []
    for token in (40, 41, 42):
        out = alloc.prepare_decode([a], [token])
        assert out is not None
        slots.append(int(out.out_cache_loc[0]))
    # Positions 6, 7 share the page of position 4, 5; position 8 opens a new page.
    table = system.req_to_token
    assert table is not None
    row = table.req_to_token[a.row, :9].tolist()
    assert slots == row[6:9] and row[6] == row[5] + 1 and row[7] == row[6] + 1
    assert row[8] % 4 == 0
    tokens = alloc.retract(a)
    assert tokens == [1, 2, 3, 4, 5, 6, 40, 41, 42]
    again = alloc.admit(tokens)
    assert again is not None and again.hit_len == 8  # whole pages of the 9 computed tokens
    assert table.req_to_token[again.row, :8].tolist() == row[:8]
    alloc.abort(again)
    system.check_integrity()
