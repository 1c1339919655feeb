"""The compiled match of a Full-only tree with a host tier (`match_tiered` in radix_core.c,
taken by `HostWalks.match`) gives the Python walk's answers: the same requests through a
`HierarchicalCache` built with the compiled core and one built inside `native.disabled()`
leave the same tree (nodes, device and host slots, access times, hit counts, locks, sizes)
and report the same hits after every step; the compiled function refuses bad nodes with an
exception; and only a Full-only tree takes it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings

from kvstrata.pool import native
from kvstrata.testkit.tiers import assert_served_alike, make_hierarchy, page_prompts, serve_bare
from kvstrata.unified_radix_cache import RadixKey
from kvstrata.unified_radix_cache.native_core import native_core

CORE = native_core()
needs_core = pytest.mark.skipif(CORE is None, reason="no compiled radix core (no compiler?)")

PAGE = 4


@needs_core
@settings(max_examples=40, deadline=None)
@given(prompts=page_prompts(PAGE))
def test_the_compiled_tiered_match_gives_the_python_answers(prompts: list[list[int]]) -> None:
    compiled = make_hierarchy("full", page_size=PAGE, device_pages=6, host_pages=10)
    with native.disabled():
        python = make_hierarchy("full", page_size=PAGE, device_pages=6, host_pages=10)
    assert compiled.tree._native is not None and python.tree._native is None
    assert_served_alike(compiled, python, prompts, drain=False)


@needs_core
@pytest.mark.parametrize(("shape", "expected"), [("full", 1), ("mamba", 0), ("swa", 0)])
def test_only_a_full_only_tiered_tree_takes_the_compiled_match(
    shape: Any, expected: int, counting: Callable[[object, list[str]], Any]
) -> None:
    h = make_hierarchy(shape, page_size=PAGE)
    try:
        assert CORE is not None
        calls: list[str] = []
        h.tree._native = counting(CORE, calls)
        tokens = [1] * PAGE + [2] * PAGE + [9]
        serve_bare(h, tokens, drain=False)
        calls.clear()
        # (Mamba hits only where a state was cached: this engine gives none.)
        assert serve_bare(h, tokens, drain=False)[0] == (0 if shape == "mamba" else 2 * PAGE)
        assert calls.count("match_tiered") == expected
        h.cache.check_integrity()
    finally:
        h.cache.controller.close()


@needs_core
def test_a_host_hit_comes_back_through_the_compiled_match() -> None:
    """A prefix pushed off the device (kept on the host) matches as a host hit, with the
    device part's slots joined by the compiled call."""
    h = make_hierarchy("full", page_size=PAGE, device_pages=6, host_pages=16)
    try:
        first = [1] * PAGE + [2] * PAGE + [9]
        serve_bare(h, first, drain=True)
        for k in range(3, 8):  # fill the device: the first prompt's pages leave it
            serve_bare(h, [k] * (2 * PAGE) + [9], drain=True)
        match = h.tree.match_prefix(RadixKey(first), max_len=len(first) - 1)
        assert (match.prefix_len, match.host_hit_len) == (0, 2 * PAGE)
        assert match.last_host_node is not None and not len(match.last_host_node.value)
        assert serve_bare(h, first, drain=False)[:2] == (0, 2 * PAGE)  # loaded back to the device
        match = h.tree.match_prefix(RadixKey(first), max_len=len(first) - 1)
        assert (match.prefix_len, match.host_hit_len) == (2 * PAGE, 0)
        assert len(match.device_indices) == 2 * PAGE
        h.cache.check_integrity()
    finally:
        h.cache.controller.close()


@needs_core
def test_the_compiled_tiered_match_refuses_bad_nodes_with_an_exception() -> None:
    assert CORE is not None
    h = make_hierarchy("full", page_size=2)
    try:
        tokens = [1, 2, 3, 4, 9]
        serve_bare(h, tokens, drain=False)
        root = h.tree.root
        data = RadixKey(tokens[:4]).token_bytes()
        (leaf,) = h.tree.iter_nodes()
        good_value = leaf.value
        leaf.value = good_value[:1]
        with pytest.raises(ValueError, match="node value"):
            CORE.match_tiered(root, 16, None, data, 32, h.tree.split_node, 5)
        leaf.value = good_value
        good_key = leaf.key
        leaf.key = "not bytes"  # pyright: ignore[reportAttributeAccessIssue]
        with pytest.raises(TypeError, match="bytes"):
            CORE.match_tiered(root, 16, None, data, 32, h.tree.split_node, 5)
        leaf.key = good_key
        with pytest.raises(TypeError, match="tick"):
            CORE.match_tiered(root, 16, None, data, 32, h.tree.split_node, "5")  # pyright: ignore[reportArgumentType]
        with pytest.raises(TypeError):
            CORE.match_tiered(root, 16, None, data, 32)  # pyright: ignore[reportCallIssue]
        assert CORE.match_tiered(root, 16, None, data, 0, h.tree.split_node, 5) == ([], 0, 0, None)
        h.cache.check_integrity()
    finally:
        h.cache.controller.close()
