"""PageKeyer: chained, namespaced, whole-page keys, identical across processes."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
import textwrap
from collections.abc import Callable

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from kvstrata.storage import MemoryStorage, PageKeyer
from kvstrata.storage.errors import InvalidParameter
from kvstrata.storage.keys import KEY_BYTES

HASHES = ["sha256", "blake2b", "xxh3"]
TOKENS = list(range(1000, 1040))


@pytest.mark.parametrize("hash_name", HASHES)
def test_one_key_per_whole_page_of_the_documented_length(hash_name: str) -> None:
    keyer = PageKeyer(page_size=8, namespace=b"m", hash=hash_name)  # pyright: ignore
    keys = keyer.page_keys(TOKENS[:35])
    assert len(keys) == 4
    assert all(len(k) == KEY_BYTES[hash_name] == keyer.key_bytes for k in keys)
    assert len(set(keys)) == 4
    assert keyer.page_keys(TOKENS[:7]) == []
    assert keyer.page_keys([]) == []


@pytest.mark.parametrize("hash_name", HASHES)
def test_keys_are_a_chain(hash_name: str) -> None:
    keyer = PageKeyer(page_size=4, hash=hash_name)  # pyright: ignore
    keys = keyer.page_keys(TOKENS)
    # A prefix gives the prefix of the keys, and `parent` continues the chain.
    assert keyer.page_keys(TOKENS[:12]) == keys[:3]
    assert keyer.page_keys(TOKENS[12:], parent=keys[2]) == keys[3:]
    # The same page after another prefix gets another key.
    other = keyer.page_keys([7, 7, 7, 7, *TOKENS[4:8]])
    assert other[1] != keys[1]
    # One token changed changes its page's key and every later one, not the earlier ones.
    changed = list(TOKENS)
    changed[9] += 1
    new = keyer.page_keys(changed)
    assert new[:2] == keys[:2]
    assert all(a != b for a, b in zip(new[2:], keys[2:], strict=True))


@pytest.mark.parametrize("hash_name", HASHES)
def test_namespace_adapter_and_salt_separate_keys(hash_name: str) -> None:
    def keys(namespace: bytes | str = b"m", **kwargs: bytes | str | None) -> list[bytes]:
        keyer = PageKeyer(page_size=4, namespace=namespace, hash=hash_name)  # pyright: ignore
        return keyer.page_keys(TOKENS[:8], **kwargs)  # pyright: ignore[reportArgumentType]

    variants = [
        keys(),
        keys(namespace=b"other-model"),
        keys(extra_key="lora-1"),
        keys(extra_key="lora-2"),
        keys(extra_key=b"lora-1"),  # bytes and str are different namespaces
        keys(extra_key=""),  # the empty adapter is not "no adapter"
        keys(cache_salt="tenant-a"),
        keys(cache_salt="tenant-b"),
        keys(extra_key="lora-1", cache_salt="tenant-a"),
        keys(extra_key="tenant-a", cache_salt="lora-1"),  # fields do not run together
    ]
    firsts = [v[0] for v in variants]
    assert len(set(firsts)) == len(firsts)
    assert keys(extra_key="lora-1") == keys(extra_key="lora-1")


def test_other_salt_misses_in_storage() -> None:
    storage = MemoryStorage(capacity_bytes=1 << 20)
    keyer = PageKeyer(page_size=4, namespace=b"m")
    ours = keyer.page_keys(TOKENS, cache_salt="tenant-a")
    storage.batch_set(ours, [b"x" * 8] * len(ours))
    assert storage.batch_exists(keyer.page_keys(TOKENS, cache_salt="tenant-a")) == len(ours)
    assert storage.batch_exists(keyer.page_keys(TOKENS, cache_salt="tenant-b")) == 0
    assert storage.batch_exists(keyer.page_keys(TOKENS, extra_key="lora-1")) == 0


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


@pytest.mark.parametrize(
    ("hash_name", "digest", "pinned_key0"),
    [
        ("sha256", _sha256, "dc3422a769e15bf936135b8953cb31dd2b0adbdf925fb6cf14667118e05da1eb"),
        ("xxh3", xxhash.xxh3_128_digest, "a9b33a1dc2dad90a070026c64caccb38"),
    ],
)
def test_keys_follow_the_documented_encoding(
    hash_name: str, digest: Callable[[bytes], bytes], pinned_key0: str
) -> None:
    def field(tag: int, data: bytes) -> bytes:
        return bytes([tag]) + struct.pack("<Q", len(data)) + data

    seed = digest(
        b"kvstrata.storage.page-key.v1"
        + field(2, hash_name.encode())
        + struct.pack("<Q", 4)
        + field(1, b"golden")
        + field(2, b"lora-7")
        + field(1, b"s")
    )
    tokens = list(range(10))
    key0 = digest(seed + struct.pack("<4q", *tokens[:4]))
    key1 = digest(key0 + struct.pack("<4q", *tokens[4:8]))
    keyer = PageKeyer(page_size=4, namespace=b"golden", hash=hash_name)  # pyright: ignore
    assert keyer.page_keys(tokens, extra_key="lora-7", cache_salt=b"s") == [key0, key1]
    # Pinned: a change of this value (or of xxhash's canonical digest) breaks every L3 tier
    # written with this hash before it.
    assert key0.hex() == pinned_key0


def test_xxh3_digest_is_the_canonical_big_endian_form() -> None:
    # XXH3-128 of the empty input, from the xxHash reference: the digest is the canonical
    # (big-endian) form on every platform.
    assert xxhash.xxh3_128_digest(b"").hex() == "99aa06d3014798d86001c324468d497f"


@pytest.mark.parametrize("hash_name", HASHES)
def test_token_containers_give_the_same_keys(hash_name: str) -> None:
    keyer = PageKeyer(page_size=4, hash=hash_name)  # pyright: ignore
    expected = keyer.page_keys(TOKENS)
    assert keyer.page_keys(np.array(TOKENS, dtype=np.int32)) == expected
    assert keyer.page_keys(np.array(TOKENS, dtype=np.uint16)) == expected
    assert keyer.page_keys(torch.tensor(TOKENS, dtype=torch.int64)) == expected
    assert keyer.page_keys(tuple(TOKENS)) == expected


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(InvalidParameter):
        PageKeyer(page_size=0)
    with pytest.raises(InvalidParameter):
        PageKeyer(page_size=4, hash="md5")  # pyright: ignore[reportArgumentType]
    keyer = PageKeyer(page_size=4)
    with pytest.raises(InvalidParameter):
        keyer.page_keys([1.5, 2.0, 3.0, 4.0])
    with pytest.raises(InvalidParameter):
        keyer.page_keys([[1, 2], [3, 4]])
    with pytest.raises(InvalidParameter):
        keyer.page_keys(np.array([2**63] * 4, dtype=np.uint64))
    with pytest.raises(InvalidParameter):
        keyer.page_keys([2**70] * 4)
    with pytest.raises(InvalidParameter):
        keyer.page_keys(TOKENS, parent=b"short")


_CHILD = """
    import json, sys
    from kvstrata.storage import PageKeyer
    out = {}
    for h in ("sha256", "blake2b", "xxh3"):
        keyer = PageKeyer(page_size=16, namespace="model-x", hash=h)
        keys = keyer.page_keys(list(range(100, 164)), extra_key="a", cache_salt="s")
        out[h] = [k.hex() for k in keys]
    print(json.dumps(out))
