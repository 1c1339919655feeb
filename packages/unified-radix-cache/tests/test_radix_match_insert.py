"""BEHAVIOURS.md 1-4, 6-8: matching and keys, for Full, Full+SWA and Full+Mamba trees."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstrata.testkit.trees import make_tree
from kvstrata.unified_radix_cache import RadixKey
from kvstrata.unified_radix_cache.errors import InvalidInsert, InvalidKey


@pytest.fixture(params=(1, 4))
def page_size(request: pytest.FixtureRequest) -> int:
    """Page sizes 1 and 4 in turn (with `family`: every family at each)."""
    return int(request.param)


def test_empty_cache_and_first_insert(family: str, page_size: int) -> None:
    """1. An empty cache matches 0; insert returns what was present; sizes grow by new tokens."""
    kit = make_tree(family, page_size=page_size)
    tree = kit.tree
    m = tree.match_prefix(RadixKey(list(range(8))))
    assert m.prefix_len == 0 and m.device_indices.numel() == 0 and m.last_node is tree.root
    r, _ = kit.put(list(range(8)))
    assert (r.prefix_len, r.inserted_len) == (0, 8)
    assert tree.evictable_size() == 8 and tree.protected_size() == 0
    r2, _ = kit.put(list(range(12)))
    assert (r2.prefix_len, r2.inserted_len) == (8, 4)
    assert tree.evictable_size() == 12
    kit.check()


def test_exact_and_shorter_match_return_exact_slots(family: str, page_size: int) -> None:
    """2. An exact match returns every stored slot; a shorter query exactly its own prefix."""
    kit = make_tree(family, page_size=page_size, sliding_window=1)
    tree = kit.tree
    _, slots = kit.put(list(range(16)))
    m = tree.match_prefix(RadixKey(list(range(16))))
    assert m.prefix_len == 16
    assert m.device_indices.tolist() == slots.tolist()
    if family != "mamba":  # Mamba can only end where a state is stored
        m = tree.match_prefix(RadixKey(list(range(8))))
        assert m.prefix_len == 8 and m.device_indices.tolist() == slots[:8].tolist()
        m = tree.match_prefix(RadixKey([*range(8), 99, 98, 97, 96]))
        assert m.prefix_len == 8 and m.device_indices.tolist() == slots[:8].tolist()
    kit.check()


def test_only_whole_pages_match(family: str) -> None:
    """3. With page size P only whole pages are stored and matched."""
    kit = make_tree(family, page_size=4)
    tree = kit.tree
    r, slots = kit.put(list(range(10)))
    assert r.inserted_len == 8  # the partial last page stays the caller's
    m = tree.match_prefix(RadixKey(list(range(10))))
    assert m.prefix_len % 4 == 0
    if family != "mamba":  # no state for an unaligned key: nothing restorable
        assert m.prefix_len == 8 and m.device_indices.tolist() == slots[:8].tolist()
        # a divergence inside page 2 gives page 1 only
        m = tree.match_prefix(RadixKey([0, 1, 2, 3, 4, 5, 99, 7]))
        assert m.prefix_len == 4
    kit.check()


def test_engine_computes_at_least_one_token(family: str, page_size: int) -> None:
    """4. begin_request matches at most N - 1 tokens, rounded down to a page."""
    kit = make_tree(family, page_size=page_size, sliding_window=1)
    tree = kit.tree
    kit.put(list(range(8)))
    if family == "mamba":
        kit.put(list(range(4)))  # a state where the capped match can end
    req = tree.begin_request(RadixKey(list(range(8))))
    # Mamba can end only at a stored state (after token 4 here); the others at N - 1 rounded.
    assert req.hit_len == (4 if family == "mamba" else ((8 - 1) // page_size) * page_size)
    assert tree.match_prefix(RadixKey(list(range(8))), max_len=7).prefix_len == req.hit_len
    held = req.held()
    kit.check(held)
    tree.abort_request(req)
    kit.check()


def test_namespaces_never_share_a_node(family: str, page_size: int) -> None:
    """6. A different extra_key or cache_salt makes identical tokens miss."""
    kit = make_tree(family, page_size=page_size)
    tree = kit.tree
    tokens = list(range(8))
    kit.put(tokens)
    assert tree.match_prefix(RadixKey(tokens, extra_key="lora-a")).prefix_len == 0
    assert tree.match_prefix(RadixKey(tokens, cache_salt="tenant-1")).prefix_len == 0
    r, slots = kit.put(tokens, extra_key="lora-a")
    assert r.prefix_len == 0 and r.inserted_len == 8
    m = tree.match_prefix(RadixKey(tokens, extra_key="lora-a"))
    assert m.prefix_len == 8 and m.device_indices.tolist() == slots.tolist()
    assert m.last_node.namespace == ("lora-a", None)
    assert tree.match_prefix(RadixKey(tokens, "lora-a", "tenant-1")).prefix_len == 0
    assert len(tree.root.children) == 2
    kit.check()


def test_decode_fills_the_partial_page_then_shares_it(family: str) -> None:
    """7. Decode tokens fill the partial page; it becomes shareable once full."""
    kit = make_tree(family, page_size=4, sliding_window=1)
    tree = kit.tree
    prompt = [10, 11, 12, 13, 14, 15]
    req = tree.begin_request(RadixKey(prompt))
    page = kit.alloc(8)  # two pages: tokens 0-3 and 4-7
    req.extend(page[:6])
    if family == "mamba":
        req.state_slot = kit.alloc_state()
    tree.cache_unfinished_request(req)
    assert req.cached_len == 4
    assert tree.match_prefix(RadixKey([*prompt, 16, 17])).prefix_len in (0, 4)
    req.extend(page[6:7], token_ids=[16])
    assert tree.match_prefix(RadixKey([*prompt, 16, 17])).prefix_len <= 4  # page 2 not full yet
    req.extend(page[7:8], token_ids=[17])
    tree.cache_unfinished_request(req)
    assert req.cached_len == 8
    m = tree.match_prefix(RadixKey([*prompt, 16, 17, 18]))
    assert m.prefix_len == 8
    assert m.device_indices.tolist() == page.tolist()
    kit.check(req.held())
    tree.cache_finished_request(req)
    kit.check()


def test_disabled_cache_never_hits_and_stores_nothing(family: str) -> None:
    """8. A disabled cache never hits and adopts no slot (the caller keeps them all)."""
    kit = make_tree(family, page_size=2, disable=True, enable_events=True)
    tree = kit.tree
    slots = kit.alloc(8)
    r = tree.insert(RadixKey(list(range(8))), slots)
    assert (r.prefix_len, r.inserted_len, r.duplicates(slots).numel()) == (0, 0, 0)
    assert tree.match_prefix(RadixKey(list(range(8)))).prefix_len == 0
    assert tree.evictable_size() == 0 and tree.num_nodes == 0
    assert tree.take_events() == []
    kit.full.free(slots)
    kit.check()


def test_insert_copies_the_slots_it_adopts() -> None:
    kit = make_tree("full", page_size=1)
    slots = kit.alloc(4)
    kit.tree.insert(RadixKey([1, 2, 3, 4]), slots)
    expected = slots.tolist()
    slots.fill_(0)  # the caller reuses its buffer
    assert kit.tree.match_prefix(RadixKey([1, 2, 3, 4])).device_indices.tolist() == expected


def test_match_result_is_a_copy() -> None:
    kit = make_tree("full", page_size=1)
    slots = kit.alloc(4)
    kit.tree.insert(RadixKey([1, 2, 3, 4]), slots)
    m = kit.tree.match_prefix(RadixKey([1, 2, 3, 4]))
    m.device_indices.fill_(0)
    assert kit.tree.match_prefix(RadixKey([1, 2, 3, 4])).device_indices.tolist() == slots.tolist()


def test_match_splits_at_the_divergence_without_changing_sizes() -> None:
    kit = make_tree("full", page_size=2)
    tree = kit.tree
    slots = kit.alloc(8)
    tree.insert(RadixKey(list(range(8))), slots)
    m = tree.match_prefix(RadixKey([0, 1, 2, 3, 9, 9]))
    assert m.prefix_len == 4 and m.last_node.num_tokens == 4
    assert tree.num_nodes == 2 and tree.evictable_size() == 8
    kit.check()


@pytest.mark.parametrize(
    "ids",
    [[1, 2, 3], np.array([1, 2, 3], dtype=np.int32), torch.tensor([1, 2, 3]), np.array([1, 2, 3])],
    ids=["list", "int32", "tensor", "int64"],
)
def test_keys_accept_every_integer_sequence(ids: object) -> None:
    key = RadixKey(ids)  # type: ignore[arg-type]
    assert len(key) == 3
    assert key.tokens().tolist() == [1, 2, 3]
    assert key[1:].tokens().tolist() == [2, 3]


@pytest.mark.parametrize(
    "index", [slice(None, 5), slice(3, 9), slice(5, 2), slice(-4, None), slice(0, 99), slice(2, 2)]
)
def test_a_key_slice_carries_the_bytes_of_its_tokens(index: slice) -> None:
    key = RadixKey(list(range(20)), extra_key="adapter")
    key.token_bytes()
    part = key[index]
    assert part.cached_bytes is not None, "a contiguous slice reuses the computed bytes"
    assert part.token_bytes() == np.arange(20, dtype=np.int64)[index].tobytes()
    assert part.namespace == key.namespace and len(part) == len(range(20)[index])
    assert key[::2].tokens().tolist() == list(range(0, 20, 2))


@pytest.mark.parametrize("ids", [[1.5, 2.0], np.zeros((2, 2), dtype=np.int64), torch.tensor([1.0])])
def test_keys_reject_non_integer_ids(ids: object) -> None:
    with pytest.raises(InvalidKey):
        RadixKey(ids).token_bytes()  # type: ignore[arg-type]


def test_insert_rejects_mismatched_value_before_changing_anything() -> None:
    kit = make_tree("full", page_size=1)
    slots = kit.alloc(3)
    with pytest.raises(InvalidInsert):
        kit.tree.insert(RadixKey([1, 2, 3, 4]), slots)
    with pytest.raises(InvalidInsert):
        kit.tree.insert(RadixKey([1, 2, 3]), slots.float())
    assert kit.tree.num_nodes == 0
    kit.full.free(slots)
    kit.check()


def test_constructor_refuses_bad_configs_and_leaves_components_free() -> None:
    from kvstrata.allocator import TokenAllocator
    from kvstrata.storage.keys import PageKeyer
    from kvstrata.unified_radix_cache import FullComponent, SWAComponent, UnifiedRadixCache
    from kvstrata.unified_radix_cache.errors import InvalidConfig

    alloc = TokenAllocator(size=8, device="cpu")
    full = FullComponent(alloc)
    with pytest.raises(InvalidConfig):
        UnifiedRadixCache([full], page_size=0)
    with pytest.raises(InvalidConfig):
        UnifiedRadixCache([full], eviction_policy="random")
    with pytest.raises(InvalidConfig):
        UnifiedRadixCache([full], page_size=2, enable_events=True, keyer=PageKeyer(page_size=4))
    with pytest.raises(InvalidConfig):
        UnifiedRadixCache([SWAComponent(alloc, sliding_window=2)])  # type: ignore[arg-type]
    with pytest.raises(InvalidConfig):
        UnifiedRadixCache([full, FullComponent(alloc)])
    tree = UnifiedRadixCache([full])  # every refusal above left `full` unbound
    with pytest.raises(InvalidConfig):
        UnifiedRadixCache([full])  # now it is bound to `tree`
    assert tree.num_nodes == 0
