"""The compiled page-key chain (`page_keys.c`, key_chain.py) gives `PageKeyer.chain`'s keys:
both of its rounds (SHA extensions, portable) agree with hashlib on every message length
around the block and padding boundaries, the chain with the keyer on random tokens, parents
and page sizes, and a storage hierarchy built with it serves, names and stores exactly as one
built inside `native.disabled()`. Keyers it does not cover keep `keyer.chain`, and the module
refuses bad input with an exception."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstrata.hybrid_cache import ControllerParams, PrefetchPolicy
from kvstrata.pool import native
from kvstrata.storage import MemoryStorage
from kvstrata.storage.keys import PageKeyer
from kvstrata.testkit.tiers import (
    Hierarchy,
    assert_served_alike,
    make_hierarchy,
    page_prompts,
    returning_prompts,
)
from kvstrata.unified_radix_cache.key_chain import chain_of, page_keys_module
from kvstrata.unified_radix_cache.tiers import TierParams, WritePolicy

MODULE = page_keys_module()
needs_module = pytest.mark.skipif(MODULE is None, reason="no compiled page keys (no compiler?)")

INT64 = st.integers(-(2**63), 2**63 - 1)


@needs_module
@pytest.mark.parametrize("portable", [False, True])
@settings(max_examples=200, deadline=None)
@given(prefix=st.binary(max_size=64), body=st.binary(max_size=300))
def test_one_piece_is_the_sha256_of_parent_and_piece(
    prefix: bytes, body: bytes, portable: bool
) -> None:
    assert MODULE is not None
    got = MODULE.sha256_chain(body, len(body), prefix, max(len(body), 1), portable)
    assert got == ([hashlib.sha256(prefix + body).digest()] if body else [])


@needs_module
@pytest.mark.parametrize("portable", [False, True])
def test_every_length_across_the_block_and_padding_boundaries(portable: bool) -> None:
    assert MODULE is not None
    data = bytes(range(256)) * 2
    for prefix_len in (0, 1, 32, 55, 56, 63, 64):
        prefix = data[100 : 100 + prefix_len]
        for body_len in range(200):
            body = data[:body_len]
            got = MODULE.sha256_chain(body, body_len, prefix, max(body_len, 1), portable)
            assert got == ([hashlib.sha256(prefix + body).digest()] if body_len else [])


@needs_module
@settings(max_examples=150, deadline=None)
@given(
    page=st.integers(1, 20),
    tokens=st.lists(INT64, max_size=90),
    parent=st.one_of(st.binary(min_size=32, max_size=32), st.none()),
    extra=st.one_of(st.none(), st.text(max_size=4)),
)
def test_the_chain_gives_the_keyers_keys(
    page: int, tokens: list[int], parent: bytes | None, extra: str | None
) -> None:
    assert MODULE is not None
    keyer = PageKeyer(page_size=page)
    start = keyer.seed(extra_key=extra) if parent is None else parent
    ids = np.array(tokens, dtype=np.int64)
    expected = keyer.chain(ids, start)
    chain = chain_of(keyer)
    assert chain(ids, start) == expected
    assert chain(ids.tobytes(), start) == expected  # a node's key: native int64 bytes
    whole = len(tokens) // page * page * 8
    assert MODULE.sha256_chain(ids, whole, start, page * 8, True) == expected
    assert expected == keyer.page_keys(ids, parent=start) if ids.size else expected == []


@needs_module
def test_arrays_it_cannot_read_as_they_are_go_to_the_keyer() -> None:
    keyer = PageKeyer(page_size=2)
    chain = chain_of(keyer)
    ids = np.arange(12, dtype=np.int64)
    for odd in (ids[::2], ids.astype(np.int32), ids.astype(">i8")):
        assert chain(odd, keyer.seed()) == keyer.chain(odd, keyer.seed())  # type: ignore[arg-type]


def test_keyers_it_does_not_cover_keep_their_own_chain() -> None:
    ids = np.arange(8, dtype=np.int64)

    class Keyer(PageKeyer):
        pass

    for keyer in (
        PageKeyer(page_size=2, hash="blake2b"),
        PageKeyer(page_size=2, hash="xxh3"),
        Keyer(page_size=2),
    ):
        chain = chain_of(keyer)
        assert chain.func.__name__ == "_python_chain"  # type: ignore[attr-defined]
        assert chain(ids, keyer.seed()) == keyer.chain(ids, keyer.seed())
        assert chain(ids.tobytes(), keyer.seed()) == keyer.chain(ids, keyer.seed())
    with native.disabled():
        chain = chain_of(PageKeyer(page_size=2))
    assert chain.func.__name__ == "_python_chain"  # type: ignore[attr-defined]


@needs_module
def test_bad_input_is_refused_with_an_exception() -> None:
    assert MODULE is not None
    chain = MODULE.sha256_chain
    data = bytes(32)
    with pytest.raises(TypeError):
        chain(data, 32, "parent", 16, False)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="longer than 64"):
        chain(data, 32, bytes(65), 16, False)
    with pytest.raises(ValueError, match="end outside"):
        chain(data, 33, bytes(32), 16, False)
    with pytest.raises(ValueError, match="end outside"):
        chain(data, -1, bytes(32), 16, False)
    with pytest.raises(ValueError, match="step"):
        chain(data, 32, bytes(32), 0, False)
    with pytest.raises(ValueError, match="not C-contiguous"):  # numpy's refusal
        chain(np.arange(8, dtype=np.int64)[::2], 16, bytes(32), 16, False)
    with pytest.raises(TypeError):
        chain(data, 32, bytes(32), 16)  # type: ignore[call-arg]


def _storage_hierarchy(storage: MemoryStorage) -> Hierarchy:
    """A Full hierarchy over `storage` that runs every transfer on the caller's thread
    (inline, wait_complete prefetches): two of them serve a prompt list identically."""
    return make_hierarchy(
        "full",
        device_pages=6,
        host_pages=10,
        storage=storage,
        controller_params=ControllerParams(run_inline=True),
        params=TierParams(
            write_policy=WritePolicy.WRITE_THROUGH,
            prefetch_policy=PrefetchPolicy.WAIT_COMPLETE,
            prefetch_threshold=4,
        ),
    )


def _serve_both(prompts: list[list[int]]) -> tuple[Hierarchy, MemoryStorage, MemoryStorage]:
    """`prompts` through a hierarchy built with the compiled chain and one built inside
    `native.disabled()` (`assert_served_alike`: the same hits, trees with the same page keys
    and counters after every step); then both stores hold the same pages under the same keys,
    in the same order. Returns the compiled one and the stores."""
    stores = (MemoryStorage(capacity_bytes=1 << 24), MemoryStorage(capacity_bytes=1 << 24))
    compiled = _storage_hierarchy(stores[0])
    with native.disabled():
        python = _storage_hierarchy(stores[1])
    assert_served_alike(compiled, python, prompts, drain=True)
    assert list(stores[0]._pages.items()) == list(stores[1]._pages.items())
    return compiled, stores[0], stores[1]


@needs_module
@settings(max_examples=25, deadline=None)
@given(prompts=page_prompts(4))
def test_a_storage_hierarchy_stores_the_same_pages_under_the_same_keys(
    prompts: list[list[int]],
) -> None:
    _serve_both(prompts)


@needs_module
def test_prefetches_from_storage_name_the_same_keys() -> None:
    compiled, store, _ = _serve_both(returning_prompts(4))
    assert compiled.cache.counters.storage_hit_tokens > 0  # prefetches ran
    keyer = PageKeyer(page_size=4)
    assert keyer.page_keys(list(range(1, 13)))[0] in store._pages  # the keyer's own name
