"""Outputs cut from the numpy engine's `OutputSlab` behave as freshly allocated arrays: no two
overlap, a caller's writes reach nobody else, and they outlive the chunk's replacement."""

from __future__ import annotations

import itertools

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.allocator.scratch import SLAB_CHUNK_ENTRIES, SLAB_MAX_TAKE, OutputSlab
from kvstrata.testkit.allocators import idx, make_paged, make_token


def span(t: torch.Tensor) -> tuple[int, int]:
    """The byte range of a tensor's whole storage (not just its view)."""
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def assert_disjoint(tensors: list[torch.Tensor]) -> None:
    spans = sorted(span(t) for t in tensors)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start, "two outputs share memory"


def test_takes_never_overlap_and_roll_over_to_a_new_chunk() -> None:
    slab = OutputSlab()
    n = SLAB_MAX_TAKE
    taken = [slab.take(n) for _ in range(SLAB_CHUNK_ENTRIES // n + 2)]  # past one chunk
    for k, a in enumerate(taken):
        a[:] = k
    assert all((a == k).all() for k, a in enumerate(taken)), "a take overwrote another"
    bases = {id(a.base) for a in taken}
    assert len(bases) == 2, "the takes past the first chunk come from a second one"
    assert_disjoint([torch.from_numpy(a) for a in taken])


def test_a_large_take_gets_its_own_array() -> None:
    slab = OutputSlab()
    small = slab.take(8)
    big = slab.take(SLAB_MAX_TAKE + 1)
    assert big.base is None and len(big) == SLAB_MAX_TAKE + 1
    after = slab.take(8)  # the chunk carries on where it was
    assert after.base is small.base
    assert after.__array_interface__["data"][0] == small.__array_interface__["data"][0] + 64


def test_an_output_outlives_its_chunk() -> None:
    slab = OutputSlab()
    kept = torch.from_numpy(slab.take(4))
    kept[:] = torch.tensor([1, 2, 3, 4])
    for _ in range(3 * SLAB_CHUNK_ENTRIES // SLAB_MAX_TAKE):  # three chunks replaced
        slab.take(SLAB_MAX_TAKE)[:] = -1
    assert kept.tolist() == [1, 2, 3, 4]


def test_decode_outputs_are_independent_across_many_rounds() -> None:
    # Enough rounds of a 64-request batch to cut outputs from more than one chunk.
    a = make_paged(page_size=4, num_pages=200, backend="numpy")
    held = a.alloc(4 * 64)
    assert held is not None
    last = held.view(64, 4)[:, 1]  # each request holds 2 tokens: the decode continues its page
    seq = torch.full((64,), 3, dtype=torch.int64)
    outs: list[torch.Tensor] = []
    for _ in range(SLAB_CHUNK_ENTRIES // 64 + 4):
        out = a.alloc_decode(seq, last)
        assert out is not None and torch.equal(out, last + 1)
        outs.append(out)
        a.free(idx([]))  # an empty free between rounds changes nothing
    outs[0].add_(1000)  # a caller writing its output reaches no other output
    assert all(torch.equal(o, last + 1) for o in outs[1:])
    assert_disjoint(outs)
    a.free(held)
    assert a.available_size() == a.size
    a.check_integrity()


def test_decode_opening_every_page_and_token_alloc_outputs_are_fresh() -> None:
    paged = make_paged(page_size=4, num_pages=64, backend="numpy")
    first = paged.alloc_decode(idx([1, 5]), None)  # every request opens a page
    second = paged.alloc_decode(idx([1]), None)
    assert first is not None and second is not None
    assert first.tolist() == [4, 8] and second.tolist() == [12]
    token = make_token(size=32, backend="numpy")
    t1, t2 = token.alloc(3), token.alloc(2)
    assert t1 is not None and t2 is not None
    assert t1.tolist() == [1, 2, 3] and t2.tolist() == [4, 5]
    assert_disjoint([first, second, t1, t2])
    t1.zero_()  # the caller's copy, not the free list
    token.free(t2)
    assert token.alloc(2) is not None
    token.check_integrity()
    np.testing.assert_array_equal(second.numpy(), [12])


@given(sizes=st.lists(st.integers(0, 2 * SLAB_MAX_TAKE), min_size=1, max_size=60))
def test_any_sequence_of_takes_gives_disjoint_arrays_that_keep_their_contents(
    sizes: list[int],
) -> None:
    slab = OutputSlab()
    taken: list[np.ndarray] = []
    for k, n in enumerate(sizes):
        a = slab.take(n)
        assert a.shape == (n,) and a.dtype == np.int64 and a.flags["C_CONTIGUOUS"]
        a[:] = k
        taken.append(a)
        assert all((b == j).all() for j, b in enumerate(taken)), "a take overwrote another"
    assert_disjoint([torch.from_numpy(a) for a in taken if len(a)])
