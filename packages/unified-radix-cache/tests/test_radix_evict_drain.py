"""The unchecked evict of a Full-only device tree runs its loop and its flush in one compiled
call (`RadixCore.evict` given `held`, `native_core.evict_leaves(..., flush=True)`): the same
leaves, frees, held flags and errors as the loop then `FullComponent.flush`."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import numpy as np
import pytest

from kvstrata.pool.native import disabled
from kvstrata.unified_radix_cache import EvictRequest, RadixKey, UnifiedRadixCache
from kvstrata.unified_radix_cache.components.full import FullComponent
from kvstrata.unified_radix_cache.native_core import native_core

CORE = native_core()
needs_core = pytest.mark.skipif(CORE is None, reason="no compiled radix core (no compiler?)")
PATHS = (False, True) if CORE is not None else (True,)


class _Sink:
    """A stand-in slot sink without `check_allocated` (the unchecked evict), recording frees;
    `live`: the slots the tree holds (counted by the test's inserts)."""

    device = "cpu"
    size = 1 << 16

    def __init__(self) -> None:
        self.freed: list[list[int]] = []
        self.live = 0

    def available_size(self) -> int:
        return self.size - self.live

    def free(self, indices: Any, /) -> None:
        self.freed.append(indices.tolist())
        self.live -= len(self.freed[-1])


def _filled(off: bool) -> tuple[UnifiedRadixCache, _Sink]:
    sink = _Sink()
    with disabled() if off else nullcontext():
        tree = UnifiedRadixCache([FullComponent(sink)], page_size=2)  # pyright: ignore[reportArgumentType]
    base = 100
    for key in ([1, 2, 3, 4], [1, 2, 5, 6, 7, 8], [9, 9], [4, 4, 4, 4, 4, 4]):
        sink.live += tree.insert(RadixKey(key), np.arange(base, base + len(key))).inserted_len
        base += 10
    return tree, sink


@pytest.mark.parametrize("amount", [1, 3, 6, 9, 100])
def test_the_unchecked_evict_frees_the_same_slots_in_one_call_on_both_paths(
    amount: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same result, nodes, sizes, held flags and one `free` of the same slots, compiled or
    not; compiled, `flush` does not run (the drain is inside the eviction call)."""
    flushes: list[bool] = []
    plain_flush = FullComponent.flush

    def counted(self: FullComponent) -> None:
        flushes.append(True)
        plain_flush(self)

    monkeypatch.setattr(FullComponent, "flush", counted)
    seen = []
    for off in PATHS:
        tree, sink = _filled(off)
        del flushes[:]
        got = tree.evict(EvictRequest.full(amount))
        held = tree._full.held
        assert held is not None
        seen.append(
            (
                got.evicted,
                got.nodes_removed,
                sink.freed,
                np.flatnonzero(held).tolist(),
                tree.num_nodes,
                tree.evictable_size(),
                tree._full._pending,
            )
        )
        assert len(sink.freed) == 1
        assert flushes == ([True] if off else [])
        tree.check_integrity()
    assert all(s == seen[0] for s in seen)


@needs_core
def test_the_compiled_eviction_with_held_returns_what_drain_would() -> None:
    """`evict(..., progress, held)` = `evict(..., progress, False)` then `drain(pending, held)`;
    a call of another arity is refused."""
    assert CORE is not None
    outs = []
    for with_held in (False, True):
        tree, _ = _filled(False)
        full = tree._full
        held = full.held
        assert held is not None
        progress = bytearray(16)
        args = (tree._heap, 5, 2, 16, tree.root, (), full._pending, None, None, progress)
        if with_held:
            freed, gone, joined = CORE.evict(*args, held)
        else:
            freed, gone, nothing = CORE.evict(*args, False)
            assert nothing is None
            joined = CORE.drain(full._pending, held)
        assert joined is not None
        outs.append((freed, gone, bytes(joined), full._pending, np.flatnonzero(held).tolist()))
    assert outs[0] == outs[1]
    assert outs[0][2] and outs[0][3] == []
    # Nothing evicted (a zero target): nothing joined.
    tree, _ = _filled(False)
    assert tree._full.held is not None
    args = (tree._heap, 0, 2, 16, tree.root, (), [], None, None, bytearray(16))
    assert CORE.evict(*args, tree._full.held) == (0, 0, None)
    assert CORE.evict(*args, None) == (0, 0, None)
    with pytest.raises(TypeError, match="held"):
        CORE.evict(*args)  # pyright: ignore[reportCallIssue]


@needs_core
def test_a_refused_drain_after_the_eviction_keeps_the_queue_and_counts_the_leaves() -> None:
    """A held table the drain refuses (8-byte items) raises after the loop: the leaves are
    gone and counted (sizes, evicted total, node count, as the loop then a raising `flush`
    leaves them), their slots still queued; a good table then frees them."""
    tree, sink = _filled(False)
    full = tree._full
    table = full.held
    before = (tree.num_nodes, tree.evictable_size())
    full.held = np.zeros(8, dtype=np.int64)  # pyright: ignore[reportAttributeAccessIssue]
    with pytest.raises(ValueError, match="1-D buffer"):
        tree.evict(EvictRequest.full(5))
    assert sink.freed == []
    queued = sum(len(p) for p in full._pending)
    assert queued == full.evicted_total >= 5
    assert tree.evictable_size() == before[1] - queued
    assert tree.num_nodes < before[0]
    full.held = table
    tree.flush_pending()
    assert [len(f) for f in sink.freed] == [queued] and full._pending == []
    tree.check_integrity()
