"""The request life cycle: begin, chunked prefill, finish, abort."""

from __future__ import annotations

import pytest
import torch

from kvstrata.testkit.trees import make_tree
from kvstrata.unified_radix_cache import RadixKey
from kvstrata.unified_radix_cache.errors import InvalidInsert, RequestFinished


@pytest.mark.parametrize("page_size", (1, 4))
def test_chunked_prefill_then_finish(family: str, page_size: int) -> None:
    kit = make_tree(family, page_size=page_size, sliding_window=2)
    tree = kit.tree
    prompt = list(range(20))
    req = tree.begin_request(RadixKey(prompt))
    assert req.cached_len == 0 and req.receipt is not None
    if family == "mamba":
        req.state_slot = kit.alloc_state()
    slots = kit.alloc(8)
    req.extend(slots)  # first chunk
    tree.cache_unfinished_request(req)
    assert req.cached_len == 8 and req.kv_indices.tolist() == slots[:8].tolist()
    assert tree.protected_size() == 8
    kit.check(req.held())
    req.extend(
        kit.alloc(-(-11 // page_size) * page_size)[:11]
    )  # second chunk: 19 tokens, unaligned at page size 4
    tree.cache_unfinished_request(req)
    assert req.cached_len == (19 // page_size) * page_size
    kit.check(req.held())
    tree.cache_finished_request(req)
    assert req.finished and req.receipt is None and tree.num_locked == 0
    kit.check()
    with pytest.raises(RequestFinished):
        tree.cache_finished_request(req)


def test_second_request_reuses_and_frees_its_duplicates(family: str) -> None:
    kit = make_tree(family, page_size=2, sliding_window=2)
    tree = kit.tree
    first = tree.begin_request(RadixKey(list(range(10))))
    if family == "mamba":
        first.state_slot = kit.alloc_state()
    first.extend(kit.alloc(10))
    tree.cache_finished_request(first)
    kit.check()
    second = tree.begin_request(RadixKey([*range(10), 42, 43]))
    assert second.hit_len == 10
    assert (
        second.kv_indices.tolist()
        == tree.match_prefix(RadixKey(list(range(10)))).device_indices.tolist()
    )
    if family == "mamba":
        assert second.state_slot is not None  # its own copy of the cached state
    second.extend(kit.alloc(2))
    kit.check(second.held())
    tree.cache_finished_request(second)
    kit.check()
    assert tree.match_prefix(RadixKey([*range(10), 42, 43])).prefix_len == 12


def test_concurrent_requests_insert_the_same_prefix_once() -> None:
    kit = make_tree("full", page_size=1)
    tree = kit.tree
    reqs = [tree.begin_request(RadixKey([1, 2, 3, 4, i])) for i in range(3)]
    for req in reqs:
        req.extend(kit.alloc(5))
    free_before = kit.full.available_size()
    for req in reqs:
        tree.cache_finished_request(req)
    # the first keeps 5 tokens; each later one frees its 4 duplicates of [1, 2, 3, 4]
    assert kit.full.available_size() == free_before + 8
    assert tree.evictable_size() == 4 + 3
    kit.check()


def test_extend_rejects_more_slots_than_tokens() -> None:
    kit = make_tree("full", page_size=1)
    req = kit.tree.begin_request(RadixKey([1, 2]))
    with pytest.raises(InvalidInsert):
        req.extend(torch.arange(1, 4))
    kit.tree.abort_request(req)
    with pytest.raises(RequestFinished):
        req.extend(torch.arange(1, 2))


def test_swa_request_that_dropped_its_early_window() -> None:
    kit = make_tree("swa", page_size=2, sliding_window=2)
    tree = kit.tree
    req = tree.begin_request(RadixKey(list(range(8))))
    req.extend(kit.alloc(8))
    kit.full.free_swa(req.kv_indices[:4])  # type: ignore[attr-defined]  (slid out of the window)
    req.swa_evicted_len = 4
    kit.check(req.held())
    tree.cache_finished_request(req)
    assert tree.evictable_size("full") == 8 and tree.evictable_size("swa") == 4
    assert tree.match_prefix(RadixKey(list(range(8)))).prefix_len == 8  # live window at the end
    assert tree.match_prefix(RadixKey(list(range(4)))).prefix_len == 0  # only tombstones there
    kit.check()