"""


def test_keys_are_identical_in_another_process() -> None:
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_CHILD)],
        capture_output=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
    )
    theirs = json.loads(child.stdout)
    for h in HASHES:
        keyer = PageKeyer(page_size=16, namespace="model-x", hash=h)  # pyright: ignore
        ours = keyer.page_keys(list(range(100, 164)), extra_key="a", cache_salt="s")
        assert theirs[h] == [k.hex() for k in ours]


@pytest.mark.parametrize("hash_name", HASHES)
def test_no_collisions_on_near_identical_pages(hash_name: str) -> None:
    keyer = PageKeyer(page_size=16, hash=hash_name)  # pyright: ignore
    base = np.arange(16, dtype=np.int64)
    keys = {keyer.page_keys(base)[0]}
    for position in range(16):
        for delta in (1, 2, 1 << 16, 1 << 32, -1):
            page = base.copy()
            page[position] += delta
            keys.add(keyer.page_keys(page)[0])
    swapped = base.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    keys.add(keyer.page_keys(swapped)[0])
    assert len(keys) == 1 + 16 * 5 + 1
    # Reordered pages and a repeated page far apart still give distinct chains.
    a, b = list(range(16)), list(range(16, 32))
    assert keyer.page_keys(a + b)[1] != keyer.page_keys(b + a)[1]
    many = keyer.page_keys(a * 200)
    assert len(set(many)) == 200


@given(
    tokens=st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=80),
    split_pages=st.integers(min_value=0, max_value=20),
    page_size=st.sampled_from([1, 3, 8]),
    hash_name=st.sampled_from(HASHES),
)
def test_any_split_at_a_page_boundary_continues_the_chain(
    tokens: list[int], split_pages: int, page_size: int, hash_name: str
) -> None:
    keyer = PageKeyer(page_size=page_size, hash=hash_name)  # pyright: ignore
    whole = keyer.page_keys(tokens)
    assert len(whole) == len(tokens) // page_size
    cut = min(split_pages, len(whole)) * page_size
    head = keyer.page_keys(tokens[:cut])
    if head:
        assert head + keyer.page_keys(tokens[cut:], parent=head[-1]) == whole
    else:
        assert keyer.page_keys(tokens[cut:]) == whole


@pytest.mark.parametrize("hash_name", HASHES)
@given(
    tokens=st.lists(st.integers(min_value=-(2**63), max_value=2**63 - 1), max_size=40),
    salt=st.one_of(st.none(), st.binary(max_size=4)),
)
def test_chain_gives_the_checked_keys(
    hash_name: str, tokens: list[int], salt: bytes | None
) -> None:
    """`chain` (the tiers' unchecked path) equals `page_keys` from a seed or a parent key,
    trailing partial page ignored, for every hash."""
    keyer = PageKeyer(page_size=4, namespace=b"ns", hash=hash_name)  # pyright: ignore[reportArgumentType]
    arr = np.array(tokens, dtype=np.int64)
    seed = keyer.seed(cache_salt=salt)
    assert keyer.chain(arr, seed) == keyer.page_keys(arr, cache_salt=salt)
    parent = keyer.page_keys(np.arange(4, dtype=np.int64))[0]
    assert keyer.chain(arr, parent) == keyer.page_keys(arr, parent=parent)
    assert keyer.chain(arr[1:][::-1], parent) == keyer.page_keys(arr[1:][::-1], parent=parent)
